"""A gate's fitting attacks are judged at the revision and code the study's threat space
lists, and the defense facts come from the study, never from the live registries
(issue 49, items 1 and 2).

The runs are synthetic (lla.scoring.synthetic): every defended attack hits nothing and the
undefended reference hits 30 of 32 tokens per document on 3 model seeds, so with every
fitting attack measured the gate is a PASS (checked first in each test: the cases below
withhold it for the reason under test and no other).
"""

import hashlib
import sys

import pytest

from lla.evidence import rundir
from lla.scoring import gates
from lla.scoring import policy as policy_lib
from lla.scoring import scorecard
from lla.scoring import synthetic as syn
from lla.scoring import threat_space

POL = policy_lib.load_policy()
CODE_A, CODE_B = "a" * 64, "b" * 64


@pytest.fixture(scope="module")
def cap(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("cap"))
  syn.make_capture(d, syn.truth_tokens(docs=64))
  return d


def _entries(revision=2, code=CODE_A, facts=None):
  """The study's threat space: a generic attack, a projection-adaptive one at `revision`
  (code `code`), and (with `facts`) a defense-aware baseline holding those facts."""
  out = [{"name": "activation", "family": "beam_inversion", "observations": ["activations"],
          "revision": 1, "source": {"module": "m.activation", "sha256": None}},
         {"name": "projection_adaptive", "family": "beam_inversion",
          "observations": ["activations"], "adapts_to": ["projection", "plugin_rot"],
          "revision": revision, "source": {"module": "m.projection_adaptive",
                                           "sha256": code}}]
  if facts is not None:
    out.append({"name": "aware", "family": "beam_inversion", "observations": ["activations"],
                "defense_aware": True, "defenses": facts, "revision": 1,
                "source": {"module": "m.aware", "sha256": None}})
  return out


def _study_gate(tmp_path, cap, entries, defense="projection", revision=2, code=CODE_A,
                attacks=("activation", "projection_adaptive")):
  """Writes the synthetic study with `entries` as its recorded threat space (through the
  logged writer, then sealed) and scores it from the study alone; returns the gate."""
  run = str(tmp_path / "run")
  specs = []
  for m in range(3):
    specs.append(syn.Spec("activation", "beam_inversion", 30, m))
    specs += [syn.Spec(a, "beam_inversion", 0, m, defense=defense,
                       attack_revision=revision if a == "projection_adaptive" else 1,
                       attack_code_sha256=code if a == "projection_adaptive" else None)
              for a in attacks]
  syn.make_run(run, cap, specs, POL.sha256, finalize=False)
  threat_space.record(run, entries)
  rundir.finalize(run)
  (g,) = scorecard.build(run, POL)["gates"]
  return g


def test_superseded_revision_is_unmeasured_and_named(tmp_path, cap):
  # The same study with the listed revision measured: PASS.
  g = _study_gate(tmp_path / "ok", cap, _entries(revision=2), revision=2)
  assert g["decision"] == gates.PASS, g["reasons"]
  # The revision-1 record under a threat space listing revision 2.
  g = _study_gate(tmp_path / "old", cap, _entries(revision=2), revision=1)
  assert g["decision"] == gates.INSUFFICIENT
  why = "revision 1 recorded, the study's threat space lists revision 2"
  assert g["fitting"]["unmeasured"] == {"projection_adaptive": why}
  assert (f"PASS withheld: fitting attack(s) unmeasured: projection_adaptive ({why})"
          in g["reasons"])
  # The envelope still holds what was measured (a missing attack can only raise it).
  assert "projection_adaptive" in g["pooled"]


def test_record_of_other_code_is_unmeasured(tmp_path, cap):
  g = _study_gate(tmp_path / "other", cap, _entries(code=CODE_A), code=CODE_B)
  assert g["decision"] == gates.INSUFFICIENT
  assert g["fitting"]["unmeasured"] == {
      "projection_adaptive": "made by code bbbbbbbbbbbb, the study's threat space lists "
                             "code aaaaaaaaaaaa"}
  # A record made before records held their code identity is judged by its revision.
  g = _study_gate(tmp_path / "none", cap, _entries(code=CODE_A), code=None)
  assert g["decision"] == gates.PASS, g["reasons"]


