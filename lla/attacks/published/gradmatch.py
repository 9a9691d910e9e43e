"""Gradient matching over soft labels in split learning: TAG, BiSR(b) and the BiSR chain.

The server holds h, the returned g and its own downstream part (blocks k.., ln_f, tied
head; the attacker's `ws.params`). The unknown is the client's labels, i.e. its next
tokens. As in SplitLLM's `TAGAttacker` (published-attacks.md sections 3b, 5b) a variable
gt [T, V] per document is optimised with AdamW so that the gradient its labels would
produce matches g:

    loss = beta ||g(Y) - g||^2 + (1 - beta) ||g(Y) - g||_1,   Y = softmax(gt),

and the prediction at position t >= 1 is argmax gt[t] (the label of logits t-1). SplitLLM
initialises gt with a distribution (softmax(randn) for TAG, softmax(SIP logits / 1.2) for
BiSR(b)) and softmaxes it *again* in the loss; that double softmax is kept (it flattens the
initial labels). Position 0 is nobody's label: g carries nothing about it. BiSR(b) keeps
its initialiser's guess there (as published); TAG and LAMP take the position-0 step of the
activation beam search (PROTOCOL section 4): the ridge decoder's C candidates, the one whose
client message is nearest h[0]. The attack reads h anyway and this costs C one-token client
steps per document; the calibration's most common token is the alternative and is far
weaker (main job, k = 6 public, 128 documents: 6% at position 0, ridge's nearest 60%, this
step 80%).

g(Y) comes from `downstream.linearize` (computed once per document; each step is one VJP
and one JVP, no double backward; SplitLLM differentiates twice through PyTorch). The loop
runs from Python over a compiled one-step executable so that XLA's FLOP count is what ran.
Documents are independent (Adam is elementwise and the losses are summed), so each chunk
is vmapped and the result does not depend on chunking. Randomness is per document:
fold_in(key, doc_index). A non-finite loss or gradient raises FloatingPointError naming
the attack, step and document.

Deviation from SplitLLM (documented in the records): g is matched per document, with the
normalisation N = batch_docs * (T - 1) of the capture batch (SplitLLM attacks its whole
training batch at once, which is the same optimisation because the sum separates).

AdamW's epsilon is a budget field (`tag_adam_eps`, SplitLLM's 1e-6 by default). The
loss's gradient in gt is tiny: the labels' softmax over V scales it by ~1/V and g carries
1/N. On the embedded model it is ~5e-9 per coordinate, so eps = 1e-6 dominates Adam's
denominator, every step is lr * grad / eps and the labels barely move in the published
600 steps; with eps far below the gradients (1e-12) Adam is scale-free again.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lla.attacks.published import bisr_f
from lla.attacks import budget as budget_lib
from lla.attacks import downstream
from lla.attacks import flops
from lla.attacks import registry
from lla.attacks.published import sip
from lla.attacks.workspace import Workspace
from lla.model import cost
from lla.model import split

FAMILY = "gradient_matching"

budget_lib.declare("tag_steps", 600, int, low=0, doc="TAG: AdamW steps over the soft labels",
                   source="SplitLLM [CR]TAG.sh gpt2-large (379b1c5)")
budget_lib.declare("tag_lr", 0.09, float, low=0.0, strict_low=True, doc="TAG: AdamW learning rate",
                   source="SplitLLM TAGArguments / [CR]TAG.sh gpt2-large")
budget_lib.declare("tag_beta", 0.85, float, low=0.0, high=1.0,
                   doc="gradient matching (tag, bisr_b, lamp): weight of the squared L2 term, "
                   "1 - beta on the L1 term", source="SplitLLM DLGAttacker._gma_loss")
budget_lib.declare("tag_weight_decay", 0.01, float, low=0.0,
                   doc="gradient matching (tag, bisr_b, lamp): AdamW decoupled weight decay",
                   source="SplitLLM TAGAttacker (AdamW weight_decay=0.01)")
budget_lib.declare("tag_adam_eps", 1e-6, float, low=0.0, strict_low=True,
                   doc="gradient matching (tag, bisr_b, lamp): AdamW epsilon. The loss's "
                   "gradients in gt are tiny (~1e-9 on the embedded model: the labels' softmax "
                   "over V and g's 1/N scale); SplitLLM's 1e-6 then dominates Adam's "
                   "denominator and the steps shrink to lr * grad / eps",
                   source="SplitLLM TAGAttacker (torch AdamW eps=1e-6)")
budget_lib.declare("bisr_b_steps", 32, int, low=0, doc="BiSR(b): AdamW steps from the SIP init",
                   source="SplitLLM [CR]BiSR(b+f).sh gpt2-large (379b1c5)")
budget_lib.declare("bisr_b_lr", 0.09, float, low=0.0, strict_low=True,
                   doc="BiSR(b): AdamW learning rate", source="SplitLLM TAGArguments")
budget_lib.declare("bisr_b_init_temp", 1.2, float, low=0.0, strict_low=True,
                   doc="BiSR(b): temperature of the init softmax(SIP logits / temp)",
                   source="SplitLLM [CR]BiSR(b+f).sh gpt2-large")

# AdamW's betas as in SplitLLM's torch.optim.AdamW(betas=(0.9, 0.999)).
ADAM_B1, ADAM_B2 = 0.9, 0.999


class State(NamedTuple):
  """The optimisation state of a chunk of C documents.

  Attributes:
    gt: [C, T, V] the optimised variable (labels are softmax(gt)).
    opt: AdamW state.
    first_bad: [C] int32 the first step whose loss or gradient was not finite, or -1.
  """

  gt: jax.Array
  opt: optax.OptState
  first_bad: jax.Array


def _adamw(lr, weight_decay, eps) -> optax.GradientTransformation:
  return optax.adamw(lr, b1=ADAM_B1, b2=ADAM_B2, eps=eps, weight_decay=weight_decay)


def matching_loss(wte, lin: downstream.Linearized, norm, target, gt, beta) -> jax.Array:
  """[C] beta ||g(Y) - g||^2 + (1 - beta) ||g(Y) - g||_1 per document, Y = softmax(gt)."""
  labels = jax.nn.softmax(gt, axis=-1)
  predicted = downstream.gradient(lin, jnp.einsum("ctv,vd->ctd", labels, wte), norm)
  diff = predicted - target
  return beta * jnp.sum(diff**2, axis=(1, 2)) + (1.0 - beta) * jnp.sum(jnp.abs(diff), axis=(1, 2))


def start(gt: jax.Array) -> State:
  """The state at step 0 for an initial gt [C, T, V] (inside the init's executable: a
  separate zero-FLOP executable would have no XLA cost analysis)."""
  return State(gt, _adamw(0.0, 0.0, 1.0).init(gt), jnp.full(gt.shape[:1], -1, jnp.int32))


@jax.jit
def step(wte, lin: downstream.Linearized, norm, target, state: State, t, hyper: dict):
  """One AdamW step for every document of the chunk: (new state, [C] loss before it).

  hyper: {"lr", "beta", "weight_decay", "eps"} float32 scalars (traced, so that one
  executable serves every budget).
  """
  def total(gt):
    losses = matching_loss(wte, lin, norm, target, gt, hyper["beta"])
    return losses.sum(), losses

  grads, losses = jax.grad(total, has_aux=True)(state.gt)
  adamw = _adamw(hyper["lr"], hyper["weight_decay"], hyper["eps"])
  updates, opt = adamw.update(grads, state.opt, state.gt)
  bad = ~jnp.isfinite(losses) | ~jnp.all(jnp.isfinite(grads), axis=(1, 2))
  first_bad = jnp.where((state.first_bad < 0) & bad, t, state.first_bad)
  return State(optax.apply_updates(state.gt, updates), opt, first_bad), losses


@jax.jit
def finish(wte, lin: downstream.Linearized, norm, target, state: State, beta):
  """(tokens [C, T] argmax of gt, [C] final matching loss, [C] first bad step)."""
  losses = matching_loss(wte, lin, norm, target, state.gt, beta)
  first_bad = jnp.where((state.first_bad < 0) & ~jnp.isfinite(losses), jnp.iinfo(jnp.int32).max,
                        state.first_bad)
  return jnp.argmax(state.gt, axis=-1).astype(jnp.int32), losses, first_bad


@functools.partial(jax.jit, static_argnames=("seq_len", "vocab_size"))
def random_init(key: jax.Array, doc_index: jax.Array, seq_len: int, vocab_size: int):
  """The state of TAG's init gt = softmax(randn) [C, T, V], drawn per document from
  fold_in(key, doc)."""
  def one(doc):
    noise = jax.random.normal(document_key(key, doc, 0), (seq_len, vocab_size))
    return jax.nn.softmax(noise, axis=-1)
  return start(jax.vmap(one)(doc_index))


def document_key(key: jax.Array, doc, purpose) -> jax.Array:
  """The key of one document for one purpose (0: the init; LAMP: 1 + its phase)."""
  return jax.random.fold_in(jax.random.fold_in(key, doc), purpose)


@jax.jit
def tempered_init(logits: jax.Array, temperature) -> State:
  """The state of BiSR(b)'s init gt = softmax(logits / temperature), logits [C, T, V]."""
  return start(jax.nn.softmax(logits / temperature, axis=-1))


