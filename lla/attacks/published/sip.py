"""SIP: the learned inverter of BiSR (Chen et al., CCS'24), trained on calibration pairs.

A per-position classifier reads the forward message and predicts the token at the same
position. Two variants, as in SplitLLM `sfl/model/attacker/sip/inversion_models.py`:

* `gru` (`GRUDRInverter`, the CR default): h [B, T, d] -> unidirectional GRU(d -> 256)
  -> dropout(0.1, training only) -> Linear(256 -> V).
* `linear` (`LinearSIPInverter`): Linear(d -> V), no dropout.

The GRU is PyTorch's (both biases, gates r, z, n) and weights start as PyTorch
initialises them (U(-1/sqrt(fan), 1/sqrt(fan)), fan the hidden size for the GRU and the
output Linear, the input size for the linear variant). Training (`train_inversion_model`,
CR hyperparameters): unshifted token cross-entropy `CE(logits[:, t], x[:, t])` averaged
over the batch's tokens; torch `Adam(lr 1e-3, weight_decay 1e-5)` (L2 added to the
gradient, not decoupled: `add_decayed_weights` before `adam`); 15 epochs of shuffled
batches of 6 documents; the pairs are (the attacker's client on its calibration documents,
those documents).

Checkpoint selection. The original evaluates held-out ROUGE-L on the auxiliary test split
every 5 epochs and loads the best checkpoint. lla has only the attacker's calibration
documents, so a seeded fraction `sip_holdout` of them is held out (never trained on), the
inverter is evaluated on it after every epoch, and the epoch with the highest held-out
positional token accuracy (lla's metric; ties to the earlier epoch) is kept.
`sip_holdout = 0` trains on every document and keeps the last epoch.

Training is the shared stage `sip_gru` / `sip_linear`: other attacks (BiSR(f), the BiSR
chain) call `inverter(ws, budget, key, variant)` and are charged its full cost. The stage
seed is `fold_in(attack key, crc32("sip_<variant>"))`: replay gives every attack the same
key, so the inverter does not depend on which attack trained it first.

Differences from the original, all deliberate: the attacker's client runs without
dropout (lla's GPT-2 has none; SplitLLM computed training activations with the LoRA
bottom in train mode); the last short batch of an epoch is padded with zero-weight
documents so every step runs one executable (the loss is the mean over real tokens, as
in PyTorch).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import zlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from lla.attacks import budget as budget_lib
from lla.attacks import flops
from lla.attacks import optimise, registry
from lla.attacks.workspace import Workspace

VARIANTS = ("gru", "linear")

budget_lib.declare("sip_epochs", 15, int, low=0, doc="SIP inverter training epochs",
                   source="SplitLLM [CR] add_train_dra_params @ b623e8f")
budget_lib.declare("sip_lr", 1e-3, float, low=0.0, strict_low=True, doc="SIP Adam learning rate",
                   source="SplitLLM [CR] add_train_dra_params @ b623e8f")
budget_lib.declare("sip_weight_decay", 1e-5, float, low=0.0,
                   doc="SIP Adam L2 weight decay (coupled, as torch.optim.Adam)",
                   source="SplitLLM [CR] add_train_dra_params @ b623e8f")
budget_lib.declare("sip_batch", 6, int, low=1, doc="SIP training documents per batch",
                   source="SplitLLM [CR] add_train_dra_params @ b623e8f")
budget_lib.declare("sip_hidden", 256, int, low=1, doc="SIP GRU hidden units",
                   source="SplitLLM LSTMDRAttackerConfig.hidden_size")
budget_lib.declare("sip_dropout", 0.1, float, low=0.0, high=0.99,
                   doc="SIP dropout on the GRU outputs while training",
                   source="SplitLLM LSTMDRAttackerConfig.dropout")
budget_lib.declare("sip_holdout", 0.25, float, low=0.0, high=0.9,
                   doc="fraction of calibration documents held out to select the SIP epoch",
                   source="lla (the original selects on a separate auxiliary test split)")

FIELDS = ("sip_epochs", "sip_lr", "sip_weight_decay", "sip_batch", "sip_hidden", "sip_dropout",
          "sip_holdout")


@dataclasses.dataclass(frozen=True)
class Settings:
  """What determines a trained inverter besides the workspace and the key."""

  variant: str
  epochs: int
  lr: float
  weight_decay: float
  batch: int
  hidden: int
  dropout: float
  holdout: float

  @classmethod
  def from_budget(cls, budget, variant: str) -> "Settings":
    if variant not in VARIANTS:
      raise ValueError(f"SIP variant {variant!r} is not one of {VARIANTS}")
    return cls(variant, int(budget.sip_epochs), float(budget.sip_lr),
               float(budget.sip_weight_decay), int(budget.sip_batch), int(budget.sip_hidden),
               float(budget.sip_dropout), float(budget.sip_holdout))


def _torch_uniform(fan_in: int):
  """PyTorch's default init of nn.Linear / nn.GRU weights and biases: U(-b, b), b = fan^-1/2."""
  bound = 1.0 / np.sqrt(fan_in)

  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, -bound, bound)
  return init


