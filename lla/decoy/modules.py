"""The decoy-row attacks (PROTOCOL section 7) in the attack catalogue.

They run in lla.decoy.run on the frames of a decoy-row capture (not on a replay
Workspace) and write their own records into the main job's study (lla.decoy.records), so
they are listed with `registry.describe`: coverage places their records and the
qualification matrix lists them, while replay never runs them.

  decoy_structural                     real/decoy row mask from the returned-gradient rows
  decoy_norm                           the same from the rows' norms (adapts to the mitigation)
  decoy_content_<features>_<classifier>  known-plaintext probe on the real rows' features
"""

from __future__ import annotations

from lla.attacks import registry

STRUCTURAL_FAMILY = STRUCTURAL = "decoy_structural"
NORM = "decoy_norm"
CONTENT_FAMILY = "decoy_content"
# Features of the content probe (lla.decoy.attacks.FEATURES) -> what they read.
# The decoy-row split's frames are an observation kind of their own (registry.OBSERVATIONS):
# "decoy_forward" (the rows sent, real and decoy, permuted) and "decoy_gradients" (the rows
# returned), so that no generic attack on a split LLM's h and g fits a decoy capture.
FORWARD, GRADIENTS = "decoy_forward", "decoy_gradients"
FEATURE_OBSERVATIONS = {"gradient": (GRADIENTS,), "forward": (FORWARD,),
                        "joined": (FORWARD, GRADIENTS)}
CLASSIFIERS = ("linear", "mlp")
_THREAT = ("the untrusted cloud node of the decoy-row split: sees every frame it is sent and "
           "every gradient it is returned; holds no client weights beyond the public "
           "initialisation (knowledge 'trained')")


def content_name(features: str, classifier: str) -> str:
  return f"{CONTENT_FAMILY}_{features}_{classifier}"


registry.describe(registry.AttackSpec(
    STRUCTURAL, "decoy_structural", (GRADIENTS,), knowledge=("trained",),
    needs_weights=False, reference="PROTOCOL.md section 7", threat_model=_THREAT,
    description="a row is real iff its returned-gradient row is not all zero",
    checks=(("synthetic", "tests/test_decoy_system.py::test_structural_attack",
             "exact frames on a trained tiny split; base rate with the mitigation"),)))

registry.describe(registry.AttackSpec(
    NORM, STRUCTURAL_FAMILY, (GRADIENTS,), knowledge=("trained",), needs_weights=False,
    adapts_to=("decoy_rows",), reference="PROTOCOL.md section 7 (mitigation); lla.decoy.attacks",
    threat_model=_THREAT + "; knows the mitigation's family (every row clipped to C_g, the "
    "same noise on every row) and the public number of real rows per frame, never the "
    "secret permutation or rotation",
    description="the real rows are the frame's R rows of largest returned-gradient norm: "
    "clipping keeps a real row's gradient inside its norm, a decoy row carries noise alone",
    checks=(("synthetic", "tests/test_decoy_system.py::test_norm_attack_reads_the_mitigated_norms",
             "exact frames where decoy gradients are zero; above chance on clipped-and-noised "
             "rows, at chance when real rows carry no gradient"),)))

for _features, _observations in FEATURE_OBSERVATIONS.items():
  for _classifier in CLASSIFIERS:
    registry.describe(registry.AttackSpec(
        content_name(_features, _classifier), CONTENT_FAMILY, _observations,
        knowledge=("trained",), needs_weights=False, reference="PROTOCOL.md section 7",
        threat_model=_THREAT,
        description=f"known-plaintext {_classifier} probe on the real rows' {_features} "
        "features, scored on the held-out half of the frames",
        checks=(("synthetic",
                 "tests/test_decoy_system.py::test_probe_detects_injected_leak_not_shuffled_labels",
                 "fires on injected leaks, not on shuffled labels"),)))
