"""Replay: determinism, resume, crashes, chunking, sharding and refusal of bad inputs.

A tiny random GPT-2 (V = 512, d = 32, 3 layers, k = 2) is captured once (training and
inference captures of 10 documents x 8 tokens) and replayed through `lla.replay.driver`
(and once through the experiments/replay.py binary). Predictions are compared byte for
byte across run directories: twice in a row, after a resume, with a memory budget that
forces one document per chunk or ragged chunks of 3, and, in a subprocess, sharded over
8 forced host devices.
"""

import dataclasses
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import ml_collections
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from lla.attacks.seed import beam_attacks
from lla.attacks import registry
from lla.replay import driver as replay
from lla.attacks.registry import relevant_budget as relevant
from lla.attacks.workspace import Workspace
from lla.capture import capture, store
from lla.evidence import files, manifest, rundir
from lla.model import hf_io
from lla.model.gpt2 import GPT2Config

from test_attacks_units import random_params

REPO = pathlib.Path(__file__).resolve().parent.parent
CFG = GPT2Config(vocab_size=512, n_positions=16, n_embd=32, n_head=4, n_layer=3)
K, B, T = 2, 10, 8
ATTACKS = ["ridge", "activation", "joint", "shuffled_gradients", "random_candidates",
           "gradient_only"]
# Every stage (ridge, activation candidates, gradient ranking, random fill, beam search).
STAGES = ["activation", "joint", "random_candidates"]


def make_attacker(params, cfg, cal, hf_dir, knowledge="public"):
  """replay.Attacker, with `source` where this version of it has that field."""
  fields = {f.name for f in dataclasses.fields(replay.Attacker)}
  extra = {"source": {"hf_dir": str(hf_dir)}} if "source" in fields else {}
  return replay.Attacker(params, cfg, "tiny", cal, knowledge, **extra)


def budget() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(candidates=8, beam_width=2, c_a=4, c_g=4,
                                        ridge_alpha=1e-3, shuffle_seed=17))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  root = tmp_path_factory.mktemp("replay")
  params = random_params(CFG, seed=3, std=0.05)
  hf_io.save_hf_dir(params, CFG, root / "hf")
  params, _ = hf_io.load_hf_dir(root / "hf")   # exactly what the binary will load
  rng = np.random.default_rng(3)
  tokens = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
  cal = rng.integers(0, CFG.vocab_size, (24, T)).astype(np.int32)
  np.save(root / "cal.npy", cal)
  for name, training in (("cap", True), ("cap_inference", False)):
    capture.capture_target(str(root / name), params, CFG, tokens, range(B), K, model_id="tiny",
                           training=training, batch_size=5)
  attacker = make_attacker(params, CFG, cal, root / "hf")
  return root, attacker, tokens


def run(root, attacker, name, attacks=ATTACKS, capture_dir="cap", **kw):
  return replay.replay(str(root / name), str(root / capture_dir), attacker, attacks,
                       relevant(budget(), attacks), seed=0, mesh=kw.pop("mesh", None), **kw)


def prediction_bytes(run_dir) -> dict[str, bytes]:
  pred = pathlib.Path(run_dir) / rundir.PREDICTIONS
  return {p.stem: p.read_bytes() for p in sorted(pred.glob("*.npy"))}


def tree_state(directory) -> dict[str, tuple[str, int]]:
  """relative path -> (sha256, mtime_ns) of every file."""
  out = {}
  for p in sorted(pathlib.Path(directory).rglob("*")):
    if p.is_file():
      out[str(p.relative_to(directory))] = (hashlib.sha256(p.read_bytes()).hexdigest(),
                                            p.stat().st_mtime_ns)
  return out


def log_events(run_dir) -> list[dict]:
  return [e["event"] for e in rundir.log(str(run_dir)).entries()]


@pytest.fixture(scope="module")
def reference_run(setup):
  root, attacker, tokens = setup
  records = run(root, attacker, "run_a")
  return root / "run_a", records


