"""experiments/profile_beam.py: its FLOP count, its attribution of operations, its trace reading.

Each is checked against a quantity computed in the test by another route:
  * `beam.analytic_flops` (the binary's FLOPs) against the matrix products counted from the
    shapes of the client's parameters and the attention over the cache, and against XLA's
    cost analysis of the compiled loop (its body, counted once, times the positions) as a
    ceiling that also counts the elementwise work;
  * `classify` and `traced_seconds` on a program built here whose operations are known: a
    large matrix product under `mlp/c_fc`, a softmax under `attn`, elementwise work
    elsewhere; the seconds per operation against the profiler's other trace file (the
    trace.json.gz beside the perfetto one, its events keyed by the `hlo_op` argument), and
    the time of the product against the rest, which its FLOPs dwarf;
  * the binary end to end: its FLOPs against the shape count, its kinds, its configuration.
"""

import collections
import glob
import gzip
import json
import os
from pathlib import Path
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import models
from lla.model import loading as models_lib
from experiments import profile_beam
from lla.attacks.seed import beam
from lla.attacks import workspace
from lla.model.gpt2 import random_params

ROOT = Path(__file__).resolve().parent.parent
KINDS = {"projection GEMMs", "attention", "fused GEMM+other", "other"}
# The binary's run below, and a second shape: (cut k, docs B, seq_len T, candidates C, width W).
BINARY_SHAPE = (2, 3, 6, 4, 2)
SHAPES = (BINARY_SHAPE, (3, 2, 9, 5, 3))


def _tiny():
  return models_lib.architecture(models.get_config("tiny"))


def _beam_loop(cfg, k, docs, seq_len, num, width):
  """The compiled loop of a beam search on random inputs, as the binary builds it."""
  rng = np.random.default_rng(0)
  target = rng.standard_normal((docs, seq_len, cfg.n_embd), dtype=np.float32)
  candidates = rng.integers(0, cfg.vocab_size, (docs, seq_len, num)).astype(np.int32)
  state = beam.start(target, cfg=cfg, k=k, width=width)
  return workspace.scan_steps.lower((random_params(cfg, 0),), state,
                                    beam.positions(target, candidates), step=beam.step,
                                    static=(("cfg", cfg),)).compile()


def _counted_flops(cfg, k, docs, seq_len, num, width):
  """Matmul FLOPs of the search, counted here: every (document, position, beam, candidate)
  runs one token through client blocks 0..k-1. Per block, each Dense kernel [n_in, n_out]
  costs 2 * n_in * n_out (read from the parameters' shapes); attention scores the query
  against all seq_len cached keys and mixes as many values, 2 * seq_len * head_dim FLOPs
  each per head; the cost ||h - target||^2 is 2 * d (a dot product of the difference)."""
  params = random_params(cfg, 0)
  per_token = 0
  for block in range(k):
    kernels = [x.shape for path, x in jax.tree_util.tree_leaves_with_path(params[f"h_{block}"])
               if path[-1].key == "kernel"]
    assert len(kernels) == 4  # c_attn, attention c_proj, c_fc, MLP c_proj
    per_token += sum(2 * n_in * n_out for n_in, n_out in kernels)
    per_token += 2 * (2 * seq_len * cfg.head_dim) * cfg.n_head
  per_token += 2 * cfg.n_embd
  return docs * seq_len * width * num * per_token


@pytest.mark.parametrize("shape", SHAPES)
def test_analytic_flops_counts_the_client_matmuls(shape):
  cfg = _tiny()
  k, docs, seq_len, num, width = shape
  analytic = beam.analytic_flops(cfg, k, docs, width, num, seq_len)
  assert analytic == _counted_flops(cfg, k, docs, seq_len, num, width)
  # XLA counts a while loop's body once: times the seq_len positions it is the loop's
  # count, which includes the elementwise work (layer norms, GELU, softmax, the top-k), so
  # it is above the matmuls' count, but not by much at this shape.
  cost = _beam_loop(cfg, k, docs, seq_len, num, width).cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  xla = float(cost["flops"]) * seq_len
  assert analytic <= xla <= 1.25 * analytic, (analytic, xla)


def test_classify_names_the_projections_and_attention_of_every_block():
  cfg = _tiny()
  k = BINARY_SHAPE[0]
  text = _beam_loop(cfg, *BINARY_SHAPE).as_text()
  kinds = profile_beam.classify(text)
  assert set(kinds.values()) <= KINDS
  lines = {line.split(" = ")[0].strip().removeprefix("ROOT ").lstrip("%"): line
           for line in text.splitlines() if " = " in line}
  projections = [n for n, kind in kinds.items() if kind == "projection GEMMs"]
  # Each block's c_fc product (or its fusion with elementwise work) is there for both blocks.
  named = lambda n, what: what in lines[n]
  for block in range(k):
    assert any(named(n, f"h_{block}.step/mlp/c_fc") for n in kinds
               if kinds[n] in ("projection GEMMs", "fused GEMM+other")), block
  assert all("dot_general" in lines[n] for n in projections)
  assert any(kind == "attention" for kind in kinds.values())


