"""The messages of split training, and nothing else: what crosses the client/server boundary.

The client sends `Forward` (its activations h with the step and run it belongs to); the
server answers with `Backward` (the gradient g it claims is dL/dh). Where the loss needs the
labels (the next tokens, i.e. the text itself) it runs in the client's trusted loss oracle
(lla.active.client.LossOracle), which the server may call but not read. Both messages are
pytrees so that a whole step, client and server, is one jitted function.

Shapes: h, g [B, T, d] float32.
"""

from __future__ import annotations

import jax
from flax import struct

FORWARD_FIELDS = ("h", "step", "run_id")
BACKWARD_FIELDS = ("g",)


@struct.dataclass
class Forward:
  """Client -> server. h [B, T, d] float32; step and run_id are int32 scalars."""

  h: jax.Array
  step: jax.Array
  run_id: jax.Array


@struct.dataclass
class Backward:
  """Server -> client. g [B, T, d] float32, the gradient the client applies to its layers."""

  g: jax.Array


def check_forward(message) -> None:
  """Raises TypeError unless `message` is a Forward holding exactly h, step and run_id."""
  if type(message) is not Forward:
    raise TypeError(f"the client may send only a Forward, got {type(message).__name__}")
  fields = tuple(f for f in message.__dataclass_fields__)
  if fields != FORWARD_FIELDS:
    raise TypeError(f"a Forward holds {FORWARD_FIELDS}, this one {fields}")
  if message.h.ndim != 3:
    raise TypeError(f"Forward.h must be [B, T, d], got shape {message.h.shape}")