@dataclasses.dataclass
class Chunk:
  """One chunk of (padded) documents as the optimisation sees it.

  Attributes:
    lin: the downstream part linearised at the chunk's h.
    target: [C, T, d] observed g.
    norm: [C] float32 N = batch_docs * (T - 1) of each document's capture batch.
    doc_index: [C] int32 capture indices (per-document randomness, error messages).
    position0: [C] int32 the position-0 prediction, or None to keep argmax gt[:, 0].
  """

  lin: downstream.Linearized
  target: jax.Array
  norm: jax.Array
  doc_index: np.ndarray
  position0: np.ndarray | None


# (workspace, chunk, h [C, T, d]) -> the State at step 0 (gt [C, T, V]).
InitFn = Callable[[Workspace, Chunk, jax.Array], State]
# (workspace, chunk, state, step just taken) -> state: a discrete move after a step (LAMP).
HookFn = Callable[[Workspace, Chunk, State, int], State]


@dataclasses.dataclass(frozen=True)
class Hyper:
  """The loop's settings: steps, AdamW (lr, weight decay, eps) and the loss's beta."""

  steps: int
  lr: float
  beta: float
  weight_decay: float
  eps: float

  @classmethod
  def of(cls, budget, steps: str, lr: str) -> "Hyper":
    """The loop's settings from a budget view: its own steps and lr fields, and the
    matching loss and AdamW fields the three attacks share."""
    return cls(int(budget[steps]), float(budget[lr]), float(budget.tag_beta),
               float(budget.tag_weight_decay), float(budget.tag_adam_eps))

  def arrays(self) -> dict:
    return {"lr": jnp.float32(self.lr), "beta": jnp.float32(self.beta),
            "weight_decay": jnp.float32(self.weight_decay), "eps": jnp.float32(self.eps)}