class GRU(nn.Module):
  """PyTorch's nn.GRU (one layer, unidirectional, batch_first, zero initial state, both
  biases, gates r, z, n): x [B, T, d] -> outputs [B, T, hidden]."""

  hidden: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    size, init = self.hidden, _torch_uniform(self.hidden)
    w_ih = self.param("w_ih", init, (x.shape[-1], 3 * size))
    w_hh = self.param("w_hh", init, (size, 3 * size))
    b_ih = self.param("b_ih", init, (3 * size,))
    b_hh = self.param("b_hh", init, (3 * size,))
    gates_x = x @ w_ih + b_ih  # every position's input gates in one matmul
    state = jnp.zeros(x.shape[:1] + (size,), x.dtype)
    outputs = []
    # Unrolled over T: straight-line code, so XLA's cost analysis counts every position.
    for t in range(x.shape[1]):
      gx, gh = gates_x[:, t], state @ w_hh + b_hh
      r = jax.nn.sigmoid(gx[:, :size] + gh[:, :size])
      z = jax.nn.sigmoid(gx[:, size:2 * size] + gh[:, size:2 * size])
      n = jnp.tanh(gx[:, 2 * size:] + r * gh[:, 2 * size:])
      state = (1.0 - z) * n + z * state
      outputs.append(state)
    return jnp.stack(outputs, axis=1)


class GRUInverter(nn.Module):
  """h [B, T, d] -> logits [B, T, V]: GRU(d -> hidden), dropout, Linear(hidden -> V)."""

  vocab_size: int
  hidden: int
  dropout: float

  @nn.compact
  def __call__(self, h: jax.Array, train: bool = False) -> jax.Array:
    init = _torch_uniform(self.hidden)
    y = GRU(self.hidden)(h)
    y = nn.Dropout(self.dropout, deterministic=not train)(y)
    return nn.Dense(self.vocab_size, kernel_init=init, bias_init=init)(y)


class LinearInverter(nn.Module):
  """h [B, T, d] -> logits [B, T, V]: one Linear(d -> V)."""

  vocab_size: int

  @nn.compact
  def __call__(self, h: jax.Array, train: bool = False) -> jax.Array:
    init = _torch_uniform(h.shape[-1])
    return nn.Dense(self.vocab_size, kernel_init=init, bias_init=init)(h)


def _model(variant: str, vocab_size: int, hidden: int, dropout: float) -> nn.Module:
  if variant == "gru":
    return GRUInverter(vocab_size, hidden, dropout)
  return LinearInverter(vocab_size)


def _optimizer(lr: float, weight_decay: float) -> optax.GradientTransformation:
  # torch.optim.Adam(weight_decay=wd) adds wd * p to the gradient before the moments.
  return optax.chain(optax.add_decayed_weights(weight_decay), optax.adam(lr))


@functools.partial(jax.jit, static_argnames=("variant", "vocab_size", "hidden", "lr",
                                             "weight_decay", "dim"))
