"""experiments/bench_attacks.py end to end on a tiny random GPT-2: recovery and cold starts.

The binary runs each attack in process (cold, then warm) and in two fresh processes of
itself sharing one persistent compilation cache directory (empty for the first). Checked:
  * determinism across processes: the three runs predict the same tokens (same sha256);
  * its recovery columns against the test's own run: the capture rebuilt here (the
    binary's seeded random model and tokens), each attack run in this process through the
    replay API (`lla.replay.driver.execute`), its predictions hashed and scored with numpy.
    A weak budget (2 calibration documents, 2 candidates) keeps the activation-only
    attack's recovery partial, so the scores discriminate;
  * the compilation cache on disk: the test runs the binary's cold-start probe itself on a
    cache directory of its own, counts the files the first process left there and checks
    that the second process, which compiles less, adds none;
  * the printed table carries the JSON's figures.
"""

import hashlib
import json
import os
from pathlib import Path
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from lla.attacks import budget as budget_lib
from lla.attacks import registry
from lla.attacks.workspace import Workspace
from lla.model import checkpoint, split
from lla.model.gpt2 import GPT2Config, random_params
from lla.replay import driver

ROOT = Path(__file__).resolve().parent.parent
ATTACKS = ("activation", "joint")
CFG = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=101)
CUT, DOCS, SEQ_LEN, CALIBRATION, SEED = 1, 2, 8, 2, 0
BUDGET = {"candidates": 2, "c_a": 1, "c_g": 1}


@pytest.fixture(scope="module")
def bench(tmp_path_factory) -> dict:
  out = tmp_path_factory.mktemp("bench") / "bench.json"
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.bench_attacks",
       "--random_config=n_embd=32,n_layer=2,n_head=2,vocab_size=101", f"--cut={CUT}",
       f"--batch={DOCS}", f"--seq_len={SEQ_LEN}", f"--capture_batch={DOCS}",
       f"--calibration={CALIBRATION}", f"--seed={SEED}", f"--attacks={','.join(ATTACKS)}",
       "--budget=" + ",".join(f"{k}={v}" for k, v in BUDGET.items()),
       "--captures=training", "--torch_batch=0", "--torch_nocache_batch=0", "--matmul_n=64",
       "--cold_start=true", "--device=cpu", f"--out_json={out}"],
      cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": ""}, capture_output=True, text=True,
      timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return {"json": json.loads(out.read_text()), "stdout": proc.stdout}


@pytest.fixture(scope="module")
def capture():
  """The binary's capture, rebuilt here: its seeded random model, tokens and calibration
  (drawn in that order from default_rng(seed)) and the boundary messages of one batch."""
  rng = np.random.default_rng(SEED)
  tokens = rng.integers(0, CFG.vocab_size, (DOCS, SEQ_LEN)).astype(np.int32)
  calibration = rng.integers(0, CFG.vocab_size, (CALIBRATION, SEQ_LEN)).astype(np.int32)
  params = random_params(CFG, SEED)
  h, g = split.boundary_messages(params, CFG, jnp.asarray(tokens), CUT)
  return {"params": params, "tokens": tokens, "calibration": calibration,
          "h": np.asarray(h), "g": np.asarray(g),
          "batch_docs": np.full(DOCS, DOCS, np.int32)}


def _sha256(predictions) -> str:
  return hashlib.sha256(np.ascontiguousarray(predictions, np.int32).tobytes()).hexdigest()


@pytest.mark.slow
def test_cold_start_columns(bench):
  result = bench["json"]
  assert result["config"]["device"]["platform"] == "cpu"
  assert result["config"]["cold_start_capture"] == "training"
  assert result["config"]["budget"] == BUDGET
  assert "accelerator" in result["kernel"]["skipped"]
  rows = result["lla"]["training"]
  assert sorted(rows) == sorted(ATTACKS)
  for name, row in rows.items():
    cold = row["cold_start"]
    first, second = cold["first"], cold["second"]
    assert row["warm_s"] > 0
    for run in (first, second):
      assert run["attack"] == name and run["capture"] == "training"
      assert 0 <= run["compile_s"] <= run["cold_s"] < run["process_s"]
      # Deterministic: both processes predict exactly what the in-process run did.
      assert run["predictions_sha256"] == row["predictions_sha256"]
      assert run["token_recovery"] == row["token_recovery"]
      assert run["exact_documents"] == row["exact_documents"]
    assert first["cache_entries_written"] > 0
    # The second process loads the first's executables instead of compiling them.
    assert second["compile_s"] < first["compile_s"]
    # JAX's own events say so too: every executable the second builds comes from the cache;
    # in-process, the warm run builds none.
    spent = second["jax_compile"]
    assert spent["cache_hits"] == spent["executables"] > 0 and spent["compiled"] == 0
    assert row["jax_compile"]["warm"]["executables"] == 0
  # The printed table carries the same figures.
  lines = bench["stdout"].splitlines()
  header = next(i for i, line in enumerate(lines) if line.startswith("attack") and "2nd cold s"
                in line)
  for i, name in enumerate(ATTACKS):
    fields = lines[header + 1 + i].split()
    first, second = rows[name]["cold_start"]["first"], rows[name]["cold_start"]["second"]
    assert fields[0] == name
    assert float(fields[1]) == pytest.approx(first["cold_s"], abs=0.006)
    assert float(fields[2]) == pytest.approx(second["cold_s"], abs=0.006)
    assert float(fields[3]) == pytest.approx(rows[name]["warm_s"], abs=0.006)
  assert "needs an accelerator" in bench["stdout"]


