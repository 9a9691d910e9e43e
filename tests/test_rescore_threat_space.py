"""A study's threat space is part of its evidence, and `rescore` needs nothing else.

A synthetic study (lla.scoring.synthetic) whose defended projection configuration has
every module of the registry measured on it, each recovering nothing, on 3 models beside a
strong undefended control: by construction its gate is PASS whatever the fitting rule says
(every module is measured), so the answer does not come from the rule under test. It is
first scored by `experiments.rescore` in a process where a plugin registered one more
attack (`ghost_attack`, which the study also ran). Then, in processes where the ghost is
unknown and another plugin registers a new attack that fits the capture (`probe_fit`):
rescore reproduces the sealed scorecard byte for byte from the study alone (LLA_DATA_DIR
unset), and --against=current names the projection gate whose PASS the new attack would
withhold, and the attack.
"""

import hashlib
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from lla.attacks import registry
from lla.data.tokenizer import load_tokenizer
from lla.evidence import files
from lla.evidence import rundir
from lla.scoring import policy as policy_lib
from lla.scoring import scorecard
from lla.scoring import synthetic as syn
from lla.scoring import threat_space

REPO = pathlib.Path(__file__).resolve().parent.parent
GHOST_PLUGIN = '''
from lla.attacks import registry


class Ghost:
  spec = registry.AttackSpec("ghost_attack", "ghost_family", ("activations",),
                             description="registered only when the study was scored")

  def __call__(self, ws, view, key):
    raise NotImplementedError


registry.register(Ghost())
'''
PROBE_PLUGIN = GHOST_PLUGIN.replace("ghost_attack", "probe_fit").replace(
    "ghost_family", "probe_family").replace("Ghost", "Probe").replace(
        "registered only when the study was scored", "registered after the study was sealed")
DOCS = 64


def _sha256_of(path) -> str:
  return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def rescore(run, *flags, data_dir=None, plugins_dir=None):
  env = {k: v for k, v in os.environ.items() if k != "LLA_DATA_DIR"}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
      [str(REPO)] + ([str(plugins_dir)] if plugins_dir else [])))
  if data_dir is not None:
    env["LLA_DATA_DIR"] = str(data_dir)
  return subprocess.run([sys.executable, "-m", "experiments.rescore", f"--workdir={run}",
                         *flags], capture_output=True, text=True, cwd=REPO, timeout=600,
                        env=env)


def _specs(families: dict, revisions: dict | None = None):
  """Each record at its attack's revision in `revisions` (default 1): a record of another
  revision than the threat space lists counts as unmeasured."""
  revisions = revisions or {}
  specs = []
  for m in range(3):
    specs.append(syn.Spec("activation", "beam_inversion", 28, m, jitter=1))
    specs += [syn.Spec(name, family, 0, m, defense="projection",
                       attack_revision=revisions.get(name, 1))
              for name, family in sorted(families.items())]
  return specs


@pytest.fixture(scope="module")
def study(tmp_path_factory, data_dir):
  """The study, scored once by rescore with the ghost plugin loaded: (root, run, plugins)."""
  root = tmp_path_factory.mktemp("threat_space")
  plugins = root / "plugins"
  plugins.mkdir()
  (plugins / "ghost_plugin.py").write_text(GHOST_PLUGIN)
  (plugins / "probe_plugin.py").write_text(PROBE_PLUGIN)
  syn.make_capture(str(root / "cap"), syn.truth_tokens(docs=DOCS))
  # The built-in modules only: other tests of the session may have registered plugins.
  families = {m["name"]: m["family"] for m in registry.module_entries()
              if m["source"]["module"].startswith("lla.")}
  names = sorted(families)
  run = root / "run"
  revisions = {m["name"]: m["revision"] for m in registry.module_entries()}
  syn.make_run(str(run), str(root / "cap"),
               _specs({**families, "ghost_attack": "ghost_family"}, revisions),
               policy_lib.load_policy().sha256, finalize=False)
  # Its writer pins the tokenizer of its model (the data directory's GPT-2 one here):
  # scoring reads nothing outside the study, the data directory included.
  scorecard.pin_tokenizer(str(run), load_tokenizer(data_dir))
  rundir.finalize(str(run))
  proc = rescore(run, "--plugins=ghost_plugin", plugins_dir=plugins)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"wrote {run}/scorecard.json" in proc.stdout
  return root, run, plugins, names


