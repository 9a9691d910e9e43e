"""Attacks that kill their own process, for the scale-out tests (loaded as a plugin).

`peer_dies`: in a job across processes, process 1 is SIGKILLed inside its first document
chunk, mid-attack; any other process (and a job of one process) computes ridge predictions.
`dies_once`: the first time it runs with a marker path, the process running it is SIGKILLed
mid-attack (a killed sweep worker); every later run appends to `<marker>.attempts` and
computes ridge predictions.
"""

from __future__ import annotations

import dataclasses
import os
import signal

import jax
import numpy as np

from lla.attacks import budget, registry

budget.declare("dies_once_marker", "", str, doc="file whose absence kills the worker once",
               source="tests/scaleout_plugins.py")


def _kill_self() -> None:
  os.kill(os.getpid(), signal.SIGKILL)


@dataclasses.dataclass(frozen=True)
class PeerDies:
  spec: registry.AttackSpec

  def __call__(self, ws, view, key):
    def per_chunk(ranked):
      if jax.process_index() == 1:
        _kill_self()
      return ranked[..., 0]
    ranked = ws.activation_ranked(int(view.candidates))
    predictions = ws.map_documents(per_chunk, (ranked,), 64.0)
    return registry.AttackResult(np.asarray(predictions, np.int32), 0.0)


@dataclasses.dataclass(frozen=True)
class DiesOnce:
  spec: registry.AttackSpec

  def __call__(self, ws, view, key):
    marker = view.dies_once_marker
    ranked = ws.activation_ranked(int(view.candidates))
    if marker:
      with open(marker + ".attempts", "a") as f:
        f.write(f"{os.getpid()}\n")
      try:
        with open(marker, "x") as f:
          f.write(str(os.getpid()))
      except FileExistsError:
        pass
      else:
        _kill_self()
    return registry.AttackResult(np.asarray(ranked[..., 0], np.int32), 0.0)


registry.register(PeerDies(registry.AttackSpec(
    "peer_dies", "test_fault", ("activations",), budget_fields=("candidates", "ridge_alpha"),
    role="negative_control", description="kills process 1 of a job mid-attack")))
registry.register(DiesOnce(registry.AttackSpec(
    "dies_once", "test_fault", ("activations",),
    budget_fields=("candidates", "ridge_alpha", "dies_once_marker"), role="negative_control",
    description="kills its worker the first time it runs")))