@pytest.mark.slow
def test_recovery_columns_equal_an_in_process_replay(bench, capture):
  rows = bench["json"]["lla"]["training"]
  registry.load_builtin()
  truth = capture["tokens"]
  recovered = {}
  for name in ATTACKS:
    ws = Workspace(capture["h"], capture["g"], capture["params"], CFG, CUT,
                   capture["calibration"], batch_docs=capture["batch_docs"])
    values = {**budget_lib.defaults(), **BUDGET}
    _, predictions, _, error, _ = driver.execute(ws, registry.get(name).spec, values, seed=0)
    assert error is None, error
    # The binary predicted exactly these tokens, in another process.
    assert _sha256(predictions) == rows[name]["predictions_sha256"], name
    hits = np.asarray(predictions) == truth
    assert rows[name]["token_recovery"] == pytest.approx(hits.sum() / hits.size, abs=1e-12)
    assert rows[name]["exact_documents"] == pytest.approx(
        sum(bool(doc.all()) for doc in hits) / len(hits), abs=1e-12)
    recovered[name] = hits.mean()
  # The weak budget leaves the activation-only attack short of full recovery, so the
  # scores above are not all 1 (or 0) by construction.
  assert 0 < recovered["activation"] < 1, recovered


def _cache_files(directory: Path) -> list[Path]:
  return sorted(p for p in directory.rglob("*") if p.is_file() and p.stat().st_size > 0)


@pytest.mark.slow
def test_cold_start_probe_fills_the_cache_on_disk(bench, capture, tmp_path):
  """The probe of the binary (--cold_probe) run here, twice, on a cache directory the
  test owns: the first process writes files; the second, compiling less, adds none."""
  name = "activation"
  row = bench["json"]["lla"]["training"][name]
  work = tmp_path / "probe"
  work.mkdir()
  checkpoint.save(str(work / "checkpoint"), capture["params"], CFG, export_hf=False)
  np.savez(work / "capture.npz", h=capture["h"], g=capture["g"], tokens=capture["tokens"],
           calibration=capture["calibration"], batch_docs=capture["batch_docs"])
  (work / "spec.json").write_text(json.dumps(
      {"checkpoint": str(work / "checkpoint"), "cut": CUT, "budget": BUDGET}))
  cache = tmp_path / "cache"
  runs, files = [], []
  for which in ("first", "second"):
    out = tmp_path / f"{which}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.bench_attacks", f"--cold_probe={name}",
         f"--probe_dir={work}", f"--probe_out={out}", "--captures=training", "--device=cpu"],
        cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "", "LLA_COMPILATION_CACHE_DIR": str(cache)},
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs.append(json.loads(out.read_text()))
    files.append(_cache_files(cache))
    if which == "first":
      entries = len(list(cache.iterdir()))
  first, second = runs
  assert first["predictions_sha256"] == second["predictions_sha256"] == row["predictions_sha256"]
  assert files[0], "the first process wrote nothing to its compilation cache"
  # Same inputs, same executables: as many entries as the binary's own first probe wrote.
  assert entries == row["cold_start"]["first"]["cache_entries_written"]
  # The second process found every executable there: it wrote no new file.
  assert files[1] == files[0]
  assert second["compile_s"] < first["compile_s"]


def test_missing_platform_is_a_one_line_error():
  import jax  # pylint: disable=g-import-not-at-top
  present = sorted({d.platform for d in jax.devices()})
  absent = next(p for p in ("tpu", "gpu") if p not in present)
  proc = subprocess.run([sys.executable, "-m", "experiments.bench_attacks", f"--device={absent}"],
                        cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": ""}, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1] == (
      f"no {absent} device: jax.devices() lists {', '.join(present)} only")