def test_replay_twice_is_bit_identical(setup, reference_run):
  root, attacker, tokens = setup
  run_a, records_a = reference_run
  records_b = run(root, attacker, "run_b")
  assert [r.status for r in records_a] == ["ok"] * len(ATTACKS)
  a, b = prediction_bytes(run_a), prediction_bytes(root / "run_b")
  assert sorted(a) == sorted(ATTACKS) and a == b
  assert [r.prediction_sha256 for r in records_a] == [r.prediction_sha256 for r in records_b]
  for r in records_a:
    assert r.prediction_sha256 == files.sha256_file(str(run_a / r.prediction_file))
  # The attacks do something on this capture: activation-only recovers most tokens.
  act = np.load(run_a / "predictions" / "activation.npy")
  assert act.shape == (B, T) and np.mean(act == tokens) > 0.5
  # Before finalize only the (unwritten) manifest and unsealed log are flagged.
  problems = rundir.verify(str(run_a), check_capture=True)
  assert not [p for p in problems if "predictions/" in p or "record" in p or "capture" in p]


def test_resume_reuses_finished_attacks(setup, reference_run, tmp_path):
  root, attacker, _ = setup
  run_dir = tmp_path / "run"
  shutil.copytree(reference_run[0], run_dir)
  before = tree_state(run_dir)
  joint_bytes = (run_dir / "predictions" / "joint.npy").read_bytes()
  (run_dir / "records" / "joint.json").unlink()
  (run_dir / "predictions" / "joint.npy").unlink()
  events_before = len(log_events(run_dir))
  records = replay.replay(str(run_dir), str(root / "cap"), attacker, ATTACKS, budget(), seed=0,
                          mesh=None)
  assert [r.status for r in records] == ["ok"] * len(ATTACKS)
  new = log_events(run_dir)[events_before:]
  assert [(e["type"], e["file"]) for e in new] == [("predictions", "predictions/joint.npy"),
                                                    ("record", "records/joint.json")]
  after = tree_state(run_dir)
  for path, state in before.items():
    if "joint" not in path and path != rundir.LOG:
      assert after[path] == state, f"{path} was rewritten"
  assert (run_dir / "predictions" / "joint.npy").read_bytes() == joint_bytes
  # An orphaned prediction (record never written) is discarded, logged and recomputed.
  (run_dir / "records" / "ridge.json").unlink()
  replay.replay(str(run_dir), str(root / "cap"), attacker, ATTACKS, budget(), seed=0, mesh=None)
  types = [e["type"] for e in log_events(run_dir)[len(new) + events_before:]]
  assert types == ["discard_orphan", "predictions", "record"]
  # Changed predictions under a finished record: refuse to resume over them.
  np.save(run_dir / "predictions" / "activation.npy", np.zeros((B, T), np.int32))
  with pytest.raises(ValueError, match="predictions/activation.npy: predictions missing or changed"):
    replay.replay(str(run_dir), str(root / "cap"), attacker, ATTACKS, budget(), seed=0, mesh=None)


class _Boom:
  spec = registry.AttackSpec("boom_test", "test", ("activations",), budget_fields=())

  def __call__(self, ws, budget, key):
    raise RuntimeError("deliberate failure in boom_test")


class _Fixed:
  spec = _Boom.spec

  def __call__(self, ws, budget, key):
    return registry.AttackResult(np.zeros((ws.num_docs, ws.seq_len), np.int32), 1.0)


