"""Benchmark: lla_kernels.vocab_topk against XLA's materialise-and-top_k.

R query rows against a V x d table (default: B*T = 8192 positions, GPT-2's d = 768 and
V = 50257, k = 32). For each score kind it runs, on the chosen device:

  * xla:    the [R, V] scores materialised, then `lax.top_k` (vocab_topk_reference);
  * topk:   `lla_kernels.vocab_topk.topk(impl="auto")`: the Pallas kernel on GPU (Triton) and
            TPU (Mosaic), the reference itself on CPU;
  * on CPU, the Mosaic-style kernel in Pallas interpret mode on the first
    --interpret_rows rows: an agreement check of the kernel's algorithm at full V and
    d (interpret mode emulates the kernel; its time says nothing about the hardware).

and reports warm time (best and median of --repeats after one compiled call), compile
time, XLA's memory analysis of each executable (temporaries, outputs), the [R, V] float32
scores the kernel never writes, and agreement with xla (positions whose index matches,
rows whose whole top-k matches, largest value difference).

  python -m experiments.bench_kernels --device=auto --out_json=/tmp/bench_kernels.json
"""

from __future__ import annotations

import json
import os

from absl import app, flags
import jax

from lla_kernels import vocab_topk
from lla_kernels.compare import agreement, compare, inputs, timed

_DEVICE = flags.DEFINE_enum("device", "auto", ["auto", "cpu", "gpu", "tpu"],
                            "Where to run: auto = JAX's default backend.")
_ROWS = flags.DEFINE_integer("rows", 8192, "Query rows R (B*T positions).")
_D = flags.DEFINE_integer("d", 768, "Row width d.")
_VOCAB = flags.DEFINE_integer("vocab", 50257, "Table rows V.")
_K = flags.DEFINE_integer("k", 32, "Rows kept per query.")
_KINDS = flags.DEFINE_list("kinds", ["neg_sq_dist", "neg_dot"], "Score kinds.")
_PRECISION = flags.DEFINE_enum("precision", "float32", list(vocab_topk.PRECISIONS),
                               "Matmul precision of both sides.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed calls per method.")
_INTERPRET_ROWS = flags.DEFINE_integer(
    "interpret_rows", 1024, "CPU only: rows checked with the kernel in interpret mode (0: none).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the inputs.")
_OUT_JSON = flags.DEFINE_string("out_json", "", "Where to write the results (JSON).")


def main(argv):
  del argv
  backend = jax.default_backend() if _DEVICE.value == "auto" else _DEVICE.value
  device = jax.devices(backend)[0]
  rows, d, vocab, k = _ROWS.value, _D.value, _VOCAB.value, _K.value
  x, table = inputs(device, rows, d, vocab, _SEED.value)
  scores_bytes = 4 * rows * vocab
  results = {"config": {"device": str(device), "device_kind": device.device_kind,
                        "backend": backend, "rows": rows, "d": d, "vocab": vocab, "k": k,
                        "precision": _PRECISION.value, "repeats": _REPEATS.value,
                        "cpu_count": os.cpu_count(), "jax_version": jax.__version__},
             "scores_bytes_not_materialised": scores_bytes, "kinds": {}}
  print(f"{rows} x {vocab} scores (d={d}, k={k}) on {device.device_kind} ({backend}), "
        f"precision {_PRECISION.value}; the [R, V] float32 scores are {scores_bytes / 2**30:.2f} "
        "GiB")
  print(f"{'kind':13s}{'method':26s}{'best s':>9s}{'median s':>10s}{'compile s':>10s}"
        f"{'temp GiB':>10s}{'positions':>11s}{'rows':>8s}{'max |dv|':>10s}")
  with jax.default_device(device):
    for kind in _KINDS.value:
      runs = compare(x, table, k, kind, _PRECISION.value, _REPEATS.value)
      if backend == "cpu" and _INTERPRET_ROWS.value > 0:
        n = min(_INTERPRET_ROWS.value, rows)
        interpret = jax.jit(lambda x, table, kind=kind: vocab_topk.topk(
            x, table, k, kind, impl="mosaic", interpret=True, precision=_PRECISION.value))
        run = timed(interpret, (x[:n], table), 1, warm_up=False)
        want = tuple(a[:n] for a in runs["xla"]["out"])
        runs[f"kernel_interpret[{n} rows]"] = {**run, "agreement": agreement(run["out"], want)}
      for name, run in runs.items():
        a = run["agreement"]
        temp = run["memory"].get("temp")
        print(f"{kind:13s}{name:26s}{run['best_s']:9.3f}{run['median_s']:10.3f}"
              f"{run['compile_s']:10.2f}{'' if temp is None else f'{temp / 2**30:10.3f}':>10s}"
              f"{a['positions_equal']:11.5f}{a['rows_equal']:8.4f}{a['max_abs_value_diff']:10.2g}")
        del run["out"]
      results["kinds"][kind] = runs
      _write(results)  # after each kind: a run stopped by a time limit keeps what it timed
  if backend == "cpu":
    print("On CPU `topk` is the reference (the same executable as xla); the interpret-mode "
          "row checks the kernel's algorithm, not its speed.")
  if _OUT_JSON.value:
    print(f"wrote {_OUT_JSON.value}")


def _write(results: dict) -> None:
  if _OUT_JSON.value:
    with open(_OUT_JSON.value + ".tmp", "w") as f:
      json.dump(results, f, indent=2, sort_keys=True)
    os.replace(_OUT_JSON.value + ".tmp", _OUT_JSON.value)


if __name__ == "__main__":
  app.run(main)
