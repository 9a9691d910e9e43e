"""experiments/bench_attacks.py end to end on a tiny random GPT-2: the cold-start columns.

The binary runs each attack in process (cold, then warm) and in two fresh processes of
itself sharing one persistent compilation cache directory (empty for the first). The
numbers are checked against each other: the three runs predict the same tokens, the
second process compiles less than the first (its executables come from the cache, which
the first filled), and the overhead columns are the arithmetic of the times beside them.
"""

import json
import os
from pathlib import Path
import subprocess
import sys

import pytest

ROOT = Path(__file__).resolve().parent.parent
ATTACKS = ("activation", "joint")


@pytest.fixture(scope="module")
def bench(tmp_path_factory) -> dict:
  out = tmp_path_factory.mktemp("bench") / "bench.json"
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.bench_attacks",
       "--random_config=n_embd=32,n_layer=2,n_head=2,vocab_size=101", "--cut=1", "--batch=2",
       "--seq_len=8", "--capture_batch=2", "--calibration=8", f"--attacks={','.join(ATTACKS)}",
       "--captures=training", "--torch_batch=0", "--torch_nocache_batch=0", "--matmul_n=64",
       "--cold_start=true", "--device=cpu", f"--out_json={out}"],
      cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": ""}, capture_output=True, text=True,
      timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return {"json": json.loads(out.read_text()), "stdout": proc.stdout}


def test_cold_start_columns(bench):
  result = bench["json"]
  assert result["config"]["device"]["platform"] == "cpu"
  assert result["config"]["cold_start_capture"] == "training"
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
    assert cold["second_overhead_s"] == pytest.approx(second["cold_s"] - row["warm_s"])
    assert cold["second_overhead_fraction"] == pytest.approx(
        (second["cold_s"] - row["warm_s"]) / row["warm_s"])
    assert 0 <= row["token_recovery"] <= 1
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