def test_crashed_module_is_recorded_and_retried(setup, tmp_path, monkeypatch):
  root, attacker, _ = setup
  registry.names()  # load the built-ins before patching
  monkeypatch.setitem(registry._REGISTRY, "boom_test", _Boom())
  run_dir = tmp_path / "run"
  records = replay.replay(str(run_dir), str(root / "cap"), attacker, ["ridge", "boom_test"],
                          relevant(budget(), ["ridge"]), seed=0, mesh=None)
  assert [r.status for r in records] == ["ok", "crashed"]
  assert records[1].error == "RuntimeError: deliberate failure in boom_test"
  assert records[1].prediction_file is None and not (run_dir / "predictions" / "boom_test.npy").exists()
  ridge_state = tree_state(run_dir)["predictions/ridge.npy"]
  monkeypatch.setitem(registry._REGISTRY, "boom_test", _Fixed())
  records = replay.replay(str(run_dir), str(root / "cap"), attacker, ["ridge", "boom_test"],
                          relevant(budget(), ["ridge"]), seed=0, mesh=None)
  assert [r.status for r in records] == ["ok", "ok"]
  assert tree_state(run_dir)["predictions/ridge.npy"] == ridge_state
  retries = [e for e in log_events(run_dir) if e["type"] == "retry"]
  assert retries == [{"type": "retry", "attack": "boom_test", "file": "records/boom_test.json",
                      "previous_status": "crashed"}]
  monkeypatch.delitem(registry._REGISTRY, "boom_test")
  assert "boom_test" not in registry.names()


def test_chunking_invariance(setup, reference_run):
  root, attacker, _ = setup
  run_a, _ = reference_run
  ws = Workspace(np.zeros((B, T, CFG.n_embd), np.float32), None, attacker.params, CFG, K,
                 attacker.calibration_tokens)
  ragged = int(3.5 * beam_attacks.beam_bytes_per_doc(ws, 2, 8))  # beam chunks 3, 3, 3, 1+pad
  for name, mem in (("run_chunk1", 1), ("run_chunk3", ragged)):
    run(root, attacker, name, attacks=STAGES, memory_budget_bytes=mem)
    reference = {k: v for k, v in prediction_bytes(run_a).items() if k in STAGES}
    assert prediction_bytes(root / name) == reference, name


def test_replay_on_the_scanned_layers_equals_the_unrolled_one(setup, reference_run):
  """The layer form is how the model runs, not what it computes: the same predictions as
  the reference run (CPU's "auto" unrolls), with the same FLOPs charged."""
  root, attacker, _ = setup
  run_a, records_a = reference_run
  records = run(root, attacker, "run_scanned", attacks=STAGES, layer_form="scanned")
  reference = {k: v for k, v in prediction_bytes(run_a).items() if k in STAGES}
  assert prediction_bytes(root / "run_scanned") == reference
  flops = {r.attack: r.flops for r in records_a}
  for r in records:
    assert r.flops == pytest.approx(flops[r.attack], rel=5e-3), r.attack


_SHARDED = textwrap.dedent("""
    import sys, jax, ml_collections, numpy as np
    from lla.replay import driver as replay
    from lla.attacks.registry import relevant_budget as relevant
    from lla.model import hf_io
    from test_attacks_replay import make_attacker
    root, attacks = sys.argv[1], sys.argv[2].split(",")
    assert jax.device_count() == 8, jax.devices()
    params, cfg = hf_io.load_hf_dir(root + "/hf")
    attacker = make_attacker(params, cfg, np.load(root + "/cal.npy"), root + "/hf")
    budget = dict(candidates=8, beam_width=2, c_a=4, c_g=4, ridge_alpha=1e-3, shuffle_seed=17)
    replay.replay(root + "/run_sharded", root + "/cap", attacker, attacks,
                  relevant(budget, attacks), seed=0, mesh="auto")
    print("sharded over", jax.device_count())
""")


def test_sharded_replay_matches_single_device(setup, reference_run):
  root, _, _ = setup
  run_a, _ = reference_run
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu", PYTHONPATH=f"{REPO}:{REPO / 'tests'}")
  proc = subprocess.run([sys.executable, "-c", _SHARDED, str(root), ",".join(STAGES)],
                        capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "sharded over 8" in proc.stdout
  reference = {k: v for k, v in prediction_bytes(run_a).items() if k in STAGES}
  assert prediction_bytes(root / "run_sharded") == reference


def _replay_binary(root, capture_dir, workdir, attacks, *extra, env=None, test_budget=True):
  cmd = [sys.executable, "-m", "experiments.replay", "--config=configs/replay.py",
         f"--config.capture_dir={capture_dir}", f"--config.attacker.hf_dir={root / 'hf'}",
         f"--config.calibration.tokens_npy={root / 'cal.npy'}", f"--config.attacks={attacks}",
         *(f"--config.budget.{k}={v}" for k, v in relevant(budget(), [
             a for a in attacks.split(",") if a in registry.names()]).items() if test_budget),
         f"--workdir={workdir}", *extra]
  return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300,
                        env=dict(os.environ, JAX_PLATFORMS="cpu", **(env or {})))


