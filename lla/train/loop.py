"""One AdamW training loop for GPT-2 language modelling, shared by pre-training and fine-tuning.

Optimiser: global-norm clipping -> AdamW, learning rate = linear warm-up then cosine (or linear)
decay; weight decay only on Dense kernels (LayerNorm scales, biases and the wte/wpe embeddings are
left alone, as in GPT-2/nanoGPT). An optional boolean `trainable` pytree freezes parameters:
frozen leaves get no optimiser state, do not count in the clipping norm, and are carried through
the step unchanged (bit for bit, even a -0.0).

Everything is deterministic given the seed: the batch order comes from
`np.random.default_rng(seed)`, and the step itself is a pure jitted function of
(params, opt_state, tokens).

Shapes: tokens are int32 [N, T] windows; a batch is [B, T].
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from tqdm import auto as tqdm

from lla.model import split
from lla.model.gpt2 import GPT2Config

# Labels of `optax.multi_transform`: trained, frozen, and a defense's own trained weights.
_TRAIN, _FREEZE, _OWN = "train", "freeze", "own"


def _path_names(path) -> tuple[str, ...]:
  return tuple(getattr(p, "key", str(p)) for p in path)


def decay_mask(params) -> dict:
  """True on the leaves that get weight decay: Dense kernels only."""
  return jax.tree_util.tree_map_with_path(lambda path, _: _path_names(path)[-1] == "kernel", params)


def trainable_mask(params, k: int, train_client_layers: bool) -> dict:
  """Boolean pytree: which parameters fine-tuning may change.

  With `train_client_layers=False` (knowledge `public`) the client layers
  (`split.client_layer_names`: GPT-2's wte, wpe and h_0..h_{k-1}) are frozen, so the
  client's computation and hence the forward message is that of the base model. A tied
  output head is the input table, so it is frozen too: only the server's blocks and final
  norm train (and an untied `lm_head`).
  """
  frozen = () if train_client_layers else split.client_layer_names(params, k)
  return jax.tree_util.tree_map_with_path(lambda path, _: _path_names(path)[0] not in frozen, params)


def lr_schedule(config: ml_collections.ConfigDict, total_steps: int) -> optax.Schedule:
  """Warm-up from 0 to `config.lr` over `warmup_steps`, then cosine or linear decay.

  The decay ends at `lr * end_lr_fraction` at `total_steps`.
  """
  warmup = min(config.warmup_steps, total_steps)
  end = config.lr * config.end_lr_fraction
  decay_steps = max(total_steps - warmup, 1)
  if config.decay == "cosine":
    decay = optax.cosine_decay_schedule(config.lr, decay_steps, alpha=config.end_lr_fraction)
  elif config.decay == "linear":
    decay = optax.linear_schedule(config.lr, end, decay_steps)
  else:
    raise ValueError(f"decay must be 'cosine' or 'linear', got {config.decay!r}")
  return optax.join_schedules([optax.linear_schedule(0.0, config.lr, warmup), decay], [warmup])


def _clipped_adamw(config: ml_collections.ConfigDict,
                   total_steps: int) -> optax.GradientTransformation:
  return optax.chain(
      optax.clip_by_global_norm(config.clip_norm),
      optax.adamw(lr_schedule(config, total_steps), b1=config.b1, b2=config.b2, eps=config.eps,
                  weight_decay=config.weight_decay, mask=decay_mask),
  )


def make_optimizer(config: ml_collections.ConfigDict, total_steps: int,
                   trainable=None, own_weights: tuple[str, float] | None = None
                   ) -> optax.GradientTransformation:
  """Clip -> AdamW with `lr_schedule`; frozen leaves (trainable False) map to set_to_zero.

  Args:
    config: optimiser fields (lr, warmup_steps, decay, end_lr_fraction, b1, b2, eps,
      weight_decay, clip_norm); see configs/pretrain.py.
    total_steps: length of the schedule.
    trainable: optional bool pytree like params; None trains everything.
    own_weights: (top-level params key, peak learning rate) of a defense's own trained
      weights (MID's bottleneck), or None (they train with the model). Given, they get an
      AdamW of their own: the same schedule shape and fields at that peak rate, clipped by
      their own global norm (VFLAIR-LLM steps its MID model with an optimizer and learning
      rate of its own). Needs `trainable`.
  """
  adamw = _clipped_adamw(config, total_steps)
  if trainable is None:
    if own_weights is not None:
      raise ValueError("own_weights needs the trainable mask")
    return adamw
  transforms = {_TRAIN: adamw, _FREEZE: optax.set_to_zero()}
  labels = jax.tree.map(lambda t: _TRAIN if t else _FREEZE, trainable)
  if own_weights is not None:
    key, lr = own_weights
    if key not in labels:
      raise ValueError(f"own_weights: the params have no top-level {key!r}")
    transforms[_OWN] = _clipped_adamw(
        ml_collections.ConfigDict({**config.to_dict(), "lr": float(lr)}), total_steps)
    labels = {**labels, key: jax.tree.map(lambda t: _OWN if t == _TRAIN else t, labels[key])}
  return optax.multi_transform(transforms, labels)


def lm_step_loss(params, cfg: GPT2Config, tokens: jax.Array, step: jax.Array,
                 loss_inputs=None) -> jax.Array:
  """The undefended loss; `step` and `loss_inputs` (for per-step randomness and secrets of
  other losses) are unused."""
  del step, loss_inputs
  return split.lm_loss(params, cfg, tokens)


def make_train_step(cfg: GPT2Config, tx: optax.GradientTransformation,
                    trainable=None, loss_fn: Callable = lm_step_loss) -> Callable:
  """A jitted `(params, opt_state, tokens [B, T], step, loss_inputs) -> (params, opt_state,
  loss)`.

  `loss_fn(params, cfg, tokens, step, loss_inputs)` is the objective (a defense in the loop
  draws its step's randomness from `step` and its secret from the traced `loss_inputs`, so
  one compiled step serves every secret). Frozen leaves are returned as the input arrays themselves
  rather than `p + 0`, which would turn -0.0 into +0.0.
  """
  keep = None if trainable is None else jax.tree.leaves(trainable)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, tokens, step_index, loss_inputs):
    loss, grads = jax.value_and_grad(loss_fn)(params, cfg, tokens, step_index, loss_inputs)
    updates, opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    if keep is not None:
      leaves = [n if t else o for n, o, t in
                zip(jax.tree.leaves(new_params), jax.tree.leaves(params), keep)]
      new_params = jax.tree.unflatten(jax.tree.structure(params), leaves)
    return new_params, opt_state, loss

  return step


@functools.lru_cache(maxsize=8)
def _cached_optimizer_and_step(cfg: GPT2Config, optimizer_json: str, num_steps: int,
                               treedef, trainable_leaves: tuple[bool, ...] | None,
                               loss_fn: Callable, own_weights: tuple[str, float] | None):
  """One compilation per (model, optimiser, schedule, mask, loss): seeds of a fine-tune
  share it."""
  optimizer = ml_collections.ConfigDict(json.loads(optimizer_json))
  trainable = None if trainable_leaves is None else jax.tree.unflatten(treedef, trainable_leaves)
  tx = make_optimizer(optimizer, num_steps, trainable, own_weights)
  return tx, make_train_step(cfg, tx, trainable, loss_fn)


def batches(tokens: np.ndarray, batch_size: int, seed: int) -> Iterator[np.ndarray]:
  """Endless seeded batches [B, T]: each epoch is a fresh permutation; a short tail is dropped.

  With fewer rows than `batch_size` every batch is the whole (shuffled) set.
  """
  rng = np.random.default_rng(seed)
  n = tokens.shape[0]
  size = min(batch_size, n)
  while True:
    order = rng.permutation(n)
    for start in range(0, n - size + 1, size):
      yield tokens[order[start:start + size]]


@dataclasses.dataclass
class TrainResult:
  """params after training and the logged history (step, mean loss since last log, lr)."""

  params: dict
  history: list[dict]


def train(params, cfg: GPT2Config, tokens: np.ndarray, *, optimizer: ml_collections.ConfigDict,
          num_steps: int, batch_size: int, seed: int, trainable=None, log_every: int = 50,
          progress: bool = True, desc: str = "train",
          loss_fn: Callable = lm_step_loss, loss_inputs=None,
          own_weights: tuple[str, float] | None = None) -> TrainResult:
  """Trains `params` for `num_steps` AdamW steps on seeded batches of `tokens`.

  Args:
    params: initial parameters (not modified; the step donates copies).
    cfg: model config.
    tokens: int32 [N, T] training windows.
    optimizer: see `make_optimizer`.
    num_steps: optimiser steps (also the schedule length).
    batch_size: B.
    seed: batch-order seed.
    trainable: optional bool pytree (see `trainable_mask`).
    log_every: steps between logged mean losses (the last step is always logged).
    progress: show a tqdm bar.
    desc: label of the bar and log lines.
    loss_fn: `(params, cfg, tokens, step, loss_inputs) -> scalar`; hashable (a module-level
      function or a dataclass), since compiled steps are cached per loss.
    loss_inputs: a pytree of arrays the loss reads as traced data (a defense's secret
      keys), or None.
    own_weights: see `make_optimizer`.
  """
  treedef = jax.tree.structure(params)
  tx, step_fn = _cached_optimizer_and_step(
      cfg, optimizer.to_json(sort_keys=True), num_steps, treedef,
      None if trainable is None else tuple(bool(t) for t in jax.tree.leaves(trainable)),
      loss_fn, own_weights)
  schedule = lr_schedule(optimizer, num_steps)
  # Donation consumes the step's inputs; copy so that the caller's params survive.
  params = jax.tree.map(jnp.array, params)
  opt_state = tx.init(params)
  history, pending = [], []
  data = batches(np.asarray(tokens, np.int32), batch_size, seed)
  bar = tqdm.trange(num_steps, desc=desc, disable=not progress)
  for i in bar:
    params, opt_state, loss = step_fn(params, opt_state, next(data), np.int32(i), loss_inputs)
    pending.append(loss)
    if (i + 1) % log_every == 0 or i + 1 == num_steps:
      mean = float(np.mean(jax.device_get(pending)))
      pending = []
      record = {"step": i + 1, "loss": mean, "lr": float(schedule(i))}
      history.append(record)
      bar.set_postfix(loss=f"{mean:.4f}")
      logging.info("%s step %d/%d loss %.4f lr %.3g", desc, i + 1, num_steps, mean, record["lr"])
  return TrainResult(params=params, history=history)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _summed_ce(params, cfg: GPT2Config, tokens):
  """Sum of next-token CE over a batch [B, T] (B * (T-1) positions)."""
  return split.lm_loss(params, cfg, tokens) * tokens.shape[0] * (tokens.shape[1] - 1)


def evaluate(params, cfg: GPT2Config, tokens: np.ndarray, batch_size: int = 32) -> dict:
  """Held-out mean next-token CE (nats) and perplexity over all N * (T-1) positions of [N, T].

  Every row is scored exactly once: the last partial batch is run at its own size.
  """
  tokens = np.asarray(tokens, np.int32)
  total = 0.0
  for start in range(0, tokens.shape[0], batch_size):
    total += float(_summed_ce(params, cfg, tokens[start:start + batch_size]))
  n = tokens.shape[0] * (tokens.shape[1] - 1)
  ce = total / n
  return {"ce": ce, "perplexity": math.exp(ce), "n_positions": n}
