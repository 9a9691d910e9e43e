"""The main job's defense entries: (name, parameter, values[, fixed]) unrolled into defended
configurations, their labels, the defenses built from them, the fine-tuning rule, the
declared threat space, and the report's weakest-to-strongest order (1 / epsilon for an
epsilon)."""

import math
import types

import ml_collections
import pytest

from configs import main_table as main_table_config
from lla import defenses
from lla.replay import driver as replay
from lla.study import defense_sweep, report

VARIANTS = ("cpu", "tiny", "paper", "cpu_llama", "tiny_llama", "cpu_smollm2", "paper_qwen3",
            "paper_llama32", "cpu_field_defenses")
FIELD_DEFENSES = {"santext", "custext", "snd", "mid", "adversarial"}


def _config(entries, finetune=()) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.defenses = entries
  config.defense_finetune = finetune
  return config


def test_three_field_entries_keep_their_labels_and_fixed_parameters_reach_the_defense():
  got = defense_sweep.configurations(_config((
      ("gaussian", "sigma", (0.3, 3.0)),
      ("dp_forward", "epsilon", (8.0, 1.0), (("delta", 1e-5), ("clip_norm", 2.5))))))
  assert [c.label for c in got] == [
      "gaussian_sigma0.3", "gaussian_sigma3.0",
      "dp_forward_epsilon8.0_delta1e-05_clip_norm2.5",
      "dp_forward_epsilon1.0_delta1e-05_clip_norm2.5"]
  weak, strong = got[2].defense(), got[3].defense()
  assert (weak.epsilon, weak.delta, weak.clip_norm) == (8.0, 1e-5, 2.5)
  # strength = 1 / epsilon: the smaller epsilon is the stronger defense.
  assert (weak.strength, strong.strength) == (1 / 8.0, 1.0)
  assert got[0].defense() == defenses.make("gaussian", sigma=0.3)


@pytest.mark.parametrize("entry, message", [
    (("gaussian", "sigma"), "expected (name, parameter, values)"),
    (("gaussian", "sigma", 0.3), "expected (name, parameter, values)"),
    (("gaussian", "sigma", ()), "with at least one value"),
    (("dp_forward", "epsilon", (8.0,), (("epsilon", 1.0),)), "other than the swept 'epsilon'"),
    (("dp_forward", "epsilon", (8.0,), (("delta",),)), "must be (parameter, value) pairs"),
    (("dp_forward", "epsilon", (8.0,), (("clip", 1.0),)), "does not declare parameter(s) clip"),
    (("dx_privacy", "epsilon", (-1.0,)), "epsilon=-1.0 must be > 0"),
    (("no_such_defense", "x", (1,)), "unknown defense 'no_such_defense'"),
])
def test_a_bad_entry_is_refused_in_one_line_naming_it(entry, message):
  with pytest.raises(defenses.DefenseError) as refused:
    defense_sweep.configurations(_config((entry,)))
  assert message in str(refused.value) and "\n" not in str(refused.value)


def test_two_entries_with_one_label_are_refused():
  with pytest.raises(defenses.DefenseError, match="lists gaussian_sigma0.3 twice"):
    defense_sweep.configurations(_config((("gaussian", "sigma", (0.3,)),
                                          ("gaussian", "sigma", (0.3, 1.0)))))


