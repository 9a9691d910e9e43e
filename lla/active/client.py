"""The client of split fine-tuning: its layers, its optimiser and its trusted loss oracle.

The client holds the text and the first k blocks (GPT-2's wte, wpe, h_0..h_{k-1}, or a RoPE
family's embed_tokens, layers_0..layers_{k-1}; knowledge `trained`: all of them train). Per step it sends h = client(x) and applies whatever
gradient g the server returns: grads = VJP of its layers at g, then its own optimiser
(per-party global-norm clipping and AdamW, the fine-tune settings of configs/finetune.py).

Where the loss needs labels (the next tokens) the server calls the `LossOracle`, a
client-side callable that holds the targets privately: the server gets the loss value and
its gradient, never the tokens (lla's convention, notes/active-server.md 4.2). SplitGuard's
fake batches are the same oracle with shifted targets.

Shapes: tokens [B, T] int32, h / g [B, T, d], logits [B, T, V].
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import ml_collections
import optax

from lla.active.parts import client_params
from lla.active.protocol import Backward, Forward
from lla.model import split
from lla.train import loop


@jax.tree_util.register_pytree_node_class
class LossOracle:
  """The client's loss as a callable: logits [B, T, V] -> the mean next-token CE.

  The targets stay private to the client (no public attribute; the server only calls it).
  It is a pytree so that it can enter the jitted step as an argument.
  """

  __slots__ = ("_labels",)

  def __init__(self, labels: jax.Array):
    self._labels = labels

  def __call__(self, logits: jax.Array) -> jax.Array:
    return split.next_token_loss(logits, self._labels)

  def tree_flatten(self):
    return (self._labels,), None

  @classmethod
  def tree_unflatten(cls, aux, children):
    del aux
    return cls(*children)


def oracle_for(tokens: jax.Array, shift: jax.Array, vocab_size: int) -> LossOracle:
  """The oracle of a batch: targets `tokens`, or SplitGuard's fake targets
  (tokens + shift) mod V when shift != 0 (every target wrong for 1 <= shift < V)."""
  return LossOracle(jnp.where(shift > 0, (tokens + shift) % vocab_size, tokens))


@dataclasses.dataclass(frozen=True)
class ClientSpec:
  """Static description of the client (hashable: a jit static argument).

  Attributes:
    cfg, cut: the model and k.
    optimizer_json: the optimiser ConfigDict of configs/finetune.py as sorted JSON.
    total_steps: length of the learning-rate schedule (the client's own plan).
  """

  cfg: split.ModelConfig
  cut: int
  optimizer_json: str
  total_steps: int

  @classmethod
  def make(cls, cfg: split.ModelConfig, cut: int, optimizer: ml_collections.ConfigDict,
           total_steps: int) -> "ClientSpec":
    return cls(cfg, int(cut), optimizer.to_json(sort_keys=True), int(total_steps))

  def optimizer(self) -> optax.GradientTransformation:
    config = ml_collections.ConfigDict(json.loads(self.optimizer_json))
    return loop.make_optimizer(config, self.total_steps)


def init(spec: ClientSpec, params: dict) -> dict:
  """Client state: its layers (from a full GPT-2 `params`) and optimiser state."""
  own = client_params(params, spec.cut)
  return {"params": own, "opt": spec.optimizer().init(own)}


def forward(spec: ClientSpec, state: dict, tokens: jax.Array, step: jax.Array,
            run_id: jax.Array):
  """(Forward message, the VJP of its layers, kept client-side)."""
  h, vjp = jax.vjp(lambda p: split.client(p, spec.cfg, tokens, spec.cut), state["params"])
  return Forward(h=h, step=step, run_id=run_id), vjp


def apply(spec: ClientSpec, state: dict, vjp, message: Backward, skip: jax.Array):
  """Applies the returned gradient; `skip` (a fake batch) keeps the state unchanged.

  Returns:
    (new state, grads of its layers before clipping: SplitGuard reads the first block's).
  """
  (grads,) = vjp(message.g)
  updates, opt = spec.optimizer().update(grads, state["opt"], state["params"])
  params = optax.apply_updates(state["params"], updates)
  new = {"params": params, "opt": opt}
  keep = lambda n, o: jnp.where(skip, o, n)
  return jax.tree.map(keep, new, state), grads


def probe_vector(grads: dict) -> jax.Array:
  """SplitGuard's observed vector: the gradient of the first block's query, key and value
  kernels, flattened (the official code reads the client's first parameter tensor): GPT-2's
  fused `h_0/attn/c_attn/kernel` (d x 3d); a RoPE family's q_proj, k_proj and v_proj
  kernels of `layers_0` (d x (H + 2 H_kv) D), concatenated in that order."""
  if "h_0" in grads:
    return grads["h_0"]["attn"]["c_attn"]["kernel"].reshape(-1)
  attention = grads["layers_0"]["self_attn"]
  return jnp.concatenate([attention[f"{p}_proj"]["kernel"].reshape(-1) for p in "qkv"])


def reference_gradient(ref_tail: dict, cfg: split.ModelConfig, h: jax.Array, labels: jax.Array,
                       k: int) -> jax.Array:
  """dL/dh [B, T, d] of an honest server whose tail is `ref_tail` (the client's copy of the
  public pre-trained one): the reference-cosine detector's yardstick."""
  loss = lambda h_: split.next_token_loss(split.server_logits(ref_tail, cfg, h_, k), labels)
  return jax.grad(loss)(h)


def heldout_ce(own: dict, ref_tail: dict, cfg: split.ModelConfig, tokens: jax.Array,
               k: int) -> jax.Array:
  """The client's trusted task-loss evaluator: mean next-token CE of its current layers
  followed by the public pre-trained tail, on its held-out documents [N, T]."""
  h = split.client(own, cfg, tokens, k)
  return split.next_token_loss(split.server_logits(ref_tail, cfg, h, k), tokens)