def test_code_identity_covers_the_shared_code_an_attack_imports():
  """projection_adaptive's identity is not its file's hash, and it changes when a module it
  imports through another (lla.attacks.seed.beam, via adaptive.common / beam_attacks)
  changes, not when an lla module it never imports does."""
  from lla.attacks import registry  # pylint: disable=g-import-not-at-top
  registry.load_builtin()
  module = sys.modules["lla.attacks.adaptive.projection_adaptive"]
  with open(module.__file__, "rb") as f:
    own = hashlib.sha256(f.read()).hexdigest()
  identity = registry.source("projection_adaptive")["sha256"]
  assert identity == registry.code_identity(module.__file__) and identity != own
  import lla.attacks.seed.beam as beam  # pylint: disable=g-import-not-at-top
  import lla.decoy.report as unrelated  # pylint: disable=g-import-not-at-top
  saved = dict(registry._FILE_SHA256), dict(registry._IDENTITY)
  try:
    registry._IDENTITY.clear()
    registry._FILE_SHA256[unrelated.__file__] = "0" * 64
    assert registry.code_identity(module.__file__) == identity
    registry._IDENTITY.clear()
    registry._FILE_SHA256[beam.__file__] = "0" * 64
    assert registry.code_identity(module.__file__) != identity
  finally:
    registry._FILE_SHA256.clear(); registry._FILE_SHA256.update(saved[0])
    registry._IDENTITY.clear(); registry._IDENTITY.update(saved[1])


def test_records_carry_the_identity_the_threat_space_lists():
  from lla.attacks import registry  # pylint: disable=g-import-not-at-top
  entries = {m["name"]: m for m in registry.module_entries()}
  # The defense-aware entries hold the defense registry's facts.
  aware = entries["activation_defense_aware"]
  assert aware["defenses"]["projection"] == "activations"
  assert aware["defenses"]["nopeek"] == "training"
  assert "defenses" not in entries["activation"]
  assert entries["projection_adaptive"]["revision"] == 2


def test_unknown_defense_withholds_pass(tmp_path, cap):
  """`plugin_rot` is registered in no process here: the scoring process cannot look it
  up, so its facts come from the study or nowhere."""
  from lla import defenses  # pylint: disable=g-import-not-at-top
  assert "plugin_rot" not in defenses.names()
  both = ("activation", "projection_adaptive", "aware")
  # Recorded by a process where the plugin defense was registered (acting on h): the
  # defense-aware baseline is required, and with it measured the gate passes.
  facts = {"projection": "activations", "plugin_rot": "activations"}
  g = _study_gate(tmp_path / "known", cap, _entries(facts=facts), "plugin_rot",
                  attacks=both)
  assert g["decision"] == gates.PASS, g["reasons"]
  g = _study_gate(tmp_path / "known_missing", cap, _entries(facts=facts), "plugin_rot")
  assert g["decision"] == gates.INSUFFICIENT
  assert g["fitting"]["unmeasured"] == {"aware": "not run"}
  # Recorded where it was not registered: the baseline stays required and PASS is
  # withheld even with it measured, naming the defense.
  g = _study_gate(tmp_path / "unknown", cap, _entries(facts={"projection": "activations"}),
                  "plugin_rot", attacks=both)
  assert g["decision"] == gates.INSUFFICIENT
  assert g["fitting"]["unknown_defense"] == ["aware"]
  assert any("defense 'plugin_rot' is unknown to the study's threat space" in r
             for r in g["reasons"] if r.startswith("PASS withheld"))
  # A defense the study knows leaves h alone: the baseline does not fit, PASS without it.
  g = _study_gate(tmp_path / "grad", cap,
                  _entries(facts={"projection": "activations", "plugin_rot": "gradients"}),
                  "plugin_rot")
  assert g["decision"] == gates.PASS, g["reasons"]
  assert g["fitting"]["fitting"] == ["activation", "projection_adaptive"]