def test_a_defense_on_the_training_objective_is_fine_tuned_whatever_the_list_says():
  config = _config((), finetune=("dx_privacy",))
  assert defense_sweep.fine_tunes_with(defenses.make("nopeek", alpha=1.0), config)
  assert defense_sweep.fine_tunes_with(defenses.make("dx_privacy", epsilon=10.0), config)
  assert not defense_sweep.fine_tunes_with(defenses.make("gaussian", sigma=0.3), config)


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_builds_its_defenses_and_declares_them(variant):
  config = main_table_config.get_config(variant)
  configurations = defense_sweep.configurations(config)
  names = {c.name for c in configurations}
  assert names <= set(config.scoring.threat_space.defenses)
  assert set(config.defense_finetune) <= set(defenses.names())
  if variant == "cpu_field_defenses":
    # The field's five defenses alone, two strengths each (MID three, its bottleneck at a
    # rate of its own), every one fine-tuned with the target; `cpu`'s published and
    # FLOP-matched attacks stay off the defended captures.
    assert names == FIELD_DEFENSES
    assert sorted(c.name for c in configurations) == sorted(list(FIELD_DEFENSES) * 2 + ["mid"])
    assert {c.defense().weights_lr for c in configurations if c.name == "mid"} == {1e-2}
    assert set(config.defense_finetune) == FIELD_DEFENSES
    cpu = main_table_config.get_config("cpu")
    assert config.defense_skip_attacks == cpu.defense_skip_attacks
    assert "sipit" in config.defense_skip_attacks and config.published.attacks == ()
    for field in ("data", "finetune", "settings", "attacks", "defense_cut", "defense_docs"):
      assert config[field] == cpu[field], field
  elif variant != "cpu_smollm2":
    assert {"dx_privacy", "dp_forward"} <= names
    # Both ends of the sweep are measured: one strength on tiny, two on cpu, three on paper.
    per = {n: sum(c.name == n for c in configurations) for n in ("dx_privacy", "dp_forward")}
    want = 1 if variant.startswith("tiny") else (3 if variant.startswith("paper") else 2)
    assert per == {"dx_privacy": want, "dp_forward": want}
  else:  # Not run on SmolLM2's job: its threat space does not declare them unmeasured.
    assert not {"dx_privacy", "dp_forward"} & set(config.scoring.threat_space.defenses)


def _gate(label: str, defense: str, strength, decision: str) -> dict:
  return {"config": {"defense": defense, "cut": 6,
                     "defense_params": {"label": label, "strength": strength}},
          "pooled": {"activation": {"exact_doc_recovery": 0.0, "token_recovery": 0.5}},
          "decision": decision, "reasons": [], "n_seeds": 3,
          "envelope": {"envelope_pp": 10.0, "argmax": "activation", "floor_pp": 0.5}}


def test_report_orders_epsilon_defenses_from_large_epsilon_to_small(tmp_path):
  card = {"gates": [_gate("dx_privacy_epsilon12.0", "dx_privacy", 1 / 12.0, "FAIL"),
                    _gate("dx_privacy_epsilon120.0", "dx_privacy", 1 / 120.0, "FAIL"),
                    _gate("dx_privacy_epsilon60.0", "dx_privacy", 1 / 60.0, "FAIL")]}
  utility = {"dx_privacy_epsilon12.0/m0": {"cross_entropy_increase": {"value": 0.1}},
             "dx_privacy_epsilon120.0/m0": {"cross_entropy_increase": {"value": 0.3}},
             "dx_privacy_epsilon60.0/m0": {"cross_entropy_increase": {"value": 0.2}}}
  points = report._defense_points(card, utility)
  # A label sort would put epsilon120 before epsilon60; the strength puts it first.
  assert [p["label"] for p in points] == ["dx_privacy_epsilon120.0", "dx_privacy_epsilon60.0",
                                          "dx_privacy_epsilon12.0"]
  rows = report.defense_table(points)[2:]
  assert [r.split(" | ")[1] for r in rows] == [f"{1 / 120:.4g}", f"{1 / 60:.4g}",
                                               f"{1 / 12:.4g}"]
  assert math.isclose(points[0]["ce_increase"], 0.3)
  report.frontier_figure(points, tmp_path / "frontier.png")
  assert (tmp_path / "frontier.png").stat().st_size > 1000


def test_a_defense_with_weights_of_its_own_is_fine_tuned_and_its_weights_kept_from_the_attacker():
  mid = defenses.make("mid", lam=1.0)
  assert defense_sweep.fine_tunes_with(mid, _config(()))
  params = {"wte": 1, "h": 2, mid.params_key: "the client's secret"}
  target = types.SimpleNamespace(attacker=lambda calibration: replay.Attacker(
      params, None, "m", calibration, "public", {}))
  attacker = defense_sweep.attacker_facing(target, mid, "calibration")
  assert attacker.params == {"wte": 1, "h": 2} and attacker.calibration_tokens == "calibration"
  gaussian = defense_sweep.attacker_facing(target, defenses.make("gaussian", sigma=0.3), None)
  assert gaussian.params is params
