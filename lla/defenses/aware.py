"""The defense-aware attacker's view of a defense: its mechanism, not its secrets.

A defense-aware attacker knows the mechanism and its public parameters and passes its
public calibration activations through the same mechanism with randomness of its own
(its own seed for noise, mixing partners, projection), then fits its decoder on them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from lla.defenses import base


def make_public(name: str, params: dict, attacker_seed: int) -> base.Defense:
  """The defense rebuilt from its public parameters, with the attacker's seed as secret."""
  cls = base.get(name)
  fields = {f.name for f in dataclasses.fields(cls)}
  public = {k: v for k, v in params.items() if k in fields and k != "secret_seed"}
  if "secret_seed" in fields:
    public["secret_seed"] = attacker_seed
  return cls(**public)


def calibration_transform(name: str, params: dict, attacker_seed: int):
  """h_cal [N, T, d] -> what the defense would send, for a defense acting on activations;
  None for defenses that leave the forward message alone (gradient, training-time)."""
  defense = make_public(name, params, attacker_seed)
  if defense.acts_on != "activations":
    return None
  key = defense.step_key(0) if defense.has_secret else None
  return lambda h: np.asarray(base.apply(defense, h, key))
