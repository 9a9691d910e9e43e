"""Benchmark: SipIt's previous implementation against the current one, side by side.

One capture (WikiText-2 evaluation passages of a stored checkpoint, --checkpoint, or random
tokens on a random-weight GPT-2, --random_config), written with lla.capture.capture and
read back as a replay reads it (the Workspace that lla.replay.driver.Plan builds). SipIt
runs on it in two implementations:

  * previous: lla/attacks/published/sipit.py as committed at --reference (default 6eb418d,
    the position-by-position search before the batched one), read with `git show` and loaded
    as a module of its own (its registration skipped). Its compiled functions are distinct
    objects, so it compiles and caches its own executables beside the current ones;
  * current: the registered attack (the working tree).

Both run through the same path as `registry.execute` (budget view, attack scope, charge),
each on a fresh Workspace of the capture:

  * cold: each implementation once in a fresh process of this binary (--probe; no
    persistent compilation cache), previous and current alternating, --cold_repeats times:
    wall seconds, of which compiling;
  * warm: in this process, after one untimed run of each, --repeats runs of each
    interleaved (previous, current, current, previous, ...), so that both see the same
    load on a shared machine; the median per implementation, and the ratio.

Every run's predictions must be identical (sha256), and each implementation's runs must
agree on the record's statistics; the benchmark fails otherwise. The statistics of the two
implementations are compared and their differences printed, beside those of the previous
implementation run once more with each document in a chunk of its own (--alone): which
documents share a compiled call changes the last bits of float32 results on XLA:CPU, and
where a statistic compares such noise (the refinement's "residual still falling" test once
it has converged) it moves with them, in either implementation. The search's float32
distances (accepted, runner-up) are reported, not compared. FLOPs are the workspace
meter's (XLA's count of what ran).

  # The embedded model, 16 documents of 32 tokens at cut 6:
  LLA_DATA_DIR=/work/shared/data python -m experiments.bench_sipit \\
      --checkpoint /tmp/iso23/run/pretrain/checkpoint --batch 16 --out_json /tmp/sipit.json
  # A small random GPT-2:
  python -m experiments.bench_sipit --random_config=n_layer=4,n_embd=128,n_head=4 --cut 2 \\
      --batch 16 --out_json /tmp/sipit_random.json
"""

from __future__ import annotations

import json
import os
from pathlib import Path
import subprocess
import sys
import tempfile
import time
import types

from absl import app, flags, logging
import jax
import numpy as np

from lla import runtime
from lla.attacks import budget as budget_lib
from lla.attacks import flops as flops_lib
from lla.attacks import registry
from lla.evidence import files
from lla.attacks.workspace import Workspace
from lla.capture import capture as capture_lib
from lla.capture import store
from lla.model import checkpoint
from lla.replay import driver
from lla.model.gpt2 import GPT2Config, random_params

_CHECKPOINT = flags.DEFINE_string(
    "checkpoint", "", "An lla checkpoint attacked on its WikiText-2 evaluation passages "
    "($LLA_DATA_DIR); empty: a random-weight GPT-2 (--random_config) on random tokens.")
_RANDOM_CONFIG = flags.DEFINE_list(
    "random_config", ["n_layer=4", "n_embd=128", "n_head=4"],
    "GPT2Config fields of the random-weight model as name=value.")
