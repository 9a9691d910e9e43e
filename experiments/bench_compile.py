"""Compile cost against model depth: a capture and an `activation,sipit` replay of a random
Llama of each depth, each in a fresh process with an empty persistent compilation cache.

  python -m experiments.bench_compile --out=/tmp/bench_compile.json
  python -m experiments.bench_compile --repos=/tmp/before,. --out=...   # two code trees
  python -m experiments.bench_compile --programs --out=...   # the model's programs alone

Per (code tree, depth) one child process (this file, `--worker`, with PYTHONPATH set to the
tree, so an older tree without this file is measured by the same harness) writes a random
Llama (d = 128, 4 query / 2 KV heads of 32, MLP 344, tied head, `--vocab` tokens) as an
hf_dir, captures `--docs` documents of `--tokens` random tokens at k = L/2 in training (h
and g), and replays activation and SipIt on it at their default budgets. It reports the
seconds of JAX's own compile events (`jax.monitoring`: backend compile, and tracing plus
lowering) and the wall seconds of each phase. The parent prints each tree's figures and the
ratio of the deepest model to the shallowest, and writes them all as JSON. The children run
one after another, interleaved by depth, so that a machine shared with other work loads
every figure of a ratio alike.

`--programs` measures the model's own programs instead, in this process: for each depth and
each form of the parameters (the HF-named tree, layers unrolled; `split.computation_form`,
one scanned layer body) the compile seconds (lower + compile) and warm seconds of the
capture's `boundary_messages` on `--docs` x `--tokens`, and of the one-token step vmapped
over 64 candidate tokens, both at k = L/2, and the h, g and step output of the two forms
against each other (max relative difference).
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from absl import app, flags

_REPOS = flags.DEFINE_list("repos", ["."], "Code trees to measure (their lla is imported).")
_LAYERS = flags.DEFINE_list("layers", ["4", "24"], "Depths L; the cut is L / 2.")
_VOCAB = flags.DEFINE_integer("vocab", 2048, "Vocabulary size of the random Llama.")
_DOCS = flags.DEFINE_integer("docs", 8, "Documents captured.")
_TOKENS = flags.DEFINE_integer("tokens", 32, "Tokens per document.")
_ATTACKS = flags.DEFINE_string("attacks", "activation,sipit", "Attacks replayed.")
_OUT = flags.DEFINE_string("out", None, "JSON file of every figure.")
_PROGRAMS = flags.DEFINE_bool("programs", False, "Measure the model's programs in-process, "
                              "named against stacked parameters.")
_WORKER = flags.DEFINE_bool("worker", False, "Internal: measure one depth in this process.")
_N_LAYER = flags.DEFINE_integer("n_layer", 4, "Internal: the worker's depth.")

COMPILE_EVENTS = {"backend_compile": "/jax/core/compile/backend_compile_duration",
                  "trace": "/jax/core/compile/jaxpr_trace_duration",
                  "lower": "/jax/core/compile/jaxpr_to_mlir_module_duration"}


def worker(n_layer: int) -> dict:
  """One depth's capture and replay in this (fresh) process; its figures."""
  import jax
  import numpy as np
  from configs import capture as capture_config, replay as replay_config
  from lla import runtime
  from lla.capture import runner
  from lla.model import decoder, hf_io
  from lla.replay import runner as replay_runner

  work = Path(tempfile.mkdtemp(prefix="bench_compile_"))
  runtime.configure(work / "jax_cache")  # empty: every executable compiles
  seconds = {name: 0.0 for name in COMPILE_EVENTS}
  counts = {name: 0 for name in COMPILE_EVENTS}
  by_event = {event: name for name, event in COMPILE_EVENTS.items()}

  def listen(event, duration, **_):
    if event in by_event:
      seconds[by_event[event]] += duration
      counts[by_event[event]] += 1

  jax.monitoring.register_event_duration_secs_listener(listen)
  cfg = decoder.DecoderConfig(family="llama", vocab_size=_VOCAB.value, n_positions=64,
                              n_embd=128, n_layer=n_layer, n_head=4, n_kv_head=2, head_dim=32,
                              d_ff=344, tie_embeddings=True)
  hf_io.save_hf_dir(decoder.random_params(cfg, 0), cfg, work / "hf")
  rng = np.random.default_rng(0)
  np.save(work / "tokens.npy", rng.integers(0, cfg.vocab_size, (_DOCS.value, _TOKENS.value),
                                            dtype=np.int32))
  np.save(work / "calibration.npy", rng.integers(0, cfg.vocab_size, (16, _TOKENS.value),
                                                 dtype=np.int32))
  phases = {}

  def phase(name, fn):
    before = dict(seconds), dict(counts)
    start = time.perf_counter()
    fn()
    phases[name] = {"wall_s": time.perf_counter() - start,
                    **{f"{k}_s": seconds[k] - before[0][k] for k in seconds},
                    **{f"{k}_count": counts[k] - before[1][k] for k in counts}}

  cap = capture_config.get_config("tiny_llama")
  cap.model.hf_dir, cap.data.tokens_npy = str(work / "hf"), str(work / "tokens.npy")
  cap.cut, cap.training, cap.batch_size = n_layer // 2, True, _DOCS.value
  phase("capture", lambda: runner.capture_from_config(cap, str(work / "cap")))
  rep = replay_config.get_config("tiny_llama")
  rep.capture_dir, rep.attacker.hf_dir = str(work / "cap"), str(work / "hf")
  rep.calibration.tokens_npy, rep.attacks = str(work / "calibration.npy"), _ATTACKS.value
  phase("replay", lambda: replay_runner.replay_from_config(rep, str(work / "run")))
  total = {key: sum(p[key] for p in phases.values()) for key in phases["capture"]}
  return {"n_layer": n_layer, "cut": n_layer // 2, "phases": phases, "total": total}


def programs(n_layer: int) -> dict:
  """Compile and warm seconds of the capture's and the one-token step's programs at depth
  `n_layer` for each form of the parameters (module docstring)."""
  import statistics
  import jax
  import jax.numpy as jnp
  import numpy as np
  from lla.model import decoder, split

  cfg = decoder.DecoderConfig(family="llama", vocab_size=_VOCAB.value, n_positions=64,
                              n_embd=128, n_layer=n_layer, n_head=4, n_kv_head=2, head_dim=32,
                              d_ff=344, tie_embeddings=True)
  k, named = n_layer // 2, decoder.random_params(cfg, 0)
  forms = {"named": named, "stacked": split.computation_form(named, cfg)}
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (_DOCS.value, _TOKENS.value)), jnp.int32)
  cache = 0.1 * jnp.asarray(rng.standard_normal(
      (k, 2, _TOKENS.value, cfg.n_kv_head, cfg.head_dim), dtype=np.float32))
  step = jax.jit(jax.vmap(split.client_step_kv, in_axes=(None, None, None, 0, None)),
                 static_argnums=1)
  work = {"boundary_messages": (split.boundary_messages, lambda p: (p, cfg, tokens, k)),
          "step_64": (step, lambda p: (p, cfg, cache, jnp.arange(64, dtype=jnp.int32),
                                       jnp.int32(_TOKENS.value // 2)))}
  out = {}
  for name, (fn, args) in work.items():
    row, results = {}, {}
    for form, params in forms.items():
      start = time.perf_counter()
      executable = fn.lower(*args(params)).compile()
      compile_s = time.perf_counter() - start
      dynamic = [a for a in args(params) if not isinstance(a, (type(cfg), int))]  # static: cfg, k
      results[form] = jax.block_until_ready(executable(*dynamic))
      times = []
      for _ in range(5):
        start = time.perf_counter()
        jax.block_until_ready(executable(*dynamic))
        times.append(time.perf_counter() - start)
      row[form] = {"compile_s": compile_s, "warm_s": statistics.median(times)}
    row["max_rel_diff"] = max(
        float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
        for a, b in zip(jax.tree.leaves(results["stacked"]), jax.tree.leaves(results["named"])))
    out[name] = row
  return out


def measure(repo: Path, n_layer: int) -> dict:
  """`worker(n_layer)` in a fresh Python process importing `repo`'s lla."""
  with tempfile.NamedTemporaryFile(suffix=".json") as out:
    env = {**os.environ, "PYTHONPATH": str(repo)}
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker",
                    f"--n_layer={n_layer}", f"--vocab={_VOCAB.value}", f"--docs={_DOCS.value}",
                    f"--tokens={_TOKENS.value}", f"--attacks={_ATTACKS.value}",
                    f"--out={out.name}"], cwd=repo, env=env, check=True)
    return json.loads(Path(out.name).read_text())


def main(argv):
  del argv
  if _WORKER.value:
    Path(_OUT.value).write_text(json.dumps(worker(_N_LAYER.value)))
    return
  depths = [int(n) for n in _LAYERS.value]
  if _PROGRAMS.value:
    results = {n_layer: programs(n_layer) for n_layer in depths}
    for n_layer, by_program in results.items():
      for name, row in by_program.items():
        print(f"L={n_layer:>3} {name:>18}: " + "  ".join(
            f"{form} compile {row[form]['compile_s']:.2f} s warm {1e3 * row[form]['warm_s']:.1f} ms"
            for form in ("named", "stacked")) + f"  max rel diff {row['max_rel_diff']:.1e}")
    if _OUT.value:
      Path(_OUT.value).write_text(json.dumps(results, indent=1))
    return
  repos = [Path(r).resolve() for r in _REPOS.value]
  results = {str(r): {} for r in repos}
  for n_layer in depths:
    for repo in repos:
      results[str(repo)][n_layer] = measure(repo, n_layer)
  summary = {}
  for repo, by_depth in results.items():
    print(f"\n{repo}")
    print(f"{'L':>4} {'backend compile s':>18} {'trace+lower s':>14} {'compiles':>9} "
          f"{'capture wall s':>15} {'replay wall s':>14} {'wall s':>8}")
    for n_layer, r in by_depth.items():
      t = r["total"]
      print(f"{n_layer:>4} {t['backend_compile_s']:>18.1f} {t['trace_s'] + t['lower_s']:>14.1f} "
            f"{t['backend_compile_count']:>9d} {r['phases']['capture']['wall_s']:>15.1f} "
            f"{r['phases']['replay']['wall_s']:>14.1f} {t['wall_s']:>8.1f}")
    low, high = by_depth[min(depths)]["total"], by_depth[max(depths)]["total"]
    summary[repo] = {"compile_ratio": high["backend_compile_s"] / low["backend_compile_s"],
                     "wall_ratio": high["wall_s"] / low["wall_s"]}
    print(f"L={max(depths)} / L={min(depths)}: compile x{summary[repo]['compile_ratio']:.2f}, "
          f"wall x{summary[repo]['wall_ratio']:.2f}")
  if _OUT.value:
    Path(_OUT.value).write_text(json.dumps(
        {"vocab": _VOCAB.value, "docs": _DOCS.value, "tokens": _TOKENS.value,
         "attacks": _ATTACKS.value, "results": results, "ratios": summary}, indent=1))


if __name__ == "__main__":
  app.run(main)
