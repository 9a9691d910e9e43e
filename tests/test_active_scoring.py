"""The active tier in the coverage report, the qualification matrix and the scorecard."""

from lla.attacks import registry
from lla.scoring import coverage, qualification, scorecard


class _Record:  # Only the fields coverage reads.

  def __init__(self, attack, seed, knowledge):
    self.run_id, self.attack, self.status, self.error = f"{attack}{seed}", attack, "ok", None
    self.defense, self.knowledge, self.model_seed = "none", knowledge, seed


def test_active_tier_is_reported_on_its_own():
  modules = [{"name": "activation", "family": "beam_inversion",
              "observations": ["activations"]},
             {"name": "fsha_decode", "family": "active_hijack",
              "observations": ["activations"], "tier": "active"}]
  space = coverage.ThreatSpace(("beam_inversion", "active_hijack"), ("activations",),
                               ("trained", "none"), ("none",))
  records = ([_Record("activation", s, "trained") for s in range(3)]
             + [_Record("fsha_decode", s, "none") for s in range(2)])
  report = coverage.report(records, space, modules)
  tiers = {(c["family"], c["knowledge"]): (c["tier"], c["status"]) for c in report["cells"]}
  assert tiers[("active_hijack", "none")] == ("active", "partial")
  assert tiers[("beam_inversion", "trained")] == ("passive", "covered")
  assert report["tiers"]["active"] == {"covered": 0, "partial": 1, "unmeasured": 1,
                                       "out of scope": 0}
  assert report["tiers"]["passive"]["covered"] == 1
  matrix = qualification.matrix(modules, [])
  assert matrix["fsha_decode"]["tier"] == "active" and matrix["activation"]["tier"] == "passive"
  card = {"e_hash": "0" * 64, "coverage": report, "gates": [], "rows": [], "undefended": [],
          "contrasts": None, "qualification": matrix, "similarity_note": None,
          "cost": {"flops_total": 0.0, "flops_unknown": [], "wall_s_total": 0.0},
          "policy": {"policy_id": "p", "sha256": "0" * 64, "threshold_pp": 1.0,
                     "wilson_z": 2.5392, "min_seeds": 3, "seed_fields": ["model_seed"],
                     "flags": []}}
  text = scorecard.markdown(card)
  assert "### Active tier: covered 0, partial 1, unmeasured 1" in text
  assert "### Passive tier: covered 1, partial 0, unmeasured 1" in text
  assert text.index("| activation | passive |") < text.index("| fsha_decode | active |")


def test_fsha_decode_is_registered_in_the_active_tier():
  spec = registry.get("fsha_decode").spec
  assert (spec.tier, spec.family, spec.knowledge, spec.needs_weights) == (
      "active", "active_hijack", ("none",), False)
  entry = next(m for m in registry.module_entries() if m["name"] == "fsha_decode")
  assert entry["tier"] == "active"