def norms(ws: Workspace) -> np.ndarray:
  """[B] float32 N of each document: the server's loss averages its capture batch."""
  return (np.asarray(ws.batch_docs, np.float32) * (ws.seq_len - 1)).astype(np.float32)


def state_bytes_per_doc(ws: Workspace) -> float:
  """Working set of one document in a step: gt, Adam moments, their successors, the
  gradient and softmax temporaries ([T, V] each), plus the body's residuals."""
  cfg, t = ws.cfg, ws.seq_len
  residuals = (cfg.n_layer - ws.cut) * t * (16 * cfg.n_embd + 2 * cfg.n_head * t)
  return 4.0 * (12 * t * cfg.vocab_size + residuals)


def optimise(ws: Workspace, name: str, hyper: Hyper, init: InitFn, position0: np.ndarray | None,
             hook: HookFn | None = None, bytes_per_doc: float | None = None):
  """Runs the matching loop over every document.

  Returns:
    (tokens [B, T] int32, final loss [B] float32, initial loss [B] float32: the loss at the
    init, or the final one when no step ran).

  Raises:
    FloatingPointError: a non-finite loss or gradient, naming the step and document.
  """
  if ws.gradients is None:
    raise ValueError(f"{name} needs the backward messages g; the capture holds none")
  wte, arrays = split.output_table(ws.params), hyper.arrays()  # labels enter via the head
  has_position0 = position0 is not None
  position0 = (np.zeros(ws.num_docs, np.int32) if position0 is None
               else np.asarray(position0, np.int32))

  def per_chunk(h, g, norm, doc_index, pos0):
    lin = ws.call(downstream.linearize, ws.params, h, cfg=ws.cfg, k=ws.cut)
    chunk = Chunk(lin, g, norm, np.asarray(doc_index), np.asarray(pos0) if has_position0 else None)
    state, initial = init(ws, chunk, h), None
    for t in range(hyper.steps):
      state, losses = ws.call(step, wte, lin, norm, g, state, jnp.int32(t), arrays)
      initial = losses if initial is None else initial
      if hook is not None:
        state = hook(ws, chunk, state, t)
    tokens, losses, first_bad = ws.call(finish, wte, lin, norm, g, state, arrays["beta"])
    first_bad = np.asarray(first_bad)
    if (first_bad >= 0).any():
      row = int(np.flatnonzero(first_bad >= 0)[0])
      when = ("after the last step" if first_bad[row] == np.iinfo(np.int32).max
              else f"at step {int(first_bad[row])}")
      raise FloatingPointError(f"{name}: non-finite gradient-matching loss or gradient {when} "
                               f"of document {int(chunk.doc_index[row])}")
    tokens = np.array(tokens)
    if chunk.position0 is not None:
      tokens[:, 0] = chunk.position0
    return tokens, np.asarray(losses), np.asarray(losses if initial is None else initial)

  tokens, losses, initial = ws.map_documents(
      per_chunk, (ws.activations, ws.gradients, norms(ws), ws.doc_index, position0),
      bytes_per_doc or state_bytes_per_doc(ws))
  return tokens.astype(np.int32), losses.astype(np.float32), initial.astype(np.float32)


