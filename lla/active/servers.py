"""Servers of split fine-tuning: what each one returns for the client's forward message.

A server sees a `Forward` (h, step, run id), may call the client's opaque loss oracle on
logits, receives public batches from its own data, and answers with a `Backward`. This
module imports no client code and no data loader (a test enforces it): everything it knows
arrives as arguments.

  HonestServer      fine-tunes its tail (blocks k.., ln_f, head) and returns g = dL/dh.
  FSHAServer        returns FSHA's adversarial gradient alpha dL_f/dh (lla.active.fsha) and
                    never calls the oracle: the published attack.
  MixedFSHAServer   keeps an honest tail and returns
                    g = (1 - beta) g_task + beta (|g_task| / |g_adv|) g_adv, row norms
                    matched per position: one knob between stealth and hijacking speed
                    (the SplitSpy / URVFL idea, notes/active-server.md 4.4).

Each server is a frozen dataclass (a static jit argument) with
  init(...) -> state,
  step(state, forward, oracle, public, key) -> (state', Backward, log)   (one training step),
  respond(state, forward, oracle) -> Backward    (the reply at a frozen state, for captures).

Shapes: h, g [B, T, d]; public [B, T] int32.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import ml_collections
import optax

from lla.active import fsha
from lla.active.protocol import Backward, Forward
from lla.model import split
from lla.train import loop

KINDS = ("honest", "fsha", "mixed")


@dataclasses.dataclass(frozen=True)
class HonestServer:
  """Trains its tail with the task loss and returns the true dL/dh.

  Attributes:
    cfg, cut: the model and k.
    optimizer_json: its optimiser (configs/finetune.py fields, sorted JSON): per-party
      clipping then AdamW, like the client's.
    total_steps: its schedule length.
  """

  cfg: split.ModelConfig
  cut: int
  optimizer_json: str
  total_steps: int

  kind = "honest"

  def optimizer(self) -> optax.GradientTransformation:
    return loop.make_optimizer(ml_collections.ConfigDict(json.loads(self.optimizer_json)),
                               self.total_steps)

  def init(self, tail: dict) -> dict:
    return {"params": tail, "opt": self.optimizer().init(tail)}

  def _loss(self, tail: dict, h: jax.Array, oracle) -> jax.Array:
    return oracle(split.server_logits(tail, self.cfg, h, self.cut))

  def respond(self, state: dict, forward: Forward, oracle) -> Backward:
    return Backward(g=jax.grad(self._loss, argnums=1)(state["params"], forward.h, oracle))

  def step(self, state: dict, forward: Forward, oracle, public, key):
    del public, key
    loss, (g_tail, g_h) = jax.value_and_grad(self._loss, argnums=(0, 1))(
        state["params"], forward.h, oracle)
    updates, opt = self.optimizer().update(g_tail, state["opt"], state["params"])
    state = {"params": optax.apply_updates(state["params"], updates), "opt": opt}
    return state, Backward(g=g_h), {"task_loss": loss}


@dataclasses.dataclass(frozen=True)
class FSHAServer:
  """The Feature-Space Hijacking Attack as published: the task gradient is never computed."""

  spec: fsha.FSHASpec

  kind = "fsha"

  def init(self, pilot: dict, key: jax.Array) -> dict:
    return fsha.init_state(self.spec, pilot, key)

  def respond(self, state: dict, forward: Forward, oracle) -> Backward:
    del oracle
    return Backward(g=fsha.adversarial_gradient(self.spec, state["critic"], state["stats"],
                                                forward.h)[1])

  def step(self, state: dict, forward: Forward, oracle, public, key):
    del oracle
    state, g, log = fsha.hijack_step(self.spec, state, forward.h, public, key)
    return state, Backward(g=g), log


def mix(g_task: jax.Array, g_adv: jax.Array, beta: float) -> jax.Array:
  """(1 - beta) g_task + beta (|g_task| / |g_adv|) g_adv with norms per row [B, T]; a row
  where either gradient is zero gets only the task part (so a zero last row stays zero)."""
  norm = lambda g: jnp.sqrt(jnp.sum(g * g, axis=-1, keepdims=True))
  task_norm, adv_norm = norm(g_task), norm(g_adv)
  ratio = jnp.where(adv_norm > 0, task_norm / jnp.where(adv_norm > 0, adv_norm, 1.0), 0.0)
  return (1.0 - beta) * g_task + beta * ratio * g_adv


@dataclasses.dataclass(frozen=True)
class MixedFSHAServer:
  """Honest tail + FSHA; returns `mix(g_task, g_adv, beta)` (beta = 1: norm-matched FSHA)."""

  honest: HonestServer
  hijack: FSHAServer
  beta: float

  kind = "mixed"

  def init(self, tail: dict, pilot: dict, key: jax.Array) -> dict:
    return {"honest": self.honest.init(tail), "fsha": self.hijack.init(pilot, key)}

  def respond(self, state: dict, forward: Forward, oracle) -> Backward:
    g_task = self.honest.respond(state["honest"], forward, oracle).g
    g_adv = self.hijack.respond(state["fsha"], forward, oracle).g
    return Backward(g=mix(g_task, g_adv, self.beta))

  def step(self, state: dict, forward: Forward, oracle, public, key):
    honest, task, log_task = self.honest.step(state["honest"], forward, oracle, public, key)
    hijacked, adv, log_adv = self.hijack.step(state["fsha"], forward, oracle, public, key)
    return ({"honest": honest, "fsha": hijacked}, Backward(g=mix(task.g, adv.g, self.beta)),
            {**log_task, **log_adv})


def task_tail(server, state: dict) -> dict | None:
  """The tail a server would deploy for the task (None: FSHA as published trains none)."""
  if server.kind == "honest":
    return state["params"]
  return state["honest"]["params"] if server.kind == "mixed" else None


def fsha_state(server, state: dict) -> dict | None:
  """The FSHA part of a server's state (None for an honest server)."""
  if server.kind == "fsha":
    return state
  return state["fsha"] if server.kind == "mixed" else None
