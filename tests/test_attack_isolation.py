"""Attacks receive arrays and metadata only: no ground truth, document ids, paths or secrets.

A defended training capture of a tiny random GPT-2 is written with distinctive document ids
and an attack-side file, its secret held in a defender's key store beside the study. The
plugin attack of tests/isolation_probe.py, loaded by the replay CLI like any plugin, walks
everything the attack API hands it (the Workspace recursively, the budget view, the key)
and must find none of them. The same walk, given the replay driver's own objects (its
checked plan and capture), the ground truth or the key store, finds each: the probe can
fail.
"""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import ml_collections
import numpy as np
import pytest
from absl import flags
from ml_collections import config_flags

from lla import defenses
from lla.attacks import withheld
from lla.capture import capture, store
from lla.defenses import training as defended
from lla.evidence import rundir
from lla.model import hf_io
from lla.model.gpt2 import GPT2Config
from lla.replay import driver as replay
from lla.scoring import policy as policy_lib
from lla.study import defense_sweep

import isolation_probe
from lla.attacks import registry
from test_attacks_units import random_params

# Importing the probe registers it (that is how the replay CLI loads it as a plugin); in this
# process only its functions are used, so the session's registry keeps the built-ins alone.
registry._REGISTRY.pop("isolation_probe", None)  # pylint: disable=protected-access

REPO = pathlib.Path(__file__).resolve().parent.parent
TESTS = pathlib.Path(__file__).resolve().parent
CFG = GPT2Config(vocab_size=256, n_positions=16, n_embd=32, n_head=4, n_layer=3)
K, B, T = 2, 6, 8
# Distinctive: no array or integer of the attack API holds them by chance.
DOC_IDS = [7_340_033 + 7919 * i for i in range(B)]
EXTRA = "attack_side.bin"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  root = tmp_path_factory.mktemp("isolation")
  params = random_params(CFG, seed=11, std=0.05)
  hf_io.save_hf_dir(params, CFG, root / "hf")
  params, _ = hf_io.load_hf_dir(root / "hf")
  rng = np.random.default_rng(11)
  tokens = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
  np.save(root / "cal.npy", rng.integers(0, CFG.vocab_size, (12, T)).astype(np.int32))
  keys = defense_sweep.KeyStore(root / "defender" / "secrets.json")
  secret = keys.secret("gaussian/m0")
  defense = defenses.make("gaussian", sigma=0.01)
  cap = root / "captures" / "def_m0"
  capture.capture_target(
      str(cap), params, CFG, tokens, DOC_IDS, K, model_id="tiny", training=True, batch_size=3,
      messages=defended.batched_messages(params, CFG, tokens, K, defense, secret, 3, True),
      defense="gaussian", defense_params={**defense.params(), "secret_source": secret.source},
      defense_seed_sha256=secret.sha256,
      extra_files={EXTRA: b"attack-side bytes stored with the capture"})
  pol = policy_lib.load_policy()
  study = root / "study"
  rundir.create_study(str(study), {"G": {"policy": pol.policy_id, "policy_sha256": pol.sha256}})
  targets = isolation_probe.Targets(
      tokens, tuple(DOC_IDS), (str(cap), str(study), str(root / "defender" / "secrets.json"),
                               str(root / "defender"), str(root)), secret.reveal())
  (root / "targets.json").write_text(json.dumps(targets.to_json()))
  return root, cap, study, targets


def test_probe_finds_nothing_through_the_attack_api(setup):
  root, cap, study, _ = setup
  cmd = [sys.executable, "-m", "experiments.replay", "--config=configs/replay.py",
         f"--config.capture_dir={cap}", f"--config.attacker.hf_dir={root / 'hf'}",
         f"--config.calibration.tokens_npy={root / 'cal.npy'}",
         "--config.plugins=isolation_probe", "--config.attacks=isolation_probe",
         f"--workdir={study}"]
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(REPO), str(TESTS)]),
             **{isolation_probe.ENV: str(root / "targets.json")})
  proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  record, = rundir.load_records(str(study))
  assert record.status == "ok", record.error
  report = record.details
  assert report["found"] == []
  # It walked the command line, which names the capture and the study (--config.capture_dir,
  # --workdir) while the binary runs: withheld inside the attack's scope.
  assert report["argv_length"] == len(cmd) - 2  # (python -m: the module stands for both)
  assert {"config", "config.capture_dir", "workdir"} <= set(report["flags"])
  # It walked the whole workspace (every field, the messages and the model's arrays) ...
  assert {"activations", "gradients", "params", "calibration_tokens", "capture_files",
          "capture_info", "defense"} <= set(report["workspace_fields"])
  assert "capture_dir" not in report["workspace_fields"]
  assert report["arrays"] > 10 and report["visited"] > 100
  # ... and the attack-side file stored with the capture reached it (no path needed).
  assert report["capture_files"] == [EXTRA]


