"""The defense-aware attacker's view of a defense: its mechanism, not its secrets.

A defense-aware attacker knows the mechanism and its public parameters and passes its
public calibration activations through the same mechanism with randomness of its own
(`attacker_seed`, recorded in E.K; independent of the defender's secret, which it never
sees), then fits its decoder on them. A defense with trained weights of its own (MID's
bottleneck) is mimicked with weights at their initialisation drawn from that randomness
(`mimic`): the defender's trained weights are its secret.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from lla.defenses import base


def make_public(name: str, params: dict) -> base.Defense:
  """The defense rebuilt from its public parameters (other keys of `params`, such as a
  sweep's label, are ignored)."""
  fields = base.declared(name)
  return base.make(name, **{k: v for k, v in params.items() if k in fields})


def calibration_transform(name: str, params: dict, attacker_seed: int):
  """h_cal [N, T, d] -> what the defense would send, for a defense acting on activations,
  with the attacker's own secret; None for defenses that leave the forward message alone
  (gradient, training-time)."""
  defense = make_public(name, params)
  if defense.acts_on != "activations":
    return None
  keys = base.Secret.explicit(attacker_seed).keys(name, 0) if defense.has_secret else None
  return lambda h: np.asarray(defense.mimic(jnp.asarray(h), keys))