def _init(key, *, variant, vocab_size, hidden, lr, weight_decay, dim):
  # The parameters' shapes do not depend on T: initialise on one position.
  model = _model(variant, vocab_size, hidden, 0.0)
  params = model.init(key, jnp.zeros((1, 1, dim), jnp.float32))["params"]
  return params, _optimizer(lr, weight_decay).init(params)


@functools.partial(jax.jit, static_argnames=("variant", "vocab_size", "hidden", "dropout", "lr",
                                             "weight_decay"))
def _train_step(params, opt_state, h, tokens, weight, key, step, *, variant, vocab_size, hidden,
                dropout, lr, weight_decay):
  """One Adam step on a batch: h [b, T, d], tokens [b, T], weight [b] (0 = padding)."""
  model = _model(variant, vocab_size, hidden, dropout)

  def loss_fn(p):
    logits = model.apply({"params": p}, h, train=True,
                         rngs={"dropout": jax.random.fold_in(key, step)})
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens)
    return jnp.sum(ce * weight[:, None]) / (jnp.sum(weight) * tokens.shape[1])

  loss, grads = jax.value_and_grad(loss_fn)(params)
  updates, opt_state = _optimizer(lr, weight_decay).update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


@functools.partial(jax.jit, static_argnames=("variant", "vocab_size", "hidden"))
def _logits(params, h, *, variant, vocab_size, hidden):
  """Inference logits [b, T, V] of h [b, T, d] (no dropout)."""
  return _model(variant, vocab_size, hidden, 0.0).apply({"params": params}, h)


@functools.partial(jax.jit, static_argnames=("variant", "vocab_size", "hidden"))
def _tokens(params, h, *, variant, vocab_size, hidden):
  """argmax of the logits: [b, T] int32 (ties to the lower token id)."""
  return jnp.argmax(_logits(params, h, variant=variant, vocab_size=vocab_size, hidden=hidden),
                    axis=-1).astype(jnp.int32)


def forward_flops(variant: str, dim: int, hidden: int, vocab_size: int) -> float:
  """Matmul FLOPs of one position's inference."""
  if variant == "gru":
    return 2.0 * 3 * (dim * hidden + hidden * hidden) + 2.0 * hidden * vocab_size
  return 2.0 * dim * vocab_size


@dataclasses.dataclass(frozen=True)
class Inverter:
  """A trained SIP inverter: the public API other attacks use.

  Attributes:
    settings: the budget it was trained under (Settings).
    params: Flax parameters of the selected epoch.
    vocab_size: V.
    summary: JSON-ready training statistics (losses, held-out accuracy per epoch, the
      selected epoch).
  """

  settings: Settings
  params: dict
  vocab_size: int
  summary: dict

  def _static(self) -> dict:
    return dict(variant=self.settings.variant, vocab_size=self.vocab_size,
                hidden=self.settings.hidden)

  def logits(self, ws: Workspace, h) -> jax.Array:
    """Logits [b, T, V] of one chunk of messages h [b, T, d], metered by `ws.call`.

    For the chain attacks: BiSR(b) starts from softmax(logits / 1.2), BiSR(f) from
    E[argmax logits]. Call it inside a per-chunk function (`ws.map_documents`) so that
    [b, T, V] stays within the memory budget.
    """
    return ws.call(_logits, self.params, jnp.asarray(h, jnp.float32), **self._static())

  def tokens(self, ws: Workspace, h) -> jax.Array:
    """argmax tokens [b, T] int32 of one chunk h [b, T, d] (metered)."""
    return ws.call(_tokens, self.params, jnp.asarray(h, jnp.float32), **self._static())

  def predict(self, ws: Workspace) -> np.ndarray:
    """argmax tokens [B, T] int32 of every captured message, in memory-bounded chunks; a
    public prefix (the BOS, `ws.known_prefix`) in its place."""
    bytes_per_doc = 4.0 * ws.seq_len * (3 * self.vocab_size + 4 * self.settings.hidden)
    tokens = np.array(ws.map_call(_tokens, (ws.activations,), bytes_per_doc,
                                  consts=(self.params,), **self._static()), np.int32)
    tokens[:, :len(ws.known_prefix)] = ws.known_prefix
    return tokens

  def inference_flops(self, num_docs: int, seq_len: int, dim: int) -> float:
    """Analytic FLOPs of `predict` on num_docs documents."""
    s = self.settings
    return num_docs * seq_len * forward_flops(s.variant, dim, s.hidden, self.vocab_size)


