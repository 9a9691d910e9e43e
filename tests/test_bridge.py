"""The bridge table (lla.study.bridge, experiments/bridge.py): cells and conclusions from
hand-written scorecards, and the refusal of a workdir that holds no finished study.
tests/test_main_table_gguf.py reads a real sealed study with it and a tampered one."""

import subprocess
import sys
import pathlib

import pytest

from lla.study import bridge

REPO = pathlib.Path(__file__).resolve().parent.parent


def _card(activation: float, exact: float, primary: tuple[float, float, float, bool] | None,
          gates: dict[str, tuple[str, float | None]]) -> dict:
  estimate, lo, hi, passed = primary if primary else (None,) * 4
  return {
      "undefended": [{"config": {"corpus": "wikitext2", "cut": 6, "knowledge": "public",
                                 "defense": "none", "defense_params": {}},
                      "pooled": {"activation": {"token_recovery": activation,
                                                "exact_doc_recovery": exact, "n": 1024}}},
                     {"config": {"corpus": "clinical", "cut": 6, "knowledge": "public",
                                 "defense": "none", "defense_params": {}},
                      "pooled": {"ridge": {"token_recovery": 0.5, "exact_doc_recovery": 0.0,
                                           "n": 64}}}],
      "contrasts": {"primary": [{"evaluated": primary is not None, "estimate": estimate,
                                 "lo": lo, "hi": hi, "passed": passed,
                                 "reason": "too few models"}]},
      "gates": [{"config": {"defense": label.split("_")[0],
                            "defense_params": {"label": label}},
                 "decision": decision,
                 "envelope": None if envelope is None else {"envelope_pp": envelope,
                                                            "argmax": "joint",
                                                            "floor_pp": 0.5}}
                for label, (decision, envelope) in gates.items()]
               + [{"config": {"defense": "decoy_rows", "defense_params": {"mitigation": "none"}},
                   "decision": "FAIL", "envelope": {"envelope_pp": 40.0, "argmax": "decoy_norm",
                                                    "floor_pp": 0.4}}]}


def _column(name: str, card: dict) -> bridge.Column:
  return bridge.Column(f"runs/{name}", "cpu", name, 128, 3, "e" * 64, "s" * 64, 36.0, card)


@pytest.fixture()
def columns():
  gpt2 = _card(0.8506, 0.0156, (-0.28, -0.79, 0.23, False),
               {"gaussian_sigma0.3": ("FAIL", 77.79), "mixup_m2": ("FAIL", 23.88),
                "topk_sparsity0.9": ("FAIL", 71.0), "quantize_bits4": ("PASS", 0.4)})
  llama = _card(0.7478, 0.0, (2.87, 2.00, 3.74, True),
                {"gaussian_sigma0.3": ("FAIL", 71.91), "mixup_m2": ("INSUFFICIENT_EVIDENCE", 30.0),
                 "topk_sparsity0.9": ("FAIL", 51.5), "quantize_bits4": ("FAIL", 72.2),
                 "nopeek_alpha1.0": ("FAIL", 72.9)})
  return [_column("gpt2", gpt2), _column("llama", llama)]


def test_cells_are_the_scorecards_numbers(columns):
  lines = bridge.markdown(columns)
  assert lines[0] == "| measure | gpt2 (cpu) | llama (cpu) |"
  row = next(l for l in lines if l.startswith("| k = 6, public: activation |"))
  assert row == ("| k = 6, public: activation | 85.06% (1.56% exact, n 1024) | "
                 "74.78% (0.00% exact, n 1024) |")
  # Only WikiText-2 settings: the clinical corpus's ridge row is not a main-table row.
  assert not any("ridge" in l for l in lines if l.startswith("| k ="))
  primary = next(l for l in lines if l.startswith("| primary test"))
  assert "-0.28 pp [-0.79, +0.23] (not met)" in primary
  assert "+2.87 pp [+2.00, +3.74] (met)" in primary
  assert any(l == "| nopeek_alpha1.0 | — | FAIL +72.90 pp (joint) |" for l in lines)
  # The decoy split's own model is the same in every job: not a bridge row.
  assert not any("decoy" in l for l in lines)


def test_conclusions_say_what_transfers(columns):
  said = {s.split(" (")[0]: s for s in bridge.conclusions(columns)}
  assert said["Primary test"].endswith("met on some models and not on others, so it does "
                                       "not transfer.")
  assert said["gaussian_sigma0.3"].endswith("FAIL on every model, so it transfers.")
  assert said["topk_sparsity0.9"].endswith("FAIL on every model, so it transfers.")
  assert said["mixup_m2"].endswith("undecided on some model (INSUFFICIENT_EVIDENCE), so "
                                   "whether it transfers is open; FAIL where decided.")
  assert said["quantize_bits4"].endswith("the verdicts differ, so it does not transfer.")
  assert said["nopeek_alpha1.0"].endswith("not run on every model.")
  assert len(said) == 6
  same = bridge.conclusions([columns[0], columns[0]])
  assert same[0].endswith("the same outcome on every model, so it transfers.")


def test_an_unevaluated_primary_test_is_said(columns):
  unevaluated = _column("tiny", _card(0.9, 0.1, None, {}))
  said = bridge.conclusions([columns[0], unevaluated])
  assert said[0].startswith("Primary test: not evaluated on every model")
  assert "tiny (cpu): not evaluated" in said[0]


def test_a_workdir_without_a_finished_study_is_refused_in_one_line(tmp_path):
  (tmp_path / "empty").mkdir()
  proc = subprocess.run([sys.executable, "-m", "experiments.bridge",
                         f"--workdirs={tmp_path / 'empty'}"],
                        capture_output=True, text=True, cwd=REPO, timeout=120)
  assert proc.returncode == 1
  line, = proc.stderr.strip().splitlines()
  assert line == f"error: {tmp_path / 'empty'}: no finished main job (a sealed study/) to read"
  assert list((tmp_path / "empty").iterdir()) == []