def _known_program(x, w, s, r):
  """A projection (a matrix product named like a block's c_fc), an attention softmax and
  elementwise work, on independent inputs so that no fusion joins them."""
  with jax.named_scope("mlp"), jax.named_scope("c_fc"):
    y = x @ w
  with jax.named_scope("attn"):
    z = jax.nn.softmax(s, axis=-1)
  with jax.named_scope("ln_f"):
    u = jnp.tanh(r) * 2.0 + 1.0
  return y, z, u


def _entry_instructions(hlo_text: str) -> dict[str, str]:
  """Instruction name -> its line, in the ENTRY computation only (what the trace times)."""
  entry = hlo_text[hlo_text.index("\nENTRY ") + 1:]
  entry = entry[:entry.index("\n}")]
  out = {}
  for line in entry.splitlines()[1:]:
    name = line.strip().removeprefix("ROOT ").split(" ")[0].lstrip("%")
    out[name] = line
  return out


def _seconds_by_hlo_op(trace_dir: Path, module: str) -> collections.Counter:
  """Seconds per HLO instruction of `module`, read from the profiler's trace.json.gz (not
  the perfetto file the binary reads), keyed by each event's `hlo_op` argument."""
  path, = glob.glob(str(trace_dir / "plugins" / "profile" / "*" / "*.trace.json.gz"))
  with gzip.open(path) as f:
    events = json.load(f)["traceEvents"]
  out = collections.Counter()
  for event in events:
    args = event.get("args", {})
    if event.get("ph") == "X" and args.get("hlo_module") == module and "hlo_op" in args:
      out[args["hlo_op"]] += event["dur"] * 1e-6
  return out


def test_attribution_of_a_known_program(tmp_path):
  # The product: [n, m] x [m, n], 2 n^2 m = 268 MFLOPs; softmax and tanh: a few FLOPs on
  # each of n^2 = 65,536 elements, some 200 times fewer.
  n, m = 256, 2048
  rng = np.random.default_rng(0)
  args = [jnp.asarray(rng.standard_normal(shape, dtype=np.float32))
          for shape in ((n, m), (m, n), (n, n), (n, n))]
  executable = jax.jit(_known_program).lower(*args).compile()
  text = executable.as_text()
  kinds = profile_beam.classify(text)
  entry = _entry_instructions(text)
  # The product's instruction (the one whose called computation or own line holds the
  # c_fc dot) is a projection; the softmax's are attention; the tanh's are other.
  bodies = dict(re.findall(r"^%(\S+) .*?\{\n(.*?)\n\}", text, re.M | re.S))
  body = lambda line: bodies.get((re.findall(r"calls=%([^,\s]+)", line) or [""])[0], "")
  work = {name: line for name, line in entry.items() if " parameter(" not in line
          and " tuple(" not in line}
  product, = [name for name, line in work.items() if "c_fc" in line + body(line)]
  assert kinds[product] == "projection GEMMs"
  softmax = [name for name, line in work.items() if "/attn/" in line]
  assert softmax and all(kinds[name] == "attention" for name in softmax)
  rest = [name for name in work if name != product and name not in softmax]
  assert rest and all(kinds[name] == "other" for name in rest)

  executable(*args)[0].block_until_ready()
  module = re.match(r"HloModule (\S+?),", text).group(1)
  trace_dir = tmp_path / "trace"
  jax.profiler.start_trace(str(trace_dir), create_perfetto_trace=True)
  jax.block_until_ready(executable(*args))
  jax.profiler.stop_trace()
  spent = profile_beam.traced_seconds(str(trace_dir))
  independent = _seconds_by_hlo_op(trace_dir, module)
  # Every operation that ran is in both files with the same total.
  assert set(independent) == set(work), (set(independent), set(work))
  for name, seconds in independent.items():
    assert spent[name] == pytest.approx(seconds, rel=1e-6, abs=1e-9), name
  # The binary's attribution: seconds per kind over the classified instructions. (How the
  # time splits is the benchmark's to report, not a test's: it depends on the machine.)
  by_kind = collections.Counter()
  for name, kind in kinds.items():
    by_kind[kind] += spent.get(name, 0.0)
  assert by_kind["projection GEMMs"] == pytest.approx(independent[product], rel=1e-6)
  assert by_kind["attention"] == pytest.approx(sum(independent[s] for s in softmax), rel=1e-6)
  assert by_kind["other"] == pytest.approx(sum(independent[s] for s in rest), rel=1e-6)


def test_binary_end_to_end(tmp_path):
  k, docs, seq_len, num, width = BINARY_SHAPE
  out = tmp_path / "profile.json"
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.profile_beam", "--model=tiny", f"--docs={docs}",
       f"--cut={k}", f"--seq_len={seq_len}", f"--candidates={num}", f"--width={width}",
       "--repeats=1", "--matmul_n=64", f"--out_json={out}"],
      cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
      timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  result = json.loads(out.read_text())
  assert result["config"] == {**result["config"], "model": "tiny", "docs": docs, "cut": k,
                              "seq_len": seq_len, "candidates": num, "width": width,
                              "backend": "cpu"}
  assert result["analytic_flops"] == _counted_flops(_tiny(), *BINARY_SHAPE)
  assert set(result["by_kind_s"]) <= KINDS
  # Both blocks' projections ran and were timed, and so did attention.
  assert result["by_kind_s"]["projection GEMMs"] > 0 and result["by_kind_s"]["attention"] > 0
  assert result["warm_s"] > 0 and result["traced_op_s"] > 0