def stage_name(variant: str) -> str:
  return f"sip_{variant}"


def inverter(ws: Workspace, budget, key: jax.Array, variant: str = "gru") -> Inverter:
  """The trained SIP inverter of `ws` (shared stage `sip_<variant>`, charged in full).

  Args:
    ws: the workspace (the attacker's client weights and calibration documents).
    budget: a view holding the SIP fields (`FIELDS`): an attack that uses the inverter
      lists them in its budget_fields.
    key: the attack key (the stage derives its own seed from it, see the module doc).
    variant: "gru" or "linear".

  Raises:
    ValueError: the workspace already holds this variant trained under another budget, or
      the hold-out fraction leaves no training document.
  """
  settings = Settings.from_budget(budget, variant)
  name = stage_name(variant)
  stage_key = jax.random.fold_in(key, zlib.crc32(name.encode()) & 0x7FFFFFFF)
  n, t = ws.calibration_tokens.shape
  # The calibration activations are the workspace's own stage, charged beside this one.
  analytic = training_flops(settings, n, t, ws.cfg.n_embd, ws.cfg.vocab_size)
  trained = ws.stage(name, lambda: _train(ws, settings, stage_key), analytic=analytic)
  if trained.settings != settings:
    raise ValueError(f"workspace already holds {name} trained under {trained.settings}, not "
                     f"{settings}; use one SIP budget per workspace")
  return trained


def split_sizes(settings: Settings, num_docs: int) -> tuple[int, int]:
  """(training documents, held-out documents) of `num_docs` calibration documents."""
  held = int(round(settings.holdout * num_docs))
  if num_docs - held < 1:
    raise ValueError(f"sip_holdout={settings.holdout} leaves no training document of "
                     f"{num_docs} calibration documents")
  return num_docs - held, held


