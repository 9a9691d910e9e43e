"""Compile cost made visible: lla.runtime's meter against a second count of JAX's own
monitoring events, its `compile_meter`, an attack record's `jax_compile` field
(old records without it still load) and the main job's phase table."""

import collections
import dataclasses
import json
import time

import jax
from jax import monitoring
import jax.numpy as jnp
import numpy as np

from lla import runtime
from lla.evidence.records import AttackRecord
from lla.study import report

BACKEND = "/jax/core/compile/backend_compile_duration"


def _programs():
  """Two programs of shapes no other test compiles, under closures made now: neither is in
  JAX's in-memory caches."""
  x = np.linspace(-1, 1, 7 * 13, dtype=np.float32).reshape(7, 13)
  return x, jax.jit(lambda a: jnp.sin(a).sum()), jax.jit(lambda a: (a @ a.T).max())


def test_the_meter_counts_each_new_executable_once_as_jax_reports_it():
  x, f, g = _programs()
  seen, seconds = collections.Counter(), collections.Counter()

  def on_duration(event, duration, **unused):
    seen[event] += 1
    seconds[event] += duration

  monitoring.register_event_duration_secs_listener(on_duration)
  try:
    before = runtime.compile_totals()
    start = time.perf_counter()
    f(x), g(x)
    wall = time.perf_counter() - start
    first = runtime.compile_since(before)
    again = runtime.compile_totals()
    f(x), g(x)  # compiled already: nothing new
    second = runtime.compile_since(again)
  finally:
    monitoring.unregister_event_duration_listener(on_duration)

  # Two programs, two executables: JAX's backend events, counted here independently.
  assert first["executables"] == seen[BACKEND] == 2
  assert first["compiled"] == 2 - first["cache_hits"]
  np.testing.assert_allclose(first["backend_s"], seconds[BACKEND], rtol=1e-9)
  assert first["seconds"] == first["trace_s"] + first["lower_s"] + first["backend_s"]
  assert 0 < first["seconds"] <= wall
  assert second["executables"] == 0 and second["seconds"] == 0


def test_the_meter_splits_a_blocks_wall_time_into_compile_and_run():
  x, f, _ = _programs()
  with runtime.compile_meter() as spent:
    f(x)
    time.sleep(0.2)  # run time, no compile
  assert spent["executables"] == 1
  assert spent["wall_s"] >= 0.2 + spent["seconds"] - 1e-6
  np.testing.assert_allclose(spent["run_s"], spent["wall_s"] - spent["seconds"])
  assert spent["run_s"] >= 0.2


def _record(**fields) -> AttackRecord:
  return AttackRecord(
      run_id="r/ridge", attack="ridge", family="f", status="ok", error=None, e_hash="a" * 64,
      capture_dir="cap", capture_sha256="b" * 64, truth_file="cap/truth.npy",
      prediction_file="predictions/r.npy", prediction_sha256="c" * 64, scored_positions="all",
      baseline_token=0, model_id="m", model_seed=0, cut=2, knowledge="public", corpus="c",
      defense="none", defense_params={}, reference=None, seed=0, budget={}, flops=1.0,
      flops_source="analytic", flops_analytic=1.0, wall_s=2.0, compile_s=1.0, stages={},
      details={}, provenance={}, **fields)


def test_a_record_carries_its_compile_and_one_written_before_the_field_still_loads():
  spent = {"seconds": 1.5, "trace_s": 0.5, "lower_s": 0.25, "backend_s": 0.75,
           "executables": 3, "cache_hits": 1, "cache_writes": 2, "compiled": 2,
           "wall_s": 4.0, "run_s": 2.5}
  record = _record(jax_compile=spent)
  assert AttackRecord.from_json(record.to_json()) == record
  # An old record's bytes (no such key) load as None, so a study's logged hashes, taken of
  # the files' bytes, still hold.
  old = json.loads(_record().to_json())
  del old["jax_compile"]
  assert AttackRecord.from_json(json.dumps(old)).jax_compile is None
  assert dataclasses.replace(record, jax_compile=None) == _record()


def _totals(trace, lower, backend, executables, hits) -> dict:
  return {"trace_s": trace, "lower_s": lower, "backend_s": backend,
          "executables": executables, "cache_hits": hits, "cache_writes": 0}


def test_the_phase_table_shows_each_phases_compile_against_its_run_time():
  invocations = [
      # An invocation of an old timing.json: no counts.
      {"started_unix": 900.0, "finished_unix": 960.0,
       "phases": [{"name": "report", "started_unix": 900.0}]},
      {"started_unix": 1000.0, "finished_unix": 1600.0, "compile": _totals(40, 10, 110, 90, 30),
       "phases": [
           {"name": "pretrain", "started_unix": 1000.0, "compile": _totals(0, 0, 0, 0, 0)},
           {"name": "attacks", "started_unix": 1120.0, "compile": _totals(5, 1, 24, 20, 0)},
           {"name": "report", "started_unix": 1480.0, "compile": _totals(40, 10, 100, 88, 30)}]}]
  rows = [line.split("|")[1:-1] for line in report.phase_table(invocations)[2:]]
  cells = [[c.strip() for c in row[:6]] for row in rows]
  assert cells[0] == ["1", "report", "1.0", "—", "—", "—"]
  # pretrain: 120 s, of them 5 + 1 + 24 = 30 compiling; attacks: 360 s, of them
  # (40 - 5) + (10 - 1) + (100 - 24) = 120; report: 120 s, of them 10.
  assert cells[1] == ["2", "pretrain", "2.0", "30", "90", "20 (0)"]
  assert cells[2] == ["2", "attacks", "6.0", "120", "240", "68 (30)"]
  assert cells[3] == ["2", "report", "2.0", "10", "110", "2 (0)"]