def _binary(module, *args):
  return subprocess.run([sys.executable, "-m", f"experiments.{module}", *args],
                        capture_output=True, text=True, cwd=REPO, timeout=300,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))


_BOOM_PLUGIN = textwrap.dedent("""
    from lla.attacks import registry

    class Boom:
      spec = registry.AttackSpec("boom_plugin", "test", ("activations",))

      def __call__(self, ws, budget, key):
        raise RuntimeError("deliberate failure inside boom_plugin")

    registry.register(Boom())
""")


def test_replay_binary_seals_its_run_and_a_later_replay_extends_it(setup, tmp_path):
  """README flow: replay -> verify -> rescore, then a second replay adds attacks (one of
  which crashes: non-zero exit, the rest kept) and the run verifies again. The budget is
  the default one throughout: E covers every budget field, so extending a run keeps it."""
  root, _, _ = setup
  workdir = tmp_path / "run"
  proc = _replay_binary(root, root / "cap", workdir, "ridge", test_budget=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  proc = _binary("verify", f"--workdir={workdir}")
  assert proc.returncode == 0 and f"OK {workdir}: every hash verifies" in proc.stdout, proc.stdout
  proc = _binary("rescore", f"--workdir={workdir}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert rundir.verify(str(workdir)) == []

  plugins = tmp_path / "plugins"
  plugins.mkdir()
  (plugins / "lla_boom_plugin.py").write_text(_BOOM_PLUGIN)
  proc = _replay_binary(root, root / "cap", workdir, "gradient_only,boom_plugin",
                        "--config.plugins=lla_boom_plugin", test_budget=False,
                        env={"PYTHONPATH": f"{REPO}:{plugins}"})
  assert proc.returncode != 0
  assert "1 attack(s) crashed (recorded as unmeasured, the rest kept): boom_plugin" in proc.stderr
  assert files.read_json(str(workdir / "records" / "gradient_only.json"))["status"] == "ok"
  assert files.read_json(str(workdir / "records" / "boom_plugin.json"))["error"] == (
      "RuntimeError: deliberate failure inside boom_plugin")
  assert rundir.verify(str(workdir)) == []
  kinds = [e["type"] for e in log_events(workdir)]
  assert kinds.count("seal") == 3 and kinds.count("reopen") == 2 and kinds[-1] == "seal"
  # The scorecard predates the new records and the threat space the second replay recorded
  # (its registry held the plugin): rescore rebuilds it (and reseals the run).
  proc = _binary("rescore", f"--workdir={workdir}")
  assert proc.returncode == 0 and ("4 file(s) written since it was (inputs/threat_space.json, "
                                   "predictions/gradient_only.npy, records/boom_plugin.json, "
                                   "...;") in proc.stdout, proc.stdout + proc.stderr[-2000:]
  card = files.read_json(str(workdir / rundir.SCORECARD_JSON))
  # The plugin is not registered in the rescoring process, but the run's threat space holds
  # its module: the record is placed by it, in the family 'test' that the declared coverage
  # grid does not list.
  reason = "cell ('test', 'activations', 'public', 'none') not in the declared threat space"
  assert card["coverage"]["unplaced"] == [{"run_id": "boom_plugin", "reason": reason}]
  assert f"- boom_plugin: {reason}" in (workdir / rundir.SCORECARD_MD).read_text()
  assert "boom_plugin" in {m["name"] for m in card["inputs"]["modules"]}
  proc = _binary("verify", f"--workdir={workdir}")
  assert proc.returncode == 0, proc.stdout


def test_coverage_places_every_replayed_attack(reference_run):
  """score_run without `modules` takes the registry's entries: the undefended public
  capture's cells are measured (1 seed: partial), nothing is unplaced."""
  from configs import scoring as scoring_config  # pylint: disable=g-import-not-at-top
  from lla.scoring import scorecard  # pylint: disable=g-import-not-at-top
  run_dir = reference_run[0].parent / "run_coverage"  # beside the capture it names
  shutil.copytree(reference_run[0], run_dir)
  card = scorecard.score_run(str(run_dir), scoring_config.get_config())
  status = {(c["family"], c["observation"]): (c["status"], c["reason"])
            for c in card["coverage"]["cells"]
            if c["knowledge"] == "public" and c["defense"] == "none"}
  partial = ("partial", "1 seed(s) < 3")
  assert status[("beam_inversion", "activations")] == partial       # activation, random fill
  assert status[("beam_inversion", "activations+gradients")] == partial   # joint, shuffled
  assert status[("ridge", "activations")] == partial
  assert status[("gradient_heuristic", "gradients")] == partial
  assert status[("gradient_matching", "gradients")] == ("unmeasured", "no module was run")
  assert card["coverage"]["unplaced"] == []
  assert card["coverage"]["counts"]["unmeasured"] < card["coverage"]["in_scope"]


def test_records_carry_what_jax_compiled_while_their_attack_ran(setup, reference_run):
  """Each record's jax_compile (lla.runtime.compile_meter): its parts add up, its
  compile seconds lie within its wall time; the first replay compiles, a second of the
  same attacks in the same process compiles nothing (every executable is held)."""
  root, attacker, _ = setup
  _, records = reference_run
  for r in records:
    spent = r.jax_compile
    assert spent["seconds"] == spent["trace_s"] + spent["lower_s"] + spent["backend_s"]
    assert spent["compiled"] == spent["executables"] - spent["cache_hits"]
    assert 0 <= spent["seconds"] <= spent["wall_s"]
    np.testing.assert_allclose(spent["run_s"], spent["wall_s"] - spent["seconds"])
  assert sum(r.jax_compile["executables"] for r in records) > 0
  again = run(root, attacker, "run_compiled", attacks=["ridge", "activation"])
  assert [r.jax_compile["executables"] for r in again] == [0, 0]


def test_replay_binary_bad_inputs_are_one_line_errors(setup, reference_run, tmp_path):
  """Each bad value: one line naming the field and its allowed range, non-zero exit, and
  the run directory exactly as it was."""
  root, attacker, _ = setup
  workdir = tmp_path / "run"
  shutil.copytree(reference_run[0], workdir)
  rundir.finalize(str(workdir))
  before = tree_state(workdir)
  cal = attacker.calibration_tokens.copy()
  for name, value in (("cal_high.npy", CFG.vocab_size), ("cal_negative.npy", -3)):
    bad = cal.copy()
    bad[2, 5] = value
    np.save(tmp_path / name, bad)
  range_ids = f"error: calibration token ids must lie in [0, {CFG.vocab_size}), got ["
  cases = [  # (flags, the line's start, its end)
      (("--config.budget.beam_width=-1",), "error: budget field beam_width=-1 is not allowed: "
       "expected [1, vocab_size] (int)", ""),
      (("--config.budget.candidates=0",), "error: budget field candidates=0 is not allowed: "
       "expected [1, vocab_size] (int)", ""),
      ((f"--config.calibration.tokens_npy={tmp_path / 'cal_high.npy'}",), range_ids,
       f", {CFG.vocab_size}]"),
      ((f"--config.calibration.tokens_npy={tmp_path / 'cal_negative.npy'}",), range_ids + "-3, ",
       "]"),
      (("--config.layer_form=stacked",), "error: layer_form 'stacked': one of ('auto', "
       "'scanned', 'unrolled')", ""),
  ]
  for extra, start, end in cases:
    proc = _replay_binary(root, root / "cap", workdir, "activation", *extra)
    assert proc.returncode != 0, extra
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(start) and last.endswith(end), (extra, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
  assert tree_state(workdir) == before


def test_replay_binary_refuses_bad_inputs_and_keeps_the_run(setup, reference_run, tmp_path):
  root, _, _ = setup
  run_a, _ = reference_run
  workdir = tmp_path / "run"
  shutil.copytree(run_a, workdir)
  before = tree_state(workdir)
  truncated = tmp_path / "cap_truncated"
  shutil.copytree(root / "cap", truncated)
  data = (truncated / store.MESSAGES_FILE).read_bytes()
  (truncated / store.MESSAGES_FILE).write_bytes(data[:len(data) // 2])
  proc = _replay_binary(root, truncated, workdir, "activation")
  assert proc.returncode != 0
  assert "manifest check failed" in proc.stderr and "messages.safetensors" in proc.stderr
  proc = _replay_binary(root, root / "cap_inference", workdir, "activation,joint")
  assert proc.returncode != 0
  assert "'joint' needs gradients" in proc.stderr and "cap_inference" in proc.stderr
  assert tree_state(workdir) == before


def _corrupt(root, tmp_path, name, edit):
  """A copy of the training capture with `edit(dir)` applied and the manifest rewritten."""
  out = tmp_path / name
  shutil.copytree(root / "cap", out)
  edit(out)
  (out / manifest.MANIFEST_NAME).unlink()
  manifest.write_manifest(str(out))
  return out


def test_replay_refuses_bad_inputs_in_process(setup, reference_run, tmp_path):
  root, attacker, _ = setup
  run_a, _ = reference_run
  workdir = tmp_path / "run"
  shutil.copytree(run_a, workdir)
  before = tree_state(workdir)

  def nan_activations(d):
    m = load_file(str(d / store.MESSAGES_FILE))
    m["activations"][1, 2, 3] = np.nan
    (d / store.MESSAGES_FILE).unlink()
    save_file(m, str(d / store.MESSAGES_FILE))

  def short_gradients(d):
    m = load_file(str(d / store.MESSAGES_FILE))
    m["gradients"] = np.ascontiguousarray(m["gradients"][:, :-1])
    (d / store.MESSAGES_FILE).unlink()
    save_file(m, str(d / store.MESSAGES_FILE))

  cases = [
      (_corrupt(root, tmp_path, "nan", nan_activations), store.CaptureError,
       r"messages.safetensors: activations contain NaN or Inf \(1 values\)"),
      (_corrupt(root, tmp_path, "shape", short_gradients), store.CaptureError,
       r"messages.safetensors: gradients shape \(10, 7, 32\) != activations shape"),
  ]
  for capture_dir, error, message in cases:
    with pytest.raises(error, match=message):
      replay.replay(str(workdir), str(capture_dir), attacker, ["activation"],
                    relevant(budget(), ["activation"]), seed=0, mesh=None)
  with pytest.raises(registry.IncompatibleCaptureError, match="'gradient_only' needs gradients"):
    run(root, attacker, str(workdir), attacks=["gradient_only"], capture_dir="cap_inference")
  short_cal = make_attacker(attacker.params, CFG, attacker.calibration_tokens[:, :4],
                            root / "hf")
  with pytest.raises(ValueError, match="calibration documents have T=4, the capture has T=8"):
    run(root, short_cal, str(workdir), attacks=["activation"])
  other_budget = budget()
  other_budget.beam_width = 3
  with pytest.raises(ValueError, match=r"another protocol tuple \(differs in B.fields.beam_width"):
    replay.replay(str(workdir), str(root / "cap"), attacker, ATTACKS, other_budget,
                  seed=0, mesh=None)
  with pytest.raises(KeyError, match="no attack named 'nope'"):
    run(root, attacker, str(workdir), attacks=["nope"])
  assert tree_state(workdir) == before


def test_regenerate_names_provenance_differences(setup, tmp_path):
  """A record made under another stack: the verdict stands, and every difference is named."""
  root, attacker, _ = setup
  from lla.model import loading  # pylint: disable=g-import-not-at-top
  # The id regeneration finds on reloading the pinned weights: params, config, tokenizer.
  attacker = dataclasses.replace(attacker, model_id=loading.load_model(attacker.source).model_id)
  run_dir = root / "run_provenance"
  run(root, attacker, "run_provenance", attacks=["ridge"])
  path = run_dir / "records" / "ridge.json"
  record = files.read_json(str(path))
  record["provenance"].update(jax_version="0.4.30", xla_flags="--xla_cpu_enable_fast_math=true")
  record["provenance"]["jax_config"]["jax_default_matmul_precision"] = "bfloat16"
  del record["provenance"]["jaxlib_version"]
  record["attack_revision"] = 2  # made by a later ridge than this checkout's (revision 1)
  path.unlink()
  files.atomic_write_json(str(path), record)
  proc = _binary("regenerate", f"--workdir={run_dir}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  lines = proc.stdout.splitlines()
  import jax  # pylint: disable=g-import-not-at-top
  import jaxlib  # pylint: disable=g-import-not-at-top
  assert [l for l in lines if l.startswith("PROVENANCE ")] == [
      "PROVENANCE jax_config.jax_default_matmul_precision: recorded 'bfloat16', now None "
      "(first in record 'ridge')",
      f"PROVENANCE jax_version: recorded '0.4.30', now '{jax.__version__}' (first in record "
      "'ridge')",
      f"PROVENANCE jaxlib_version: not recorded, now '{jaxlib.__version__}' (first in record "
      "'ridge')",
      "PROVENANCE ridge revision: recorded 2, now 1 (first in record 'ridge')",
      "PROVENANCE xla_flags: recorded '--xla_cpu_enable_fast_math=true', now '' (first in "
      "record 'ridge')"]
  assert lines[-1] == (f"OK {run_dir}: every prediction regenerated bit for bit; 5 provenance "
                       "difference(s) listed above")


def test_replay_into_a_run_of_other_inputs_is_refused_naming_them(setup, reference_run,
                                                                  tmp_path):
  """Other calibration tokens of the same shape, other attacker weights, another capture:
  each differs in the E component that covers it, and nothing is written."""
  root, attacker, _ = setup
  workdir = tmp_path / "run"
  shutil.copytree(reference_run[0], workdir)
  before = tree_state(workdir)
  other_cal = dataclasses.replace(attacker,
                                  calibration_tokens=attacker.calibration_tokens[::-1].copy())
  other_weights = dataclasses.replace(attacker, model_id="f" * 64)

  def other_session(d):
    metadata = files.read_json(str(d / store.METADATA_FILE))
    files.atomic_write_json(str(d / store.METADATA_FILE), dict(metadata, session_id="other"),
                            overwrite=True)
  other_capture = _corrupt(root, tmp_path, "cap_other_session", other_session)
  cases = [(other_cal, root / "cap", r"another protocol tuple \(differs in K.calibration_sha256\)"),
           (other_weights, root / "cap", r"another protocol tuple \(differs in K.weights_sha256\)"),
           (attacker, other_capture, r"ridge.json was made from another capture \(../cap\)")]
  for who, capture_dir, message in cases:
    with pytest.raises(replay.ReplayInputError, match=message):
      replay.replay(str(workdir), str(capture_dir), who, ATTACKS, budget(), seed=0, mesh=None)
  assert tree_state(workdir) == before


def test_a_record_of_another_attack_revision_is_not_reused(setup, reference_run, tmp_path):
  """Records carry the revision of the attack that made them; a finished record that
  another revision made (here a later one than this checkout's) is refused, not reused."""
  root, attacker, _ = setup
  workdir = tmp_path / "run"
  shutil.copytree(reference_run[0], workdir)
  path = workdir / "records" / "ridge.json"
  record = files.read_json(str(path))
  assert record["attack_revision"] == registry.get("ridge").spec.revision == 1
  files.atomic_write_json(str(path), dict(record, attack_revision=2), overwrite=True)
  before = tree_state(workdir)
  with pytest.raises(replay.ReplayInputError,
                     match=r"ridge.json was made by ridge revision 2, the registered ridge is "
                     r"revision 1; refusing to reuse it"):
    replay.replay(str(workdir), str(root / "cap"), attacker, ATTACKS, budget(), seed=0,
                  mesh=None)
  assert tree_state(workdir) == before