def training_flops(settings: Settings, num_docs: int, seq_len: int, dim: int,
                   vocab_size: int) -> float:
  """Analytic FLOPs of training: per trained token (padded batches included) the forward
  and the backward (weight gradients, plus the hidden state's for the GRU: 3x the forward;
  the linear variant's input needs no gradient: 2x), plus one forward over the hold-out
  split per epoch."""
  train, held = split_sizes(settings, num_docs)
  batches = -(-train // settings.batch)
  per_token = forward_flops(settings.variant, dim, settings.hidden, vocab_size)
  passes = 3.0 if settings.variant == "gru" else 2.0
  return settings.epochs * seq_len * per_token * (passes * batches * settings.batch + held)


def _train(ws: Workspace, settings: Settings, key: jax.Array) -> Inverter:
  h_all, x_all = ws.calibration_activations(), ws.calibration_tokens
  n, seq_len, dim = h_all.shape
  n_train, n_held = split_sizes(settings, n)
  init_key, dropout_key = jax.random.split(key)
  # Stream 0 splits off the hold-out documents, stream e + 1 orders epoch e's batches.
  split = optimise.host_rng(key, 0).permutation(n)
  train_idx, held_idx = np.sort(split[:n_train]), np.sort(split[n_train:])
  static = dict(variant=settings.variant, vocab_size=ws.cfg.vocab_size, hidden=settings.hidden)
  opt = dict(lr=settings.lr, weight_decay=settings.weight_decay)
  params, opt_state = ws.call(_init, init_key, dim=dim, **static, **opt)
  best = (params, -1.0, 0)
  losses, held_accuracy, step = [], [], 0
  for epoch in range(settings.epochs):
    order = train_idx[optimise.host_rng(key, epoch + 1).permutation(n_train)]
    epoch_losses = []
    for start in range(0, n_train, settings.batch):
      docs = order[start:start + settings.batch]
      weight = np.zeros(settings.batch, np.float32)
      weight[:len(docs)] = 1.0
      docs = np.concatenate([docs, np.repeat(docs[-1:], settings.batch - len(docs))])
      params, opt_state, loss = ws.call(
          _train_step, params, opt_state, jnp.asarray(h_all[docs]), jnp.asarray(x_all[docs]),
          jnp.asarray(weight), dropout_key, jnp.int32(step), dropout=settings.dropout,
          **static, **opt)
      epoch_losses.append(float(loss))
      step += 1
    if not np.all(np.isfinite(epoch_losses)):
      raise FloatingPointError(f"sip_{settings.variant}: training loss became non-finite in "
                               f"epoch {epoch}")
    losses.append(float(np.mean(epoch_losses)))
    if n_held:
      predicted = np.asarray(ws.call(_tokens, params, jnp.asarray(h_all[held_idx]), **static))
      accuracy = float(np.mean(predicted == x_all[held_idx]))
      held_accuracy.append(accuracy)
      if accuracy > best[1]:
        best = (params, accuracy, epoch + 1)
  if not n_held or not settings.epochs:
    best = (params, float("nan"), settings.epochs)
  summary = {"train_loss_per_epoch": losses, "heldout_accuracy_per_epoch": held_accuracy,
             "selected_epoch": best[2], "train_documents": n_train, "heldout_documents": n_held,
             "steps": step}
  return Inverter(settings, best[0], ws.cfg.vocab_size, summary)


@dataclasses.dataclass(frozen=True)
class SipAttack:
  """Argmax of the trained inverter on every captured message."""

  spec: registry.AttackSpec
  variant: str

  def __call__(self, ws: Workspace, budget, key: jax.Array) -> registry.AttackResult:
    inv = inverter(ws, budget, key, self.variant)
    predictions = inv.predict(ws)
    analytic = inv.inference_flops(ws.num_docs, ws.seq_len, ws.cfg.n_embd)
    return registry.AttackResult(predictions, analytic, {"variant": self.variant, **inv.summary})


_THREAT = ("passive server reading h only; trains an inverter on its own calibration "
           "documents passed through its copy of the client (pre-trained weights under "
           "'trained' knowledge)")
_CHECKS = (
    ("synthetic", "tests/test_attacks_forward.py::test_sip_trains_and_beats_the_baseline",
     "training loss falls and token recovery beats the calibration frequency baseline on a "
     "random tiny GPT-2"),)

for _variant, _name, _what in (("gru", "sip", "GRU(256) inverter"),
                               ("linear", "sip_linear", "linear inverter")):
  registry.register(SipAttack(
      registry.AttackSpec(
          _name, "learned_inversion", ("activations",), budget_fields=FIELDS,
          description=f"SIP: {_what} trained on calibration (h, x) pairs, argmax per position",
          reference="Chen et al. CCS'24 (BiSR) SIP; SplitLLM sfl/model/attacker/sip",
          threat_model=_THREAT,
          capabilities=("chunking invariance", "seeded training", "held-out epoch selection"),
          checks=_CHECKS),
      _variant))


# Analytic FLOPs (lla.attacks.flops): the shared training stage (on the calibration
# activations, charged beside it) and the inference on every captured message.


def stage_flops(s: flops.Shape, budget: dict, variant: str = "gru") -> float:
  """The `sip_<variant>` stage with the calibration activations it reads."""
  settings = Settings.from_budget(types.SimpleNamespace(**budget), variant)
  return (training_flops(settings, s.n_calibration, s.seq_len, s.cfg.n_embd, s.cfg.vocab_size)
          + flops.calibration_activations(s))


def inference_flops(s: flops.Shape, budget: dict, variant: str = "gru") -> float:
  settings = Settings.from_budget(types.SimpleNamespace(**budget), variant)
  return s.num_docs * s.seq_len * forward_flops(variant, s.cfg.n_embd, settings.hidden,
                                                s.cfg.vocab_size)


for _variant, _name in (("gru", "sip"), ("linear", "sip_linear")):
  flops.declare_flops(_name, lambda s, budget, v=_variant: (stage_flops(s, budget, v)
                                                            + inference_flops(s, budget, v)))
