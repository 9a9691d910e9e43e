"""Timing `lla_kernels.vocab_topk` against its reference, shared by the benchmark binaries.

experiments/bench_kernels.py (the kernel alone, and its interpret-mode check on CPU) and
experiments/bench_attacks.py (the kernel beside the attacks, on GPU and TPU) both run it:

  x, table = inputs(device, rows, d, vocab, seed)                # [R, d], [V, d] float32
  runs = compare(x, table, k, kind, precision, repeats)
  # {"xla": run, "topk": run}; run = {out, compile_s, best_s, median_s, memory, agreement}

"xla" materialises the [R, V] scores and calls `lax.top_k` (vocab_topk_reference); "topk"
is `vocab_topk.topk(impl=...)` ("platform": the Pallas kernel of the device's platform;
"auto": the same on GPU and TPU, the reference on CPU). Agreement is against "xla".
"""

from __future__ import annotations

import time

from absl import logging
import jax
import numpy as np

from lla_kernels import vocab_topk


def inputs(device, rows: int, d: int, vocab: int, seed: int):
  """GPT-2-like scales: table ~ N(0, 0.02^2) (the wte initialisation), queries a table row
  plus noise of the same size (a decoded embedding near its token)."""
  rng = np.random.default_rng(seed)
  table = (0.02 * rng.standard_normal((vocab, d))).astype(np.float32)
  x = table[rng.integers(0, vocab, rows)] + (0.02 * rng.standard_normal((rows, d))).astype(
      np.float32)
  return jax.device_put(x, device), jax.device_put(table, device)


def memory(compiled) -> dict:
  """XLA's memory analysis of an executable (bytes of temporaries, outputs, arguments)."""
  try:
    stats = compiled.memory_analysis()
  except Exception:  # Backends without a memory analysis raise assorted errors.
    return {}
  if stats is None:
    return {}
  return {name: int(getattr(stats, f"{name}_size_in_bytes"))
          for name in ("temp", "output", "argument") if hasattr(stats, f"{name}_size_in_bytes")}


def timed(fn, args, repeats: int, warm_up: bool = True, label: str = "") -> dict:
  """Compiles the jitted `fn` for `args`, then times `repeats` calls (after one untimed
  call when `warm_up`). With a `label` each phase is logged as it ends, so that a run
  stopped by a time limit still says where its time went."""
  start = time.perf_counter()
  compiled = fn.lower(*args).compile()
  compile_s = time.perf_counter() - start
  if label:
    logging.info("%s: compiled in %.1f s", label, compile_s)
  if warm_up:
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    if label:
      logging.info("%s: first call %.2f s", label, time.perf_counter() - start)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    out = jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - start)
  return {"out": out, "compile_s": compile_s, "best_s": min(times),
          "median_s": float(np.median(times)), "memory": memory(compiled)}


def agreement(got, want) -> dict:
  """Positions whose index matches, rows whose whole top-k matches, largest |value diff|."""
  (gv, gi), (wv, wi) = [(np.asarray(v), np.asarray(i)) for v, i in (got, want)]
  return {"positions_equal": float(np.mean(gi == wi)),
          "rows_equal": float(np.mean(np.all(gi == wi, axis=-1))),
          "max_abs_value_diff": float(np.max(np.abs(gv - wv)))}


def compare(x, table, k: int, kind: str, precision: str, repeats: int,
            impl: str = "auto") -> dict:
  """{"xla": run, "topk": run} for one score kind (module docstring), each with its
  agreement with "xla"."""
  xla = jax.jit(lambda x, table: vocab_topk.topk(x, table, k, kind, impl="reference",
                                                 precision=precision))
  kernel = jax.jit(lambda x, table: vocab_topk.topk(x, table, k, kind, impl=impl,
                                                    precision=precision))
  runs = {name: timed(fn, (x, table), repeats, label=f"{kind} {name}")
          for name, fn in (("xla", xla), ("topk", kernel))}
  for run in runs.values():
    run["agreement"] = agreement(run["out"], runs["xla"]["out"])
  return runs