def test_the_probe_finds_them_in_the_drivers_objects(setup):
  root, cap, study, targets = setup
  params, cfg = hf_io.load_hf_dir(root / "hf")
  attacker = replay.Attacker(params, cfg, "tiny", np.load(root / "cal.npy"), "public",
                             {"hf_dir": str(root / "hf")})
  plan = replay.prepare(str(cap), attacker, ["activation"], {}, 0)
  # The driver's plan holds the capture's directory and metadata (document ids): found.
  found = isolation_probe.probe(plan, targets)["found"]
  assert any(f.startswith(f"path {str(cap)!r}") for f in found), found
  assert any(f.startswith("document id") for f in found), found
  # The ground truth and the defender's key store: found.
  assert "truth array at api" in isolation_probe.probe(store.load_truth(str(cap)), targets)["found"]
  raw = (cap / store.TRUTH_FILE).read_bytes()
  assert "truth bytes in api" in isolation_probe.probe(raw, targets)["found"]
  keys = defense_sweep.KeyStore(root / "defender" / "secrets.json")
  found = isolation_probe.probe(keys, targets)["found"]
  assert any(f.startswith("secret") for f in found) and any("secrets.json" in f for f in found)
  # The same plan's workspace, the attack's whole view: nothing; a workspace that carried
  # the capture's directory (as it once did) or its document ids: found.
  ws = plan.workspace(1 << 26, None)
  assert isolation_probe.probe({"workspace": ws}, targets)["found"] == []
  assert ws.knowledge == "public"  # the attacker's E.K, which an attack may read
  with pytest.raises(ValueError, match="knowledge 'exact'"):
    dataclasses.replace(ws, knowledge="exact")
  assert dataclasses.replace(ws, knowledge="none").knowledge == "none"  # an active server's
  leaky = dataclasses.replace(ws, capture_info={"directory": str(cap)})
  assert (f"path {str(cap)!r} in api['workspace'].capture_info['directory']"
          in isolation_probe.probe({"workspace": leaky}, targets)["found"])
  leaky = dataclasses.replace(ws, capture_info={"ids": list(DOC_IDS)})
  assert isolation_probe.probe({"workspace": leaky}, targets)["found"]
  # Module globals: the run directory's lock held (as while a replay runs an attack) is
  # not found; a module global naming the study is.
  with rundir.locked(str(study)):
    assert isolation_probe.probe(isolation_probe.module_globals(), targets,
                                 bare_name=False)["found"] == []
    from lla.evidence import hashlog  # pylint: disable=g-import-not-at-top
    hashlog.LEAKED_FOR_THE_TEST = str(study)
    try:
      found = isolation_probe.probe(isolation_probe.module_globals(), targets,
                                    bare_name=False)["found"]
    finally:
      del hashlog.LEAKED_FOR_THE_TEST
    assert (f"path {str(study)!r} in api['lla.evidence.hashlog']['LEAKED_FOR_THE_TEST']"
            in found), found


def test_the_command_line_is_withheld_inside_an_attacks_scope(setup, monkeypatch):
  """sys.argv and absl's flags (a config flag's ConfigDict and its overrides, a string
  flag) naming the capture and the study: the probe finds each outside an attack's scope,
  nothing inside it, and every original object is back after it."""
  root, cap, study, targets = setup
  argv = ["replay", f"--config.capture_dir={cap}", f"--workdir={study}", "--lock_wait_s=0"]
  monkeypatch.setattr(sys, "argv", list(argv))
  config = ml_collections.ConfigDict({"capture_dir": str(cap), "attacks": ("activation",),
                                      "nested": {"paths": [str(cap), "kept"]}})
  config_flags.DEFINE_config_dict("isolation_test_config", config)
  flags.DEFINE_string("isolation_test_workdir", str(study), "the study")
  try:
    found = isolation_probe.probe(isolation_probe.command_line(), targets,
                                  bare_name=False)["found"]
    assert any("['sys.argv'][1]" in f and str(cap) in f for f in found), found
    assert any("['sys.argv'][2]" in f and str(study) in f for f in found), found
    assert any("['isolation_test_config']" in f and str(cap) in f for f in found), found
    assert any("['isolation_test_workdir']" in f and str(study) in f for f in found), found
    params, cfg = hf_io.load_hf_dir(root / "hf")
    attacker = replay.Attacker(params, cfg, "tiny", np.load(root / "cal.npy"), "public",
                               {"hf_dir": str(root / "hf")})
    ws = replay.prepare(str(cap), attacker, ["activation"], {}, 0).workspace(1 << 26, None)
    with ws.attack_scope("probe"):
      assert isolation_probe.probe(isolation_probe.command_line(), targets,
                                   bare_name=False)["found"] == []
      assert sys.argv[1:3] == [withheld.WITHHELD] * 2 and sys.argv[3] == "--lock_wait_s=0"
      assert config.attacks == ("activation",) and config.nested.paths[1] == "kept"
    assert sys.argv == argv
    assert flags.FLAGS["isolation_test_config"].value is config
    assert config.capture_dir == str(cap) and config.nested.paths == [str(cap), "kept"]
    assert flags.FLAGS["isolation_test_workdir"].value == str(study)
  finally:
    delattr(flags.FLAGS, "isolation_test_config")
    delattr(flags.FLAGS, "isolation_test_workdir")