def step_flops(ws: Workspace) -> float:
  """Analytic FLOPs of one step of one document: a JVP and a VJP through the body, the
  labels through the head and back (4TVd), softmax and AdamW (~30 TV)."""
  t, v, d = ws.seq_len, ws.cfg.vocab_size, ws.cfg.n_embd
  return 2.0 * downstream.body_flops(ws.cfg, ws.cut, t) + 4.0 * t * v * d + 30.0 * t * v


def loop_flops(ws: Workspace, steps: int) -> float:
  """Analytic FLOPs of `optimise` without hooks: linearise, the steps, and the final
  evaluation (one VJP, the labels through the head, softmax)."""
  t, v, d = ws.seq_len, ws.cfg.vocab_size, ws.cfg.n_embd
  final = downstream.body_flops(ws.cfg, ws.cut, t) + 2.0 * t * v * d + 10.0 * t * v
  per_doc = downstream.linearize_flops(ws.cfg, ws.cut, t) + steps * step_flops(ws) + final
  return ws.num_docs * per_doc


def activation_position0(ws: Workspace, num_candidates: int) -> np.ndarray:
  """[B] int32 position 0 by the activation beam search's first step: of the ridge
  decoder's `num_candidates` nearest tokens (stage `activation_candidates`), the one whose
  client message is nearest h[0]. After a public BOS (`ws.known_prefix`), the BOS."""
  if ws.known_prefix:
    return np.full(ws.num_docs, ws.known_prefix[0], np.int32)
  candidates = ws.activation_ranked(num_candidates)[:, 0].astype(np.int32)
  first = np.ascontiguousarray(ws.activations[:, 0])
  bytes_per_doc = 4.0 * num_candidates * ws.cfg.n_embd * 8
  tokens = ws.map_call(nearest_first_message, (first, candidates), bytes_per_doc,
                       consts=(ws.params,), cfg=ws.cfg, k=ws.cut)
  return tokens.astype(np.int32)