def test_first_scoring_records_the_registry_and_pins_the_tokenizer(study, data_dir):
  _, run, plugins, names = study
  recorded = threat_space.read(str(run))
  assert [m["name"] for m in recorded.modules] == sorted(names + ["ghost_attack"])
  by_name = {m["name"]: m for m in recorded.modules}
  # Each entry's version is the code identity of the module that registered it (its file
  # and the lla modules it imports), computed here in another process.
  for name in names:
    source = by_name[name]["source"]
    origin = importlib.util.find_spec(source["module"]).origin
    assert source["sha256"] == registry.code_identity(origin) != _sha256_of(origin)
  assert by_name["ghost_attack"]["source"] == {
      "module": "ghost_plugin",
      "sha256": registry.code_identity(str(plugins / "ghost_plugin.py"))}
  assert by_name["ghost_attack"]["observations"] == ["activations"]
  card = files.read_json(str(run / rundir.SCORECARD_JSON))
  assert card["inputs"]["modules_file"] == {"file": "inputs/threat_space.json",
                                            "sha256": _sha256_of(run / threat_space.FILE)}
  # The tokenizer text ROUGE-L decoded with is the one the study pinned.
  tokenizer = load_tokenizer(data_dir)
  assert card["inputs"]["tokenizer_sha256"] == tokenizer.sha256
  assert _sha256_of(run / scorecard.TOKENIZER_FILE) == tokenizer.sha256
  assert scorecard.pinned_tokenizer(str(run)).decode(list(range(300))) == tokenizer.decode(
      list(range(300)))
  assert all(r["similarity"]["rouge_l_text"] is not None for r in card["rows"])
  # Every module measured, nothing recovered, 3 models, a strong control: PASS.
  (gate,) = card["gates"]
  assert (gate["config"]["defense"], gate["decision"]) == ("projection", "PASS"), gate["reasons"]
  assert "ghost_attack" in gate["fitting"]["fitting"]
  # Every record's module is in the study's threat space, the ghost's included (some
  # families lie outside the declared coverage grid of configs/scoring.py: unplaced there).
  unplaced = card["coverage"]["unplaced"]
  assert all(u["reason"].startswith("cell (") for u in unplaced), unplaced
  assert any(u["run_id"].endswith("/ghost_attack") and "ghost_family" in u["reason"]
             for u in unplaced)
  assert rundir.verify(str(run)) == []
  events = {e["event"].get("file"): e["event"]["type"]
            for e in (json.loads(l) for l in (run / rundir.LOG).read_text().splitlines())}
  assert events[threat_space.FILE] == "threat_space"
  assert events[scorecard.TOKENIZER_FILE] == "input_file"


def test_rescore_reproduces_from_the_study_alone_and_names_what_today_would_change(study):
  """No LLA_DATA_DIR, the ghost unknown today, a new fitting attack registered: the same
  bytes, nothing written, and the comparison with today's registry names the projection
  gate whose PASS the new attack withholds, and the attack."""
  _, run, plugins, _ = study
  before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
  proc = rescore(run, "--against=current", "--plugins=probe_plugin", plugins_dir=plugins)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
  lines = proc.stdout.splitlines()
  assert f"OK {run}/scorecard.json: reproduced byte for byte from the study alone" in lines
  assert "  + probe_fit: registered today (probe_plugin), not in the study's threat space" in lines
  assert "  - ghost_attack: in the study's threat space, not registered today" in lines
  (change,) = [l for l in lines if l.startswith("WOULD CHANGE")]
  assert change.startswith("WOULD CHANGE gate projection (cut 6, public, synthetic): "
                           "PASS -> INSUFFICIENT_EVIDENCE: ")
  assert ("probe_fit fits and is not measured on it (not run) (registered today, not in the "
          "study's threat space)") in change
  assert "ghost_attack no longer fits (not registered today)" in change
  assert "1 of 1 gate verdict(s) would change under today's registry" in proc.stdout
  assert rundir.verify(str(run)) == []


def test_an_extended_threat_space_makes_the_scorecard_stale(study):
  """A study extended by a process that registered a new fitting attack: rescore rebuilds
  the scorecard from the study's new threat space, which withholds the PASS."""
  root, run, _, _ = study
  ext = root / "extended"
  shutil.copytree(run, ext)
  probe = {"name": "probe_fit", "family": "probe_family", "observations": ["activations"],
           "requires": ["activations"], "knowledge": ["public", "trained"]}
  with rundir.extending(str(ext)):
    assert threat_space.record(str(ext), [probe])
    assert not threat_space.record(str(ext), [probe])  # unchanged: not written again
  with pytest.raises(ValueError, match="not the threat space the scorecard was built from"):
    scorecard.build_from_inputs(str(ext), files.read_json(str(ext / "scorecard.json"))["inputs"])
  proc = rescore(ext)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "1 file(s) written since it was (inputs/threat_space.json;" in proc.stdout
  (gate,) = files.read_json(str(ext / rundir.SCORECARD_JSON))["gates"]
  assert gate["decision"] == "INSUFFICIENT_EVIDENCE"
  assert "PASS withheld: fitting attack(s) unmeasured: probe_fit (not run)" in gate["reasons"]
  assert rundir.verify(str(ext)) == []
  raw = (ext / rundir.SCORECARD_JSON).read_bytes()
  assert scorecard.to_bytes(scorecard.build_from_inputs(
      str(ext), json.loads(raw)["inputs"])) == raw


