"""Defenses at the cut: registry (`base`), mechanisms, defended training loss and utility.

Importing this package registers every mechanism: `names()` lists them, `make(name, ...)`
builds one from its public parameters, `Secret.draw()` draws the defender's secret and
`apply(defense, x, secret.keys(defense.name, step))` applies it to h (or g).
"""

from lla.defenses.activations import (GaussianNoise, Quantize, SecretMixup, SecretProjection,
                                      TopK, clip_rows, quantize_rows, random_projection)
from lla.defenses.adversarial import Adversarial
from lla.defenses.base import (Defense, DefenseError, Secret, SecretKeys, apply, declared, get,
                               make, names, seed_hash, step_keys)
from lla.defenses.dp_forward import DPForward, analytic_gaussian_sigma
from lla.defenses.dx_privacy import DxPrivacy
from lla.defenses.gradients import GradientClipNoise, guard_gradient
from lla.defenses.mid import Mid
from lla.defenses.nopeek import NoPeek, distance_correlation
from lla.defenses.snd import SplitAndDenoise
from lla.defenses.sanitise import CusText, SanText