_CUT = flags.DEFINE_integer("cut", 6, "Cut k.")
_BATCH = flags.DEFINE_integer("batch", 16, "Documents attacked.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 32, "Tokens per document T.")
_CALIBRATION = flags.DEFINE_integer("calibration", 32, "Calibration documents.")
_CAPTURE_BATCH = flags.DEFINE_integer("capture_batch", 32, "Documents per captured step.")
_BUDGET = flags.DEFINE_list("budget", [], "Budget fields as name=value (defaults otherwise).")
_REFERENCE = flags.DEFINE_string(
    "reference", "6eb418d", "The git revision whose lla/attacks/published/sipit.py is the "
    "previous implementation.")
_REPEATS = flags.DEFINE_integer("repeats", 4, "Warm runs of each implementation.")
_COLD_REPEATS = flags.DEFINE_integer("cold_repeats", 1, "Cold processes per implementation "
                                     "(0: skip the cold starts).")
_ALONE = flags.DEFINE_bool(
    "alone", True, "Also run the previous implementation once with each document in a "
    "chunk of its own, whose statistics show what the company of other documents changes.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the passages (or random weights and tokens).")
_OUT_JSON = flags.DEFINE_string("out_json", "", "Where to write the results (JSON).")
# Internal: a cold run in a fresh process.
_PROBE = flags.DEFINE_enum("probe", "", ["", "previous", "current"],
                           "Internal: run this implementation once on --probe_dir's capture.")
_PROBE_DIR = flags.DEFINE_string("probe_dir", "", "Internal: the probe's inputs.")
_PROBE_OUT = flags.DEFINE_string("probe_out", "", "Internal: the probe's result (JSON).")

REPO_ROOT = Path(__file__).resolve().parents[1]
MODULE_PATH = "lla/attacks/published/sipit.py"
IMPLEMENTATIONS = ("previous", "current")
# Record statistics that are FLOPs (they depend on how the work was batched).
FLOP_DETAILS = ("flops_by_stage", "flops_analytic_by_stage")
# Float32 distances the search computed. XLA:CPU's rows are not bit-identical across batch
# sizes (one document's matrix-vector products against several documents' matrix
# products), so these differ in their last bits with the documents a call shares, in
# either implementation (e.g. with the chunking); the accepted distances are rounding noise
# (~1e-7), so their maximum moves by percents. They are reported, not compared.
DISTANCE_DETAILS = ("accepted_max_distance", "runner_up_min_distance", "runner_up_margin")




def previous_module(revision: str) -> types.ModuleType:
  """The SipIt module as committed at `revision`, loaded under a name of its own without
  registering its attack or FLOP model again (its budget fields are declared identically)."""
  source = subprocess.run(["git", "show", f"{revision}:{MODULE_PATH}"], cwd=REPO_ROOT,
                          check=True, capture_output=True, text=True).stdout
  registry.load_builtin()
  name = "lla_bench_sipit_previous"
  module = types.ModuleType(name)
  module.__file__ = f"{revision}:{MODULE_PATH}"
  sys.modules[name] = module
  register, declare_flops = registry.register, flops_lib.declare_flops
  registry.register = lambda attack: attack
  flops_lib.declare_flops = lambda *args, **kwargs: None
  try:
    exec(compile(source, module.__file__, "exec"), module.__dict__)  # pylint: disable=exec-used
  finally:
    registry.register, flops_lib.declare_flops = register, declare_flops
  return module


def implementation(which: str, revision: str):
  """The attack object of `which` ("previous" or "current")."""
  spec = registry.get("sipit").spec
  if which == "current":
    return registry.get("sipit")
  return previous_module(revision).SipIt(spec)


def execute(attack, ws: Workspace, budget: dict):
  """`registry.execute` for a given attack object: (result, charge, wall seconds)."""
  values = {**budget_lib.defaults(), **budget}
  view = budget_lib.View(values, attack.spec.budget_fields, attack.spec.name)
  start = time.perf_counter()
  with ws.attack_scope(attack.spec.name):
    result = attack(ws, view, jax.random.key(0))
    charge = ws.charge(result.flops_analytic)
  return result, charge, time.perf_counter() - start


def statistics(details: dict) -> dict:
  """The record's statistics other than FLOPs and search distances (counts, calibration,
  acceptance, resolution by stage)."""
  return {k: v for k, v in details.items() if k not in FLOP_DETAILS + DISTANCE_DETAILS}


# --- the capture -------------------------------------------------------------------------


def target_model():
  """(params, cfg, documents [B, T], calibration [N, T], model name, checkpoint path)."""
  b, t = _BATCH.value, _SEQ_LEN.value
  if _CHECKPOINT.value:
    from lla.data import load_splits  # pylint: disable=g-import-not-at-top
    ckpt = checkpoint.restore(_CHECKPOINT.value)
    splits = load_splits(seq_len=t, n_calibration=_CALIBRATION.value, n_eval=b,
                         seed=_SEED.value)
    return (ckpt.params, ckpt.cfg, np.asarray(splits.evaluation.tokens[:b], np.int32),
            np.asarray(splits.calibration.tokens, np.int32),
            f"checkpoint {ckpt.sha256[:12]}", _CHECKPOINT.value)
  overrides = {}
  for item in _RANDOM_CONFIG.value:
    name, _, value = item.partition("=")
    overrides[name.strip()] = int(value)
  cfg = GPT2Config(**overrides)
  rng = np.random.default_rng(_SEED.value)
  tokens = rng.integers(0, cfg.vocab_size, (b, t)).astype(np.int32)
  cal = rng.integers(0, cfg.vocab_size, (_CALIBRATION.value, t)).astype(np.int32)
  return (random_params(cfg, _SEED.value), cfg, tokens, cal,
          "gpt2_random(" + ",".join(_RANDOM_CONFIG.value) + ")", "")


def write_inputs(work: Path, budget: dict) -> dict:
  """The capture (lla.capture.capture_target), the checkpoint and the calibration tokens
  in `work`, for this process and the cold probes."""
  params, cfg, tokens, cal, model_name, ckpt = target_model()
  if not ckpt:
    ckpt = str(work / "checkpoint")
    checkpoint.save(ckpt, params, cfg, export_hf=False)
  capture_lib.capture_target(str(work / "capture"), params, cfg, tokens,
                             list(range(len(tokens))), _CUT.value, model_id=model_name,
                             batch_size=_CAPTURE_BATCH.value)
  np.save(work / "calibration.npy", cal)
  spec = {"checkpoint": ckpt, "budget": budget, "reference": _REFERENCE.value,
          "model": model_name}
  (work / "spec.json").write_text(json.dumps(spec))
  return spec


def workspace_factory(work: Path):
  """A fresh Workspace of the stored capture, built as lla.replay.driver.Plan builds it."""
  spec = json.loads((work / "spec.json").read_text())
  capture = store.load_capture(work / "capture")
  model = checkpoint.restore(spec["checkpoint"])
  cal = np.load(work / "calibration.npy")
  values = {**budget_lib.defaults(), **spec["budget"]}
  target = capture.metadata["protocol"]["T"]

  def make():
    return Workspace(capture.activations, capture.gradients, model.params, model.cfg,
                     int(target["cut"]), cal, ridge_alpha=float(values["ridge_alpha"]),
                     batch_docs=driver.batch_docs(capture.metadata),
                     defense={"name": str(target["defense"]),
                              "params": dict(target["defense_params"] or {})},
                     capture_files=store.attack_files(capture),
                     capture_info=store.attack_metadata(capture))
  return make, store.load_truth(work / "capture"), spec


# --- runs ----------------------------------------------------------------------------------


def probe(which: str, work: Path, out: Path) -> None:
  """A cold run in this fresh process (no persistent compilation cache)."""
  runtime.configure_matmul_precision()
  make, _, spec = workspace_factory(work)
  attack = implementation(which, spec["reference"])
  result, charge, wall = execute(attack, make(), spec["budget"])
  out.write_text(json.dumps({
      "which": which, "cold_s": wall, "compile_s": charge.compile_s, "flops": charge.flops,
      "predictions_sha256": files.int32_sha256(result.predictions),
      "statistics": statistics(result.details)}, sort_keys=True))


def cold_starts(work: Path, repeats: int) -> dict:
  """Each implementation `repeats` times in a fresh process, alternating."""
  runs = {which: [] for which in IMPLEMENTATIONS}
  env = {**os.environ, runtime.ENV_VAR: "off"}
  for r in range(repeats):
    order = IMPLEMENTATIONS if r % 2 == 0 else IMPLEMENTATIONS[::-1]
    for which in order:
      out = work / f"probe_{which}_{r}.json"
      start = time.perf_counter()
      proc = subprocess.run(
          [sys.executable, "-m", "experiments.bench_sipit", f"--probe={which}",
           f"--probe_dir={work}", f"--probe_out={out}"], cwd=REPO_ROOT, env=env,
          capture_output=True, text=True)
      if proc.returncode:
        raise RuntimeError(f"cold probe {which} failed:\n{proc.stderr[-4000:]}")
      runs[which].append({**json.loads(out.read_text()),
                          "process_s": time.perf_counter() - start})
      logging.info("cold %s: %.1f s (compile %.1f s)", which, runs[which][-1]["cold_s"],
                   runs[which][-1]["compile_s"])
  return runs


def warm_runs(make, attacks: dict, budget: dict, repeats: int) -> dict:
  """One untimed run of each, then `repeats` of each interleaved (ABBA)."""
  runs = {which: [] for which in attacks}
  for which, attack in attacks.items():
    execute(attack, make(), budget)
  for r in range(repeats):
    order = IMPLEMENTATIONS if r % 2 == 0 else IMPLEMENTATIONS[::-1]
    for which in order:
      result, charge, wall = execute(attacks[which], make(), budget)
      runs[which].append((result, charge, wall))
      logging.info("warm %s: %.2f s", which, wall)
  return runs


def check_runs(identity: dict) -> dict:
  """Raises unless every run's predictions are identical and each implementation's runs
  have identical statistics; returns the statistics that differ between the
  implementations, {key: {implementation: value}} (empty when none)."""
  shas = {run["predictions_sha256"] for runs in identity.values() for run in runs}
  if len(shas) != 1:
    raise AssertionError(f"predictions differ between runs: {identity}")
  first = {}
  for which, runs in identity.items():
    texts = {json.dumps(run["statistics"], sort_keys=True) for run in runs}
    if len(texts) != 1:
      raise AssertionError(f"{which}: statistics differ between its own runs: {texts}")
    first[which] = runs[0]["statistics"]
  keys = sorted(set().union(*first.values()))
  return {k: {which: stats.get(k) for which, stats in first.items()} for k in keys
          if len({json.dumps(stats.get(k), sort_keys=True) for stats in first.values()}) > 1}


def bench(work: Path) -> dict:
  registry.load_builtin()
  budget = budget_lib.parse_items(_BUDGET.value)
  spec = write_inputs(work, budget)
  make, truth, _ = workspace_factory(work)
  ws = make()
  b, t = ws.num_docs, ws.seq_len
  attacks = {which: implementation(which, _REFERENCE.value) for which in IMPLEMENTATIONS}
  if Path(REPO_ROOT / MODULE_PATH).read_text() == subprocess.run(
      ["git", "show", f"{_REFERENCE.value}:{MODULE_PATH}"], cwd=REPO_ROOT,
      capture_output=True, text=True).stdout:
    logging.warning("the working tree's SipIt is the one at %s: both sides run the same code",
                    _REFERENCE.value)
  cold = cold_starts(work, _COLD_REPEATS.value) if _COLD_REPEATS.value else {}
  warm = warm_runs(make, attacks, budget, _REPEATS.value)
  alone = None
  if _ALONE.value:  # The previous implementation, each document in a chunk of its own.
    ws_alone = make()
    ws_alone.memory_budget_bytes = 1
    alone = execute(attacks["previous"], ws_alone, budget)[0]

  rows, identity = {}, {}
  for which in IMPLEMENTATIONS:
    walls = [w for _, _, w in warm[which]]
    result, charge, _ = warm[which][0]
    details = result.details
    own = sum(v for s, v in details["flops_by_stage"].items()
              if not s.startswith("shared:") and v is not None)
    median = float(np.median(walls))
    rows[which] = {
        "warm_s": walls, "warm_s_median": median, "warm_s_per_doc": median / b,
        "flops": charge.flops, "flops_source": charge.flops_source,
        "flops_per_doc": charge.flops / b,
        "own_flops": own, "gflops_per_s": charge.flops / median / 1e9,
        "flops_by_stage": details["flops_by_stage"],
        "token_recovery": float(np.mean(result.predictions == truth)),
        "predictions_sha256": files.int32_sha256(result.predictions),
        "distances": {k: details[k] for k in DISTANCE_DETAILS}}
    if cold:
      rows[which]["cold"] = cold[which]
      rows[which]["cold_s_median"] = float(np.median([c["cold_s"] for c in cold[which]]))
      rows[which]["compile_s_median"] = float(np.median([c["compile_s"] for c in cold[which]]))
    identity[which] = [{"predictions_sha256": files.int32_sha256(r.predictions),
                        "statistics": statistics(r.details)} for r, _, _ in warm[which]]
    identity[which] += [{"predictions_sha256": c["predictions_sha256"],
                         "statistics": c["statistics"]} for c in cold.get(which, [])]
  if alone is not None:
    identity["previous_alone"] = [{"predictions_sha256": files.int32_sha256(alone.predictions),
                                   "statistics": statistics(alone.details)}]
  differing = check_runs(identity)
  prev, cur = rows["previous"], rows["current"]
  ratios = {"warm_s": prev["warm_s_median"] / cur["warm_s_median"],
            "flops": cur["flops"] / prev["flops"]}
  if cold:
    ratios["cold_s"] = prev["cold_s_median"] / cur["cold_s_median"]
    ratios["compile_s"] = prev["compile_s_median"] / max(cur["compile_s_median"], 1e-9)

  device = jax.devices()[0]
  print(f"\nSipIt on {spec['model']} (L={ws.cfg.n_layer}, d={ws.cfg.n_embd}, "
        f"V={ws.cfg.vocab_size}), k={ws.cut}, T={t}, B={b} on {device.device_kind} "
        f"({device.platform}, {os.cpu_count()} CPUs); previous = {_REFERENCE.value}")
  print(f"{'':10s}{'warm s/doc':>11s}{'GFLOP/s':>9s}{'GFLOP/doc':>10s}{'cold s/doc':>11s}"
        f"{'compile s':>10s}{'tokens':>8s}  predictions sha256")
  for which, row in rows.items():
    cold_cols = (f"{row['cold_s_median'] / b:11.3f}{row['compile_s_median']:10.1f}" if cold
                 else f"{'-':>11s}{'-':>10s}")
    print(f"{which:10s}{row['warm_s_per_doc']:11.3f}{row['gflops_per_s']:9.2f}"
          f"{row['flops_per_doc'] / 1e9:10.2f}{cold_cols}{100 * row['token_recovery']:7.2f}%  "
          f"{row['predictions_sha256'][:16]}")
  print("speed-up (previous / current): warm " + f"{ratios['warm_s']:.2f}x"
        + (f", cold {ratios['cold_s']:.2f}x, compile {ratios['compile_s']:.2f}x" if cold else "")
        + f"; FLOPs current / previous {ratios['flops']:.3f}")
  print("GFLOPs by stage (previous -> current): " + ", ".join(
      f"{s} {prev['flops_by_stage'][s] / 1e9:.2f} -> {cur['flops_by_stage'][s] / 1e9:.2f}"
      for s in cur["flops_by_stage"] if not s.startswith("shared:")))
  print(f"predictions identical across all {sum(map(len, identity.values()))} runs; "
        "search distances (previous -> current): " + ", ".join(
            f"{k} {prev['distances'][k]:.6g} -> {cur['distances'][k]:.6g}"
            for k in DISTANCE_DETAILS if prev["distances"][k] is not None))
  if differing:
    print("statistics that differ (" + ", ".join(identity) + "):")
    for k, values in differing.items():
      print(f"  {k}: " + "; ".join(f"{w} {json.dumps(v, sort_keys=True)}"
                                   for w, v in values.items()))
  else:
    print("statistics identical (" + ", ".join(identity) + ")")
  return {"config": {"model": spec["model"], "cut": ws.cut, "seq_len": t, "batch": b,
                     "budget": budget, "reference": _REFERENCE.value,
                     "repeats": _REPEATS.value, "cold_repeats": _COLD_REPEATS.value,
                     "device": device.device_kind, "cpu_count": os.cpu_count()},
          "previous": prev, "current": cur, "ratios": ratios,
          "predictions_identical": True, "statistics_differing": differing}


def main(argv):
  del argv
  if _PROBE.value:
    probe(_PROBE.value, Path(_PROBE_DIR.value), Path(_PROBE_OUT.value))
    return
  # No persistent compilation cache: cold runs compile from scratch.
  runtime.configure_matmul_precision()
  with tempfile.TemporaryDirectory(prefix="bench_sipit_") as work:
    result = bench(Path(work))
  if _OUT_JSON.value:
    with open(_OUT_JSON.value, "w") as f:
      json.dump(result, f, indent=2, sort_keys=True, default=float)
    print(f"wrote {_OUT_JSON.value}")


if __name__ == "__main__":
  app.run(main)