def test_scoring_refuses_an_unlogged_threat_space(study):
  root, run, _, _ = study
  bad = root / "tampered"
  shutil.copytree(run, bad)
  doc = files.read_json(str(bad / threat_space.FILE))
  doc["modules"] = [m for m in doc["modules"] if m["name"] != "projection_adaptive"]
  (bad / threat_space.FILE).write_bytes(files.canonical_json(doc))
  with pytest.raises(ValueError, match="threat_space.json: sha256 differs"):
    scorecard.build(str(bad))
  with pytest.raises(ValueError, match="threat_space.json: sha256 differs"):
    scorecard.build_from_inputs(str(bad), files.read_json(str(bad / "scorecard.json"))["inputs"])


def test_record_merges_and_keeps_modules_no_longer_registered(tmp_path):
  run = tmp_path / "run"
  rundir.create(str(run), {"T": "x"})
  a1 = {"name": "a", "family": "f", "observations": ["activations"], "source": {"sha256": "1"}}
  a2 = dict(a1, source={"sha256": "2"})
  b = {"name": "b", "family": "f", "observations": ["gradients"]}
  assert threat_space.record(str(run), [a1, b])
  assert threat_space.record(str(run), [a2])
  assert threat_space.read(str(run)).modules == [a2, b]
  assert threat_space.compare([a1, b], [a2, {"name": "c"}]) == {
      "added": ["c"], "removed": ["b"], "changed": {"a": ["source"]}}
  with pytest.raises(ValueError, match="listed twice: a"):
    threat_space.normalize([a1, a2])
  assert rundir.check_against_log(str(run)) == []


def test_a_file_written_but_not_logged_is_logged_by_the_next_writer(tmp_path, data_dir):
  """A writer stopped between writing the threat space (or the pinned tokenizer) and
  logging it: the next one writes the same bytes again and logs them."""
  run = tmp_path / "run"
  rundir.create(str(run), {"T": "x"})
  entry = {"name": "a", "family": "f", "observations": ["activations"]}
  (run / "inputs").mkdir()
  (run / threat_space.FILE).write_bytes(threat_space.to_bytes([entry]))
  assert rundir.check_against_log(str(run)) == [
      f"{threat_space.FILE}: not in log.jsonl (written outside the run's logged writers)"]
  assert threat_space.record(str(run), [entry])
  assert not threat_space.record(str(run), [entry])
  tokenizer = load_tokenizer(data_dir)
  (run / scorecard.TOKENIZER_FILE).write_text(tokenizer.backend.to_str())
  assert scorecard.pinned_tokenizer(str(run)).sha256 == tokenizer.sha256
  scorecard.pin_tokenizer(str(run), tokenizer)
  assert rundir.check_against_log(str(run)) == []
  assert rundir.logged_files(str(run))[scorecard.TOKENIZER_FILE][0] == tokenizer.sha256


def test_rescore_errors_are_one_line(study, tmp_path):
  _, run, _, _ = study
  for flags, message in (
      ((f"--workdir={tmp_path / 'nothing'}",), "not a run directory"),
      ((f"--workdir={run}", "--against=yesterday"), "the only comparison is 'current'"),
      ((f"--workdir={run}", "--plugins=no_such_plugin_module"),
       "plugin 'no_such_plugin_module' could not be imported")):
    proc = subprocess.run([sys.executable, "-m", "experiments.rescore", *flags],
                          capture_output=True, text=True, cwd=REPO, timeout=300,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode != 0
    assert message in proc.stderr.strip().splitlines()[-1], proc.stderr
    assert "Traceback" not in proc.stderr
  # A first scoring of a study that pins no tokenizer, with no data directory: token
  # metrics (3 of the 32 tokens of each document, as the run was made), text metrics marked
  # unavailable with the reason, never GPT-2's tokenizer; rescored byte for byte.
  fresh = tmp_path / "fresh"
  syn.make_capture(str(tmp_path / "cap"), syn.truth_tokens(docs=4))
  syn.make_run(str(fresh), str(tmp_path / "cap"), [syn.Spec("activation", "b", 3)],
               policy_lib.load_policy().sha256)
  proc = rescore(fresh)
  assert proc.returncode == 0, proc.stderr[-3000:]
  card = files.read_json(str(fresh / rundir.SCORECARD_JSON))
  (row,) = card["rows"]
  assert row["metrics"]["token_recovery"] == 3 / 32 and row["metrics"]["n"] == 4 * 32
  assert row["similarity"]["rouge_l_text"] is None
  assert card["similarity_note"] == scorecard.NO_PINNED_TOKENIZER
  assert card["inputs"]["tokenizer_sha256"] is None
  assert not (fresh / scorecard.TOKENIZER_FILE).exists()
  proc = rescore(fresh)
  assert proc.returncode == 0 and "reproduced byte for byte" in proc.stdout, proc.stderr
