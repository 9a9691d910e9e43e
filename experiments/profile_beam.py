"""Profile: where the compiled beam search's time goes, by kind of operation.

Runs `lla.attacks.seed.beam.search`'s loop (one compiled `Workspace.scan_steps` executable, as
every beam attack runs it) on random inputs at a model's shape, times it warm, then
traces one call with JAX's profiler and attributes each executed XLA operation of the
loop (the trace's per-operation events, matched by name to the executable's optimised HLO,
`compiled.as_text()`) to one of

  projection GEMMs   the c_attn, attention c_proj, c_fc and MLP c_proj matrix products
  attention          the rest of attention: scores, softmax, mask, weighted values, the
                     q/k/v split and the transposes of the cached keys and values
  fused GEMM+other   fusions that hold a matrix product and elementwise work together
  other              layer norms, GELU, residual adds, the cache gather/update, the loop

and reports the seconds and share of each, the search's GFLOP/s (analytic FLOPs,
`beam.analytic_flops`) and a float32 matmul probe's GFLOP/s beside it.

  python -m experiments.profile_beam --model=embedded --docs=48 --out_json=/tmp/profile_beam.json
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import tempfile
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from configs import models
from lla.model import loading
from lla_kernels import compare as kernel_compare
from lla import runtime
from lla.attacks.seed import beam
from lla.attacks import workspace
from lla.model.gpt2 import random_params

_MODEL = flags.DEFINE_enum("model", "embedded", list(models.NAMES), "Model shape (random weights).")
_DOCS = flags.DEFINE_integer("docs", 48, "Documents B (the main job's defended captures: 48).")
_CUT = flags.DEFINE_integer("cut", 6, "Cut k.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 32, "Tokens per document T.")
_CANDIDATES = flags.DEFINE_integer("candidates", 32, "Candidates per position C.")
_WIDTH = flags.DEFINE_integer("width", 2, "Beam width W.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed warm calls.")
_MATMUL_N = flags.DEFINE_integer("matmul_n", 2048, "Size of the float32 matmul probe.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of weights and inputs.")
_OUT_JSON = flags.DEFINE_string("out_json", "", "Where to write the results (JSON).")

_PROJECTIONS = ("c_attn/dot_general", "c_proj/dot_general", "c_fc/dot_general")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\S+) ")


def classify(hlo_text: str) -> dict[str, str]:
  """Top-level instruction name -> kind (module doc), from optimised HLO text."""
  bodies = {m.group(1): m.group(2) for m in
            re.finditer(r"^%(\S+) .*?\{\n(.*?)\n\}", hlo_text, re.M | re.S)}
  kinds = {}
  for line in hlo_text.splitlines():
    match = _INSTRUCTION.match(line)
    if not match:
      continue
    op_name = re.search(r'op_name="([^"]*)"', line)
    op_name = op_name.group(1) if op_name else ""
    called = re.search(r"calls=%([^,\s]+)", line)
    body = bodies.get(called.group(1), "") if called else ""
    has_dot = " dot(" in body or " dot(" in line
    if has_dot and op_name.endswith(_PROJECTIONS):
      kinds[match.group(1)] = "projection GEMMs"
    elif has_dot and not op_name.endswith("dot_general"):
      kinds[match.group(1)] = "fused GEMM+other"
    elif "attn" in op_name:
      kinds[match.group(1)] = "attention"
    else:
      kinds[match.group(1)] = "other"
  return kinds


def traced_seconds(trace_dir: str) -> collections.Counter:
  """Total seconds per event name in the profiler trace under `trace_dir`."""
  path, = glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "perfetto_trace.json.gz"))
  with gzip.open(path) as f:
    events = json.load(f)["traceEvents"]
  out = collections.Counter()
  for event in events:
    if event.get("ph") == "X":
      out[event["name"]] += event.get("dur", 0) / 1e6
  return out


def matmul_rate(n: int) -> float:
  """FLOP/s of a float32 [n, n] x [n, n] product (best of 3 warm calls)."""
  a = jnp.ones((n, n), jnp.float32)
  return 2.0 * n**3 / kernel_compare.timed(jax.jit(lambda x: x @ x), (a,), 3)["best_s"]


def main(argv):
  del argv
  runtime.configure()
  spec = models.get_config(_MODEL.value)
  cfg = loading.architecture(spec)
  docs, seq_len, num, width, cut = (_DOCS.value, _SEQ_LEN.value, _CANDIDATES.value,
                                    _WIDTH.value, _CUT.value)
  params = random_params(cfg, _SEED.value)
  rng = np.random.default_rng(_SEED.value)
  target = jnp.asarray(rng.standard_normal((docs, seq_len, cfg.n_embd), dtype=np.float32))
  candidates = jnp.asarray(rng.integers(0, cfg.vocab_size, (docs, seq_len, num)), jnp.int32)
  state = beam.start(target, cfg=cfg, k=cut, width=width)
  xs = beam.positions(target, candidates)
  static = (("cfg", cfg),)
  executable = workspace.scan_steps.lower((params,), state, xs, step=beam.step,
                                          static=static).compile()
  run = lambda: jax.block_until_ready(executable((params,), state, xs))
  run()
  times = []
  for _ in range(_REPEATS.value):
    start = time.perf_counter()
    run()
    times.append(time.perf_counter() - start)
  seconds = min(times)
  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    run()
    jax.profiler.stop_trace()
    spent = traced_seconds(trace_dir)
  kinds = classify(executable.as_text())
  by_kind = collections.Counter()
  for name, kind in kinds.items():
    by_kind[kind] += spent.get(name, 0.0)
  traced = sum(by_kind.values())
  flops = beam.analytic_flops(cfg, cut, docs, width, num, seq_len)
  probe = matmul_rate(_MATMUL_N.value)
  result = {
      "config": {"model": _MODEL.value, "docs": docs, "cut": cut, "seq_len": seq_len,
                 "candidates": num, "width": width, "backend": jax.default_backend(),
                 "cpu_count": os.cpu_count(), "jax_version": jax.__version__},
      "warm_s": seconds, "analytic_flops": flops, "gflops_per_s": flops / seconds / 1e9,
      "matmul_probe_gflops_per_s": probe / 1e9, "traced_op_s": traced,
      "by_kind_s": dict(by_kind), "by_kind_share": {k: v / traced for k, v in by_kind.items()},
  }
  print(f"beam search, {_MODEL.value} shape, B={docs} T={seq_len} C={num} W={width} k={cut} on "
        f"{jax.default_backend()}: {seconds:.3f} s warm, {flops:.3g} FLOPs, "
        f"{result['gflops_per_s']:.1f} GFLOP/s (matmul probe {probe / 1e9:.1f})")
  print(f"traced operations {traced:.3f} s:")
  for kind, value in by_kind.most_common():
    print(f"  {kind:18s} {value:7.3f} s  {100 * value / traced:5.1f}%")
  if _OUT_JSON.value:
    with open(_OUT_JSON.value, "w") as f:
      json.dump(result, f, indent=2, sort_keys=True)
    print(f"wrote {_OUT_JSON.value}")


if __name__ == "__main__":
  app.run(main)
