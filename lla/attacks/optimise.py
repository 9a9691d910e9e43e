"""Optimisation attacks' shared machinery: the embedding-input client and a metered loop.

Forward-matching attacks (BiSR(f), EIA) optimise a per-document variable so that the
attacker's client reproduces the observed message. They share:

* `embedded_client`: blocks start..stop-1 of the attacker's GPT-2 applied to input
  embeddings `e [B, T, d]` (HF's `inputs_embeds`: the learned positions are added here),
  differentiable in `e`.
* `losses_and_grad`: per-document losses and gradients from one VJP.
* `with_known_prefix`: the public first tokens (a BOS, E.C.known_prefix) held at their
  own embeddings, so that the client sees the true prefix and no step moves it.
* `host_rng`: seeded numpy generators for host-side choices (the order of training
  batches).
* `drive`: the optimisation loop, run from Python with one call of a compiled one-step
  executable per step, so that XLA's cost analysis of that executable times the steps
  run is what executed (XLA counts a loop body once; a compiled block of K unrolled
  steps was measured to cost not exactly K single steps and, on CPU, to run slower and
  compile ten times longer, so there is none). Each step returns the per-document losses;
  a non-finite loss raises `FloatingPointError` naming the attack, the step and the
  document, which replay records as a crashed (unmeasured) attack.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from lla.model import split
from lla.model.decoder import DecoderConfig
from lla.model.gpt2 import GPT2Config


def embedded_client(params, cfg: GPT2Config, e: jax.Array, start: int, stop: int) -> jax.Array:
  """Blocks start..stop-1 on input embeddings: e [B, T, d] -> [B, T, d] float32.

  With start = 0 this is the client of lla.model.split.client with `wte[x]` replaced by
  `e`: `blocks[0..stop-1](e + wpe[0..T-1])`.
  """
  model = split.module(cfg)
  if isinstance(cfg, DecoderConfig):  # RoPE families: positions enter inside attention
    x = e * jnp.float32(cfg.embed_scale) if cfg.embed_scale != 1.0 else e
  else:
    x = e + params["wpe"]["embedding"][:e.shape[-2]]
  return model.apply({"params": params}, x, start, stop, method="blocks").astype(jnp.float32)


def with_known_prefix(params, e: jax.Array, prefix: tuple[int, ...]) -> jax.Array:
  """e [B, T, d] with rows 0..P-1 replaced by the input embeddings of the public prefix
  (P = len(prefix), the model's BOS): the client sees the true prefix, whose keys and
  values every later position attends to, and no gradient reaches those rows."""
  if not prefix:
    return e
  rows = split.wte(params)[jnp.asarray(prefix, jnp.int32)]
  return e.at[:, :len(prefix)].set(jnp.broadcast_to(rows, (e.shape[0],) + rows.shape))


def pin_known_prefix(tokens: jax.Array, prefix: tuple[int, ...]) -> jax.Array:
  """tokens [B, T] with positions 0..P-1 set to the public prefix."""
  if not prefix:
    return tokens
  return tokens.at[:, :len(prefix)].set(jnp.asarray(prefix, tokens.dtype))


def losses_and_grad(losses_fn: Callable, x: jax.Array):
  """(losses [b], gradient of each document's loss w.r.t. its own slice of x [b, ...]).

  One VJP of the summed loss: documents are independent, so the gradient of the sum
  with respect to document i's variables is the gradient of document i's loss.
  """
  losses, vjp = jax.vjp(losses_fn, x)
  (grad,) = vjp(jnp.ones_like(losses))
  return losses, grad


def host_rng(key: jax.Array, stream: int) -> np.random.Generator:
  """A numpy generator for host-side choices (document orders), seeded by key and stream."""
  return np.random.default_rng([*np.asarray(jax.random.key_data(key)).tolist(), stream])


def check_finite(losses: np.ndarray, attack: str, first_step: int, doc_index) -> None:
  """Raises FloatingPointError at the first non-finite entry of losses [n, b]."""
  bad = ~np.isfinite(losses)
  if bad.any():
    step, doc = np.argwhere(bad)[0]
    raise FloatingPointError(
        f"{attack}: loss became {losses[step, doc]} at step {first_step + int(step)} of "
        f"document {int(np.asarray(doc_index)[doc])}")


# Steps between two host-side checks of the losses: the device runs ahead meanwhile.
CHECK_EVERY = 50


def drive(call: Callable, step_fn, carry, *, steps: int, attack: str, doc_index,
          consts: tuple = (), **static):
  """Runs `steps` optimisation steps of every document in one chunk.

  Args:
    call: `Workspace.call` (meters each step).
    step_fn: a module-level jax.jit function
      `step_fn(*consts, carry, **static) -> (carry, losses [b])`: one step of every
      document of the chunk.
    carry: the optimisation state (variables and optimiser state, batched over the b
      documents of the chunk).
    steps: number of steps.
    attack: name used in a FloatingPointError.
    doc_index: [b] capture indices of the chunk's documents (for the error message).

  Returns:
    (carry after `steps` steps, losses [steps, b] float32 as numpy; row s is the loss
    before step s's update).

  Raises:
    FloatingPointError: a loss became NaN or infinite (checked every CHECK_EVERY steps
      and at the end; the message names the first such step and document).
  """
  checked, pending = [], []
  for step in range(steps):
    carry, loss = call(step_fn, *consts, carry, **static)
    pending.append(loss)
    if len(pending) == CHECK_EVERY or step == steps - 1:
      block = np.asarray(jnp.stack(pending), np.float32)
      check_finite(block, attack, step + 1 - len(pending), doc_index)
      checked.append(block)
      pending = []
  losses = np.concatenate(checked) if checked else np.zeros((0, len(doc_index)), np.float32)
  return carry, losses


def loss_summary(losses: np.ndarray, final: np.ndarray, points: int = 8) -> dict:
  """JSON-ready summary of per-document losses [B, steps] and final losses [B].

  `curve` gives the mean loss over documents at `points` log-spaced steps (first and last
  included); `final` is the loss at the variables the attack decoded.
  """
  steps = losses.shape[1]
  marks = sorted({int(round(s)) for s in np.geomspace(1, max(steps, 1), points)} - {0})
  mean = losses.mean(axis=0) if steps else np.zeros(0)
  return {
      "steps_run": int(steps),
      "loss_first": float(mean[0]) if steps else None,
      "loss_last": float(mean[-1]) if steps else None,
      "loss_final": float(np.mean(final)),
      "loss_curve": {str(s - 1): float(mean[s - 1]) for s in marks if steps},
      "loss_final_per_document": [float(x) for x in final],
  }