@functools.partial(jax.jit, static_argnames=("cfg", "k"))
def nearest_first_message(params, h0: jax.Array, candidates: jax.Array, cfg, k: int):
  """h0 [C, d], candidates [C, n] -> [C] int32 the candidate whose one-token client message
  is nearest h0 (ties: the better-ranked candidate, as in the beam search)."""
  docs, num = candidates.shape
  messages = split.client(params, cfg, candidates.reshape(-1, 1), k).reshape(docs, num, -1)
  distance = jnp.sum((messages - h0[:, None]) ** 2, axis=-1)
  return jnp.take_along_axis(candidates, jnp.argmin(distance, axis=1)[:, None], 1)[:, 0]


def position0_flops(ws: Workspace, num_candidates: int) -> float:
  """num_candidates one-token client forwards per document: every weight matrix of each
  block, 2 FLOPs an entry (GPT-2 24 d^2; attention over one position is not counted); `ws`
  is a Workspace or a lla.attacks.flops.Shape."""
  return ws.num_docs * num_candidates * ws.cut * 2.0 * cost.block_weights(ws.cfg)


def random_tag_init(key: jax.Array) -> InitFn:
  """TAG's init, softmax(randn) per document."""
  def init(ws: Workspace, chunk: Chunk, h: jax.Array) -> State:
    return ws.call(random_init, key, jnp.asarray(chunk.doc_index), seq_len=ws.seq_len,
                   vocab_size=ws.cfg.vocab_size)
  return init


def summary(losses: np.ndarray, initial: np.ndarray, hyper: Hyper, **extra) -> dict:
  """The record's details common to the matching attacks."""
  return {"steps": hyper.steps, "lr": hyper.lr, "beta": hyper.beta,
          "weight_decay": hyper.weight_decay, "adam_eps": hyper.eps,
          "matching_loss_initial_mean": float(np.mean(initial)),
          "matching_loss_final_mean": float(np.mean(losses)),
          "matching_loss_final": [float(x) for x in losses],
          "labels": "softmax(gt) of an init that is already a distribution (SplitLLM's "
                    "double softmax)",
          "normalisation": "N = batch_docs * (T - 1) per document", **extra}


# --- TAG ------------------------------------------------------------------------------------

SHARED_FIELDS = ("tag_beta", "tag_weight_decay", "tag_adam_eps")
# Position 0: the ridge decoder's `candidates`, checked through the client.
POSITION0_FIELDS = ("candidates", "ridge_alpha")
TAG_FIELDS = ("tag_steps", "tag_lr") + SHARED_FIELDS + POSITION0_FIELDS


@dataclasses.dataclass(frozen=True)
class TagAttack:
  spec: registry.AttackSpec

  def __call__(self, ws: Workspace, budget, key: jax.Array) -> registry.AttackResult:
    hyper = Hyper.of(budget, "tag_steps", "tag_lr")
    position0 = activation_position0(ws, int(budget.candidates))
    tokens, losses, initial = optimise(ws, self.spec.name, hyper, random_tag_init(key), position0)
    details = summary(losses, initial, hyper, init="softmax(randn), per document fold_in(key, doc)",
                      position0=position0_source(ws))
    flops = loop_flops(ws, hyper.steps) + (0.0 if ws.known_prefix else
                                             position0_flops(ws, int(budget.candidates)))
    return registry.AttackResult(tokens, flops, details)


POSITION0 = "the activation beam search's position-0 step over the ridge's candidates"


def position0_source(ws: Workspace) -> str:
  """Where position 0's token came from, for the record."""
  return "the public BOS" if ws.known_prefix else POSITION0
GM_THREAT = ("passive server in training: reads h and g of one step and runs its own "
             "downstream part (blocks k.., ln_f, head; the attacker's weights) to find the soft "
             "labels whose gradient matches g")
GM_CAPABILITIES = ("linearised downstream (no double backward)", "per-document normalisation "
                   "by the capture batch", "chunking invariance", "non-finite loss raises")

registry.register(TagAttack(registry.AttackSpec(
    "tag", FAMILY, ("activations", "gradients"), budget_fields=TAG_FIELDS,
    description="TAG in split learning: soft labels fitted by gradient matching (L2 + L1)",
    reference="Deng et al. 2021 (TAG); SplitLLM TAGAttacker (published-attacks.md 3b, 5b)",
    threat_model=GM_THREAT + "; position 0 from h (ridge candidates checked through its "
    "client)",
    capabilities=GM_CAPABILITIES,
    checks=(("reference_consistency",
             "tests/test_attacks_gradmatch.py::test_linearised_gradient_equals_jax_grad",
             "jax.grad of the soft-label downstream loss; the captured g for one-hot labels"),
            ("synthetic", "tests/test_attacks_gradmatch.py::test_tag_and_bisr_b_recover_labels",
             "a tiny random GPT-2: loss falls, recovery beats the frequency baseline")))))


