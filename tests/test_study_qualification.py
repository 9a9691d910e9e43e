"""The qualification matrix the main job produces: tests named by AttackSpec.checks exist, and
the run-derived items carry the study's own numbers (a synthetic study with known answers)."""

import ast
import pathlib

import pytest

from lla.attacks import registry
from lla.scoring import policy as policy_lib
from lla.scoring import qualification as matrix_lib
from lla.scoring import scorecard
from lla.scoring import synthetic as syn
from lla.study import qualification

REPO = pathlib.Path(__file__).resolve().parent.parent
POL = policy_lib.load_policy()


def test_every_check_names_a_test_of_this_repository():
  checks = [(m["name"], kind, test) for m in registry.module_entries()
            for kind, test, _ in m["checks"]]
  assert checks, "no module declares a qualifying test"
  for name, kind, test in checks:
    path, _, function = test.partition("::")
    function = function.partition("[")[0]  # a parametrised test's id names its case
    assert kind in matrix_lib.KINDS, (name, kind)
    source = REPO / path
    assert source.is_file(), (name, test)
    defined = {n.name for n in ast.walk(ast.parse(source.read_text()))
               if isinstance(n, ast.FunctionDef)}
    assert function in defined, (name, test)


@pytest.fixture(scope="module")
def card(tmp_path_factory):
  root = tmp_path_factory.mktemp("qual")
  syn.make_capture(str(root / "cap"), syn.truth_tokens(docs=64))
  specs = []
  for m in range(3):
    specs += [syn.Spec("activation", "beam_inversion", 30, m),
              syn.Spec("gradient_only", "gradient_heuristic", 1, m),
              syn.Spec("activation", "beam_inversion", 4, m, defense="mixup"),
              syn.Spec("activation_defense_aware", "beam_inversion", 6, m, defense="mixup"),
              syn.Spec("activation", "beam_inversion", 8, m, defense="gaussian"),
              syn.Spec("activation_defense_aware", "beam_inversion", 7, m, defense="gaussian")]
  syn.make_run(str(root / "run"), str(root / "cap"), specs, POL.sha256)
  return scorecard.build(str(root / "run"), POL, contrasts=False)


def test_run_derived_items_carry_the_studys_numbers(card):
  modules = registry.module_entries()
  items = qualification.from_card(card, modules, POL)
  real = {i["module"]: i for i in items if i["kind"] == "real_model"}
  (undefended,) = card["undefended"]
  act, grad = undefended["pooled"]["activation"], undefended["pooled"]["gradient_only"]
  # 30 of 32 tokens per document clears the 1 pp bar; 1 of 32 is below the ~5% baseline.
  assert act["excess_pp"] > POL.positive_control_pp > grad["excess_pp"]
  assert (real["activation"]["status"], real["gradient_only"]["status"]) == ("pass", "partial")
  assert f"{act['excess_pp']:+.2f} pp" in real["activation"]["detail"]
  assert real["activation"]["evidence"] == "runs " + ", ".join(
      f"k6/public/none/m{m}/s0/activation" for m in range(3))
  adaptation = {i["detail"].split()[0]: i for i in items if i["kind"] == "adaptation"}
  # Defense-aware beats the unaware attack under mixup (6 > 4 hits), not under gaussian (7 < 8).
  assert (adaptation["mixup"]["status"], adaptation["gaussian"]["status"]) == ("pass", "partial")
  assert set(i["module"] for i in adaptation.values()) == {"activation_defense_aware"}


def test_the_matrix_is_built_from_checks_and_runs(card):
  modules = registry.module_entries()
  items = qualification.from_checks(modules) + qualification.from_card(card, modules, POL)
  q = matrix_lib.matrix(modules, items)
  assert q["activation"]["reference_consistency"]["status"] == "pass"
  assert q["activation"]["real_model"]["status"] == "pass"
  assert q["activation_defense_aware"]["adaptation"]["status"] == "partial"  # worst of two
  assert q["gradient_only"]["real_model"]["status"] == "partial"
  assert q["ridge"]["real_model"]["status"] == matrix_lib.NOT_QUALIFIED
  assert q["decoy_structural"]["synthetic"]["status"] == "pass"
