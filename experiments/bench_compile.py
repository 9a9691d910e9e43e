"""Compile cost against model depth: a capture and an `activation,sipit` replay of a random
Llama of each depth, each in a fresh process with an empty persistent compilation cache.

  python -m experiments.bench_compile --out=/tmp/bench_compile.json
  python -m experiments.bench_compile --repos=/tmp/before,. --out=...   # two code trees
  python -m experiments.bench_compile --programs --out=...   # the model's programs alone
  python -m experiments.bench_compile --forms --out=...      # attacks, named against stacked

Per (code tree, depth) one child process (this file, `--worker`, with PYTHONPATH set to the
tree, so an older tree without this file is measured by the same harness) writes a random
Llama (d = 128, 4 query / 2 KV heads of 32, MLP 344, tied head, `--vocab` tokens) as an
hf_dir, captures `--docs` documents of `--tokens` random tokens at k = L/2 in training (h
and g), and replays activation and SipIt on it at their default budgets, the replay's
layers in `--layer_form` (a tree whose replay config has that field). It reports the
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

`--forms` measures what the attacks' workspace gains or loses by running the model on the
stacked layers (`Workspace.layer_form`, "scanned" against "unrolled"): for each shape of
`--shapes` (`embedded`, the main job's GPT-2, d 128, 8 layers, GPT-2's vocabulary;
`gpt2_124m`, 12 layers, d 768; `smollm2`, SmolLM2-135M's Llama, 30 layers, d 576, 49,152
tokens; random weights) and each
form, one fresh process (empty compilation cache) runs each attack of `--attacks` on the
messages of `--docs` x `--tokens` random tokens at k = `--cut`, 1 + `--warm_repeats` times on fresh
workspaces: the first run's wall and compile seconds (its charge's), the fastest of the
others (warm), its FLOPs and the sha256 of its predictions. The processes run one after the other, the unrolled
form first.
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
_FORMS = flags.DEFINE_bool("forms", False, "Measure attacks with the workspace's layers "
                           "unrolled against scanned (Workspace.layer_form), per shape.")
_LAYER_FORM = flags.DEFINE_string("layer_form", "scanned", "The replay's layer_form (a code "
                                  "tree whose replay config has the field).")
_SHAPES = flags.DEFINE_list("shapes", ["embedded", "smollm2"], "--forms: model shapes.")
_CUT = flags.DEFINE_integer("cut", 6, "--forms: the cut k.")
_WARM_REPEATS = flags.DEFINE_integer("warm_repeats", 3, "--forms: warm runs (the fastest "
                                     "is reported).")
_WORKER = flags.DEFINE_bool("worker", False, "Internal: measure one depth in this process.")
_N_LAYER = flags.DEFINE_integer("n_layer", 4, "Internal: the worker's depth.")
_FORMS_WORKER = flags.DEFINE_string("forms_worker", "", "Internal: SHAPE:LAYER_FORM of one "
                                    "--forms process.")

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
  if "layer_form" in rep:
    rep.layer_form = _LAYER_FORM.value
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


def forms_worker(shape: str, layer_form: str) -> dict:
  """`--forms`: each attack twice on fresh workspaces, in this (fresh) process."""
  import hashlib
  import jax
  import jax.numpy as jnp
  import numpy as np
  from lla import runtime
  from lla.attacks import registry
  from lla.attacks.workspace import Workspace
  from lla.model import decoder, gpt2, split

  runtime.configure(Path(tempfile.mkdtemp(prefix="bench_forms_")) / "jax_cache")
  if shape in ("embedded", "gpt2_124m"):
    width, depth, heads = (128, 8, 4) if shape == "embedded" else (768, 12, 12)
    cfg = gpt2.GPT2Config(vocab_size=50257, n_positions=128, n_embd=width, n_layer=depth,
                          n_head=heads)
    params = gpt2.random_params(cfg, 0)
  elif shape == "smollm2":
    cfg = decoder.DecoderConfig(family="llama", vocab_size=49152, n_positions=2048,
                                n_embd=576, n_layer=30, n_head=9, n_kv_head=3, head_dim=64,
                                d_ff=1536, rope_theta=1e5, tie_embeddings=True)
    params = decoder.random_params(cfg, 0)
  else:
    raise app.UsageError(f"--shapes: {shape!r} is not one of embedded, gpt2_124m, smollm2")
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.vocab_size, (_DOCS.value, _TOKENS.value), dtype=np.int32)
  calibration = rng.integers(0, cfg.vocab_size, (32, _TOKENS.value), dtype=np.int32)
  h = np.asarray(split.client(params, cfg, jnp.asarray(tokens), _CUT.value))
  out = {}
  for name in _ATTACKS.value.split(","):
    runs = []
    for _ in range(1 + _WARM_REPEATS.value):
      ws = Workspace(h, None, params, cfg, _CUT.value, calibration, layer_form=layer_form)
      start = time.perf_counter()
      result, charge = registry.execute(name, ws, {}, jax.random.key(0))
      runs.append({"wall_s": time.perf_counter() - start, "compile_s": charge.compile_s,
                   "flops": charge.flops, "predictions_sha256": hashlib.sha256(
                       np.asarray(result.predictions, np.int32).tobytes()).hexdigest()})
    out[name] = {"first": runs[0], "warm": min(runs[1:], key=lambda run: run["wall_s"])}
  return out


def measure_forms(shape: str, layer_form: str) -> dict:
  """`forms_worker` in a fresh Python process."""
  with tempfile.NamedTemporaryFile(suffix=".json") as out:
    subprocess.run([sys.executable, str(Path(__file__).resolve()),
                    f"--forms_worker={shape}:{layer_form}", f"--docs={_DOCS.value}",
                    f"--tokens={_TOKENS.value}", f"--attacks={_ATTACKS.value}",
                    f"--cut={_CUT.value}", f"--warm_repeats={_WARM_REPEATS.value}",
                    f"--out={out.name}"], check=True,
                   cwd=Path(__file__).resolve().parents[1])
    return json.loads(Path(out.name).read_text())


def forms() -> dict:
  """`--forms` for every shape: {shape: {"named" | "stacked": {attack: runs}}}; printed."""
  results = {}
  for shape in _SHAPES.value:
    results[shape] = {form: measure_forms(shape, layer_form)
                      for form, layer_form in (("named", "unrolled"), ("stacked", "scanned"))}
    for name in _ATTACKS.value.split(","):
      named, stacked = results[shape]["named"][name], results[shape]["stacked"][name]
      same = named["warm"]["predictions_sha256"] == stacked["warm"]["predictions_sha256"]
      print(f"{shape:>9} {name:>11}: first call {named['first']['wall_s']:.1f} / "
            f"{stacked['first']['wall_s']:.1f} s (compile {named['first']['compile_s']:.1f} / "
            f"{stacked['first']['compile_s']:.1f}), warm {named['warm']['wall_s']:.2f} / "
            f"{stacked['warm']['wall_s']:.2f} s "
            f"(x{stacked['warm']['wall_s'] / named['warm']['wall_s']:.2f}), "
            f"FLOPs x{stacked['warm']['flops'] / named['warm']['flops']:.4f}, "
            f"predictions {'identical' if same else 'DIFFER'} (named / stacked)")
  return results


def measure(repo: Path, n_layer: int) -> dict:
  """`worker(n_layer)` in a fresh Python process importing `repo`'s lla."""
  with tempfile.NamedTemporaryFile(suffix=".json") as out:
    env = {**os.environ, "PYTHONPATH": str(repo)}
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker",
                    f"--n_layer={n_layer}", f"--vocab={_VOCAB.value}", f"--docs={_DOCS.value}",
                    f"--tokens={_TOKENS.value}", f"--attacks={_ATTACKS.value}",
                    f"--layer_form={_LAYER_FORM.value}", f"--out={out.name}"], cwd=repo, env=env,
                   check=True)
    return json.loads(Path(out.name).read_text())


def main(argv):
  del argv
  if _WORKER.value:
    Path(_OUT.value).write_text(json.dumps(worker(_N_LAYER.value)))
    return
  if _FORMS_WORKER.value:
    shape, layer_form = _FORMS_WORKER.value.split(":")
    Path(_OUT.value).write_text(json.dumps(forms_worker(shape, layer_form)))
    return
  if _FORMS.value:
    results = forms()
    if _OUT.value:
      Path(_OUT.value).write_text(json.dumps(
          {"docs": _DOCS.value, "tokens": _TOKENS.value, "cut": _CUT.value,
           "attacks": _ATTACKS.value, "results": results}, indent=1))
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