# --- BiSR(b) and the BiSR chain ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class InitLogits:
  """Where BiSR(b)'s init logits come from.

  Attributes:
    name: what the record calls it.
    logits: h chunk [C, T, d] -> logits [C, T, V] (metered through the workspace).
    flops: analytic FLOPs of `logits` over every document (a stage it trained on is
      charged by the workspace).
  """

  name: str
  logits: Callable[[jax.Array], jax.Array]
  flops: float


# (workspace, budget, key) -> InitLogits.
InitProvider = Callable[[Workspace, object, jax.Array], InitLogits]

BISR_B_FIELDS = ("bisr_b_steps", "bisr_b_lr", "bisr_b_init_temp") + SHARED_FIELDS


def sip_init(ws: Workspace, budget, key: jax.Array) -> InitLogits:
  """SIP's GRU inverter (the shared stage `sip_gru`), as the BiSR scripts use it."""
  inv = sip.inverter(ws, budget, key, "gru")
  return InitLogits("SIP (GRU)", functools.partial(inv.logits, ws),
                    inv.inference_flops(ws.num_docs, ws.seq_len, ws.cfg.n_embd))


def tempered(logits_of_h: Callable[[jax.Array], jax.Array], temperature: float) -> InitFn:
  """The init softmax(logits(h) / temperature) of BiSR(b)."""
  def init(ws: Workspace, chunk: Chunk, h: jax.Array) -> State:
    return ws.call(tempered_init, logits_of_h(h), jnp.float32(temperature))
  return init


def backward_stage(ws: Workspace, budget, key: jax.Array, init_provider: InitProvider,
                   name: str):
  """BiSR(b) on every document: (tokens [B, T] int32, details), the shared stage
  `bisr_b[...]` (named by its settings): `bisr` reuses the tokens that `bisr_b` found on
  the same workspace, and both are charged for them in full.

  Position 0 keeps the init's guess: no gradient reaches it, as published; after a public
  BOS (`ws.known_prefix`) it is the BOS.
  """
  hyper = Hyper.of(budget, "bisr_b_steps", "bisr_b_lr")
  temperature = float(budget.bisr_b_init_temp)
  init = init_provider(ws, budget, key)  # Its own stages (SIP) are charged beside this one.
  analytic = (loop_flops(ws, hyper.steps) + init.flops
              + 5.0 * ws.num_docs * ws.seq_len * ws.cfg.vocab_size)  # the tempered softmax

  def compute():
    position0 = (np.full(ws.num_docs, ws.known_prefix[0], np.int32) if ws.known_prefix
                 else None)
    tokens, losses, initial = optimise(ws, name, hyper, tempered(init.logits, temperature),
                                       position0)
    return tokens, summary(losses, initial, hyper,
                           init=f"softmax({init.name} logits / {temperature:g})",
                           position0=position0_source(ws) if ws.known_prefix else
                           f"argmax of the {init.name} init (no gradient reaches it)")

  settings = (f"steps={hyper.steps},lr={hyper.lr:g},beta={hyper.beta:g},"
              f"wd={hyper.weight_decay:g},eps={hyper.eps:g},temp={temperature:g},"
              f"init={init.name}")
  tokens, details = ws.stage(f"bisr_b[{settings}]", compute, analytic=analytic)
  return tokens.copy(), dict(details)


@dataclasses.dataclass(frozen=True)
class BisrBAttack:
  """BiSR(b): the matching loop from softmax(init logits / temp)."""

  spec: registry.AttackSpec
  init_provider: InitProvider = sip_init

  def __call__(self, ws: Workspace, budget, key: jax.Array) -> registry.AttackResult:
    tokens, details = backward_stage(ws, budget, key, self.init_provider, self.spec.name)
    return registry.AttackResult(tokens, 0.0, details)


