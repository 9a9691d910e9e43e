"""Compile cost against model depth: a capture and an `activation,sipit` replay of a random
Llama of each depth, each in a fresh process with an empty persistent compilation cache.

  python -m experiments.bench_compile --out=/tmp/bench_compile.json
  python -m experiments.bench_compile --repos=/tmp/before,. --out=...   # two code trees

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
  repos = [Path(r).resolve() for r in _REPOS.value]
  depths = [int(n) for n in _LAYERS.value]
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