@dataclasses.dataclass(frozen=True)
class BisrAttack:
  """BiSR(b+f): SIP, then BiSR(b) on the labels, then BiSR(f) on the input embeddings
  from BiSR(b)'s tokens (SplitLLM's [CR]BiSR(b+f) chain)."""

  spec: registry.AttackSpec
  init_provider: InitProvider = sip_init

  def __call__(self, ws: Workspace, budget, key: jax.Array) -> registry.AttackResult:
    tokens, details_b = backward_stage(ws, budget, key, self.init_provider, self.spec.name)
    predictions, details_f = bisr_f.refine(ws, budget, tokens, self.spec.name)
    flops_f = bisr_f.refine_flops(ws.cfg, ws.cut, ws.num_docs, ws.seq_len,
                                  int(budget.bisr_f_steps))
    details = {"bisr_b": details_b, "bisr_f": details_f,
               "bisr_b_tokens_changed_by_f": float(np.mean(predictions != tokens))}
    return registry.AttackResult(predictions, flops_f, details)


_BISR_REFERENCE = "Chen et al. CCS'24 (BiSR); SplitLLM TAGAttacker, SmashedDataMatchingAttacker"
_SIP_THREAT = "; trains SIP on its calibration documents through its copy of the client"

registry.register(BisrBAttack(registry.AttackSpec(
    "bisr_b", FAMILY, ("activations", "gradients"), budget_fields=sip.FIELDS + BISR_B_FIELDS,
    description="BiSR(b): SIP's logits refined by gradient matching over soft labels",
    reference=_BISR_REFERENCE + " (published-attacks.md 3b)",
    threat_model=GM_THREAT + _SIP_THREAT, capabilities=GM_CAPABILITIES,
    checks=(("synthetic", "tests/test_attacks_gradmatch.py::test_tag_and_bisr_b_recover_labels",
             "a tiny random GPT-2: loss falls, recovery beats its init and the frequency "
             "baseline"),))))

registry.register(BisrAttack(registry.AttackSpec(
    "bisr", FAMILY, ("activations", "gradients"),
    budget_fields=sip.FIELDS + BISR_B_FIELDS + bisr_f.FIELDS,
    description="BiSR(b+f): SIP -> gradient matching over labels -> forward matching of "
    "input embeddings",
    reference=_BISR_REFERENCE + " (published-attacks.md 3b-3c)",
    threat_model=GM_THREAT + _SIP_THREAT + "; then matches h with its client",
    capabilities=GM_CAPABILITIES,
    checks=(("synthetic", "tests/test_attacks_gradmatch.py::test_bisr_chain_runs_b_then_f",
             "the chain's BiSR(f) starts from BiSR(b)'s tokens and keeps or improves them"),))))


# Analytic FLOPs (lla.attacks.flops). TAG: the loop and position 0 from the ridge's
# candidates; BiSR(b): the shared `bisr_b[...]` stage from SIP's logits (SIP's stage beside
# it); BiSR: that stage, then BiSR(f)'s refinement.


def position0_stage_flops(s: flops.Shape, budget: dict) -> float:
  """Position 0 by the activation beam search's first step, with the ranking it reads."""
  return position0_flops(s, int(budget["candidates"])) + flops.activation_ranking(s)


def backward_stage_flops(s: flops.Shape, budget: dict) -> float:
  """The `bisr_b[...]` stage from SIP (GRU) logits, with SIP's stage."""
  return (loop_flops(s, int(budget["bisr_b_steps"])) + sip.inference_flops(s, budget)
          + 5.0 * s.num_docs * s.seq_len * s.cfg.vocab_size + sip.stage_flops(s, budget))


flops.declare_flops("tag", lambda s, budget: (loop_flops(s, int(budget["tag_steps"]))
                                              + position0_stage_flops(s, budget)))
flops.declare_flops("bisr_b", backward_stage_flops)
flops.declare_flops("bisr", lambda s, budget: (
    backward_stage_flops(s, budget)
    + bisr_f.refine_flops(s.cfg, s.cut, s.num_docs, s.seq_len, int(budget["bisr_f_steps"]))))
