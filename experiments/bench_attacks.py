"""Benchmark: lla's attacks on one capture (FLOPs, wall time, recovery), against PyTorch.

A GPT-2 124M configuration with random weights (or, with --checkpoint, a stored lla
checkpoint attacked on its evaluation documents), cut k, B documents of T tokens, captured
in training mode (h and g) and read as an inference capture too (h alone). Each attack runs
through `registry.execute` on a fresh `Workspace` twice: cold (compilation included) and
warm (every executable already compiled). Reported per capture and attack:

  * recovery (tokens, exact documents), FLOPs (the workspace meter: XLA's cost analysis of
    what ran, every shared stage charged in full; and the analytic count), FLOPs and warm
    wall time per document, both as a ratio to the activation beam search on the same
    capture, compile seconds, warm seconds per stage, achieved FLOP/s; SipIt's acceptance
    statistics; `jax_compile` of the cold and of the warm run (lla.runtime.compile_meter:
    JAX's own compile events, executables built and loaded from the persistent cache);
  * the machine's float32 matmul FLOP/s (jax and torch);
  * the beam searches written plainly in PyTorch with transformers' GPT-2 on the same
    candidates (training capture), on JAX's device (the GPU, when JAX runs on one) at
    JAX's matmul precision: once recomputing every (beam, candidate) prefix, once
    with a `past_key_values` cache; per-document times, token agreement with lla;
  * cold starts (--cold_start, on the first capture): each attack once in a FIRST fresh
    process whose persistent compilation cache (lla.runtime, $LLA_COMPILATION_CACHE_DIR)
    is an empty temporary directory, then in a SECOND fresh process on the same, now
    populated, directory; their cold times against the warm in-process time, and the
    second process's overhead (second cold - warm) as a fraction of warm, and each
    probe's `jax_compile` (the second's executables all loaded from the cache). The probes
    re-invoke this binary (--cold_probe) on the same checkpoint and capture, written once
    to a temporary directory. The main process itself keeps the persistent cache off, so
    that its in-process cold time is a compilation from scratch (a later attack's still
    reuses the executables an earlier one compiled in the process);
  * on GPU and TPU, `lla_kernels.vocab_topk` (the platform's Pallas kernel) against its
    reference at --kernel_rows x --kernel_d x --kernel_vocab, top --kernel_k (kernels.compare;
    experiments/bench_kernels.py has the CPU interpret-mode check).

--device=auto runs on JAX's default backend; cpu, gpu or tpu select that platform.

  python -m experiments.bench_attacks --batch 16 --torch_batch 4 --torch_nocache_batch 1 \
      --out_json /tmp/bench.json
  # SipIt against the beam search, 8 documents, no PyTorch side:
  python -m experiments.bench_attacks --batch 8 --attacks activation,sipit --torch_batch 0 \
      --torch_nocache_batch 0 --out_json /tmp/bench_sipit.json
  # The embedded model (the main job's fine-tuned target):
  LLA_DATA_DIR=/work/shared/data python -m experiments.bench_attacks --batch 32 \
      --checkpoint /tmp/bl/run/finetune/k6_public/seed_0 --attacks activation,joint,sipit \
      --torch_batch 0 --torch_nocache_batch 0
  # A tiny random model (what tests/test_bench_attacks.py runs):
  python -m experiments.bench_attacks --random_config=n_embd=32,n_layer=2,n_head=2,vocab_size=101 \
      --cut=1 --batch=2 --seq_len=8 --calibration=8 --attacks=activation,joint \
      --captures=training --torch_batch=0 --torch_nocache_batch=0 --matmul_n=64

torch is imported inside this benchmark only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
import subprocess
import sys
import tempfile
import time

from absl import app, flags, logging
import jax
import jax.extend.backend
import jax.numpy as jnp
import numpy as np

from lla_kernels import compare as kernel_compare
from lla_kernels import vocab_topk
from lla import runtime
from lla.attacks import budget as budget_lib
from lla.attacks import candidates as cand_lib
from lla.attacks import registry
from lla.evidence import files
from lla.attacks.workspace import Workspace, document_mesh
from lla.model import checkpoint, hf_io, split
from lla.model.gpt2 import GPT2Config, random_params

_BATCH = flags.DEFINE_integer("batch", 256, "Documents attacked by lla (paper: 256).")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 32, "Tokens per document T.")
_CUT = flags.DEFINE_integer("cut", 6, "Cut k.")
_CAPTURE_BATCH = flags.DEFINE_integer("capture_batch", 32, "Documents per captured step.")
_TORCH_BATCH = flags.DEFINE_integer("torch_batch", 32,
                                    "Documents for the cached PyTorch search (0: skip).")
_TORCH_NOCACHE_BATCH = flags.DEFINE_integer(
    "torch_nocache_batch", -1, "Documents for the uncached PyTorch search (-1: torch_batch).")
_CALIBRATION = flags.DEFINE_integer("calibration", 32, "Calibration documents.")
_ATTACKS = flags.DEFINE_list("attacks", ["activation", "joint", "sipit"],
                             "Attacks to run (those that fit each capture).")
_CAPTURES = flags.DEFINE_list("captures", ["training", "inference"],
                              "training: h and g; inference: the same h alone.")
_BUDGET = flags.DEFINE_list("budget", [], "Budget fields as name=value (defaults otherwise).")
_CHECKPOINT = flags.DEFINE_string(
    "checkpoint", "", "An lla checkpoint to attack on its evaluation documents ($LLA_DATA_DIR) "
    "instead of the random-weight GPT-2 124M.")
_MATMUL_N = flags.DEFINE_integer("matmul_n", 2048, "Size of the peak-FLOP/s matmul probe.")
_OUT_JSON = flags.DEFINE_string("out_json", "", "Where to write the results (JSON).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of weights and tokens.")
_DEVICE = flags.DEFINE_enum("device", "auto", ["auto", "cpu", "gpu", "tpu"],
                            "Where to run: auto = JAX's default backend.")
_RANDOM_CONFIG = flags.DEFINE_list(
    "random_config", [], "GPT2Config fields of the random-weight model as name=value "
    "(default: GPT-2 124M), e.g. n_embd=32,n_layer=2,n_head=2,vocab_size=101.")
_COLD_START = flags.DEFINE_bool(
    "cold_start", True, "Time each attack in a first and a second fresh process (empty, then "
    "populated persistent compilation cache).")
_KERNEL_ROWS = flags.DEFINE_integer("kernel_rows", 8192, "GPU/TPU kernel check: query rows "
                                    "(B*T positions).")
_KERNEL_D = flags.DEFINE_integer("kernel_d", 768, "GPU/TPU kernel check: row width d.")
_KERNEL_VOCAB = flags.DEFINE_integer("kernel_vocab", 50257, "GPU/TPU kernel check: table rows V.")
_KERNEL_K = flags.DEFINE_integer("kernel_k", 32, "GPU/TPU kernel check: rows kept per query.")
_KERNEL_KINDS = flags.DEFINE_list("kernel_kinds", ["neg_sq_dist", "neg_dot"],
                                  "GPU/TPU kernel check: score kinds.")
_KERNEL_REPEATS = flags.DEFINE_integer("kernel_repeats", 3, "GPU/TPU kernel check: timed calls.")
# Internal: the cold-start probe this binary runs in a subprocess of itself.
_COLD_PROBE = flags.DEFINE_string("cold_probe", "", "Internal: run this attack once on the "
                                  "capture in --probe_dir and write its time to --probe_out.")
_PROBE_DIR = flags.DEFINE_string("probe_dir", "", "Internal: the cold-start probe's inputs.")
_PROBE_OUT = flags.DEFINE_string("probe_out", "", "Internal: the cold-start probe's result.")

REPO_ROOT = Path(__file__).resolve().parents[1]

REFERENCE = "activation"  # the ratios' denominator


def select_device(name: str) -> jax.Device:
  """The first device of platform `name` ("auto": JAX's default backend). An explicit
  platform is set before JAX starts its backends, so that every computation runs there."""
  if name == "auto":
    return jax.devices()[0]
  jax.config.update("jax_platforms", name)
  try:
    return jax.devices()[0]
  except RuntimeError:
    jax.config.update("jax_platforms", "")
    jax.extend.backend.clear_backends()
    present = sorted({d.platform for d in jax.devices()})
    raise SystemExit(f"no {name} device: jax.devices() lists {', '.join(present)} only") from None




def _timed(fn, repeats=1):
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    out = fn()
    jax.block_until_ready(out)
    best = min(best, time.perf_counter() - start)
  return out, best


def torch_on(platform: str) -> str:
  """The PyTorch device beside JAX's: the GPU when JAX runs on one (and torch sees it), at
  the float32 matmul precision lla.runtime set for JAX, so both sides do the same
  arithmetic."""
  import torch
  mode = runtime.precision_record()["matmul_precision"]
  torch.set_float32_matmul_precision(
      {"float32": "highest", "tensorfloat32": "high", "bfloat16": "medium"}[mode])
  return "cuda" if platform == "gpu" and torch.cuda.is_available() else "cpu"


def matmul_flops(n: int, torch_device: str) -> dict:
  import torch
  a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n), dtype=np.float32))
  mm = jax.jit(lambda x, y: x @ y)
  mm(a, a).block_until_ready()
  _, t_jax = _timed(lambda: mm(a, a), repeats=5)
  ta = torch.from_numpy(np.array(a)).to(torch_device)
  sync = torch.cuda.synchronize if torch_device == "cuda" else lambda: None
  torch.mm(ta, ta)
  sync()
  best = float("inf")
  for _ in range(5):
    start = time.perf_counter()
    torch.mm(ta, ta)
    sync()
    best = min(best, time.perf_counter() - start)
  flops = 2.0 * n**3
  return {"n": n, "jax_flops_per_s": flops / t_jax, "torch_flops_per_s": flops / best,
          "torch_device": torch_device, "torch_threads": torch.get_num_threads()}


def lla_attack(name: str, make_ws, budget: dict, truth: np.ndarray) -> dict:
  """The attack cold (compiling) then warm, each on a fresh workspace of the capture."""
  runs, spent = [], {}
  for which in ("cold", "warm"):
    ws = make_ws()
    start = time.perf_counter()
    with runtime.compile_meter() as spent[which]:
      result, charge = registry.execute(name, ws, budget, jax.random.key(0))
    runs.append((result, charge, time.perf_counter() - start, ws))
  (cold, cold_charge, cold_s, _), (warm, charge, warm_s, ws) = runs
  if not np.array_equal(cold.predictions, warm.predictions):
    raise AssertionError(f"{name}: the warm run's predictions differ from the cold run's")
  b = truth.shape[0]
  row = {"attack": name, "docs": b,
         "token_recovery": float(np.mean(warm.predictions == truth)),
         "exact_documents": float(np.mean(np.all(warm.predictions == truth, axis=1))),
         "flops": charge.flops, "flops_source": charge.flops_source,
         "flops_analytic": charge.flops_analytic, "flops_per_doc": charge.flops / b,
         "cold_s": cold_s, "compile_s": cold_charge.compile_s, "warm_s": warm_s,
         "jax_compile": spent,
         "warm_s_per_doc": warm_s / b, "achieved_flops_per_s": charge.flops / warm_s,
         "predictions_sha256": files.int32_sha256(warm.predictions),
         "warm_stage_s": {s: c["wall_s"] for s, c in charge.stages.items()},
         "stage_flops": {s: c["flops"] for s, c in charge.stages.items()}}
  if name == "sipit":
    row["details"] = warm.details
  return row, warm.predictions, ws


def beam_candidates(name: str, ws: Workspace, budget: dict) -> np.ndarray:
  """The candidates a beam attack searched (its stages are cached in `ws`)."""
  values = {**budget_lib.defaults(), **budget}
  if name == "activation":
    return ws.activation_ranked(int(values["candidates"]))
  c_a, c_g = int(values["c_a"]), int(values["c_g"])
  act = ws.activation_ranked(c_a + c_g)
  grad = ws.gradient_ranked(c_a + c_g, ws.gradients, "gradient_ranking")
  return np.asarray(cand_lib.joint_candidates(act, grad, c_a=c_a, c_g=c_g))


def torch_beam(model, h: np.ndarray, cands: np.ndarray, width: int, cached: bool) -> np.ndarray:
  """The pinned beam search, plainly, batched over documents, on the model's device.
  model: truncated GPT2Model."""
  import torch
  n, t_len, c = cands.shape
  dev = model.device
  target = torch.from_numpy(h).to(dev)
  cand = torch.from_numpy(cands.astype(np.int64)).to(dev)
  scores = torch.full((n, width), float("inf"), device=dev)
  scores[:, 0] = 0.0
  tokens = torch.zeros((n, width, t_len), dtype=torch.long, device=dev)
  cache = None
  rows = torch.arange(n, device=dev)[:, None]
  with torch.inference_mode():
    for t in range(t_len):
      step_c = cand[:, t]                                             # [n, C]
      if cached:
        ids = step_c[:, None, :].expand(n, width, c).reshape(-1, 1)   # [n*W*C, 1]
        if cache is not None:
          cache.batch_repeat_interleave(c)
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        h_t = out.last_hidden_state[:, -1]
      else:
        prefix = tokens[:, :, :t][:, :, None, :].expand(n, width, c, t)
        ids = torch.cat([prefix, step_c[:, None, :, None].expand(n, width, c, 1)], -1)
        h_t = model(input_ids=ids.reshape(-1, t + 1)).last_hidden_state[:, -1]
      cost = ((h_t.reshape(n, width, c, -1) - target[:, t][:, None, None]) ** 2).sum(-1)
      total = (scores[:, :, None] + cost).reshape(n, width * c)        # beam-major
      order = torch.sort(total, dim=-1, stable=True).indices[:, :width]
      beam_idx, rank = order // c, order % c
      scores = torch.gather(total, 1, order)
      tokens = tokens[rows, beam_idx].clone()
      tokens[:, :, t] = step_c[rows, rank]
      if cached:
        cache.batch_select_indices((rows * width * c + order).reshape(-1))
  return tokens[:, 0].cpu().numpy()  # .cpu() waits for the GPU: the clock stops after


def torch_side(hf_dir: str, cut: int, beams: dict, h: np.ndarray, width: int,
               docs_cached: int, docs_nocache: int, torch_device: str) -> dict:
  """beams: {attack: (candidates [B, T, C], lla predictions [B, T])}."""
  import torch
  from transformers import GPT2LMHeadModel
  torch.set_num_threads(os.cpu_count() or 1)
  full = GPT2LMHeadModel.from_pretrained(hf_dir, attn_implementation="eager").eval()
  full.to(torch_device)
  model = full.transformer
  model.h = model.h[:cut]          # the client: first k blocks, no ln_f
  model.ln_f = torch.nn.Identity()
  # Warm-up: one document through both variants, so that torch's one-time start-up costs
  # (allocator, kernel selection) are not billed to the first timed run.
  first_cands = next(iter(beams.values()))[0]
  for cached in (True, False):
    torch_beam(model, h[:1], first_cands[:1], width, cached)
  out = {}
  for name, (cands, lla_preds) in beams.items():
    for cached, docs in ((True, docs_cached), (False, docs_nocache)):
      if docs <= 0:
        continue
      start = time.perf_counter()
      preds = torch_beam(model, h[:docs], cands[:docs], width, cached)
      wall = time.perf_counter() - start
      key = f"{name}/{'cached' if cached else 'recompute'}"
      out[key] = {"docs": docs, "wall_s": wall, "per_doc_s": wall / docs,
                  "agreement": float(np.mean(preds == lla_preds[:docs]))}
      logging.info("torch %s: %d docs in %.1fs, agreement %.4f", key, docs, wall,
                   out[key]["agreement"])
  return out


def target_model(seed: int):
  """(params, cfg, documents [B, T], calibration [N, T], model name)."""
  b, t = _BATCH.value, _SEQ_LEN.value
  if _CHECKPOINT.value:
    from lla.data import load_splits  # pylint: disable=g-import-not-at-top
    ckpt = checkpoint.restore(_CHECKPOINT.value)
    splits = load_splits(seq_len=t, n_calibration=_CALIBRATION.value, n_eval=b, seed=seed)
    return (ckpt.params, ckpt.cfg, np.asarray(splits.evaluation.tokens[:b], np.int32),
            np.asarray(splits.calibration.tokens, np.int32), f"checkpoint {ckpt.sha256[:12]}")
  overrides = {}
  for item in _RANDOM_CONFIG.value:
    name, _, value = item.partition("=")
    if name.strip() not in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
      raise SystemExit(f"--random_config: {name!r} is not an integer GPT2Config field")
    overrides[name.strip()] = int(value)
  cfg = GPT2Config(**overrides)
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, cfg.vocab_size, (b, t)).astype(np.int32)
  cal = rng.integers(0, cfg.vocab_size, (_CALIBRATION.value, t)).astype(np.int32)
  name = "gpt2_124m_random" if not overrides else "gpt2_random(" + ",".join(
      _RANDOM_CONFIG.value) + ")"
  return random_params(cfg, seed), cfg, tokens, cal, name


def kernel_comparison(device: jax.Device) -> dict:
  """vocab_topk's Pallas kernel against its reference on `device` (GPU or TPU), at the
  process's matmul precision (the attacks'); on CPU a line saying where the check is."""
  if device.platform == "cpu":
    note = ("the Pallas kernel of lla_kernels.vocab_topk against its reference needs an "
            "accelerator; on CPU its interpret-mode comparison is in "
            "tests/test_kernels_vocab_topk.py (and experiments/bench_kernels.py)")
    print(f"kernel: {note}")
    return {"skipped": note}
  rows, d, vocab, k = _KERNEL_ROWS.value, _KERNEL_D.value, _KERNEL_VOCAB.value, _KERNEL_K.value
  precision = vocab_topk.matmul_precision()
  x, table = kernel_compare.inputs(device, rows, d, vocab, _SEED.value)
  out = {"rows": rows, "d": d, "vocab": vocab, "k": k, "precision": precision, "kinds": {}}
  print(f"\nkernel: vocab_topk(impl=platform) against the reference, {rows} x {vocab} scores "
        f"(d={d}, k={k}), precision {precision}")
  print(f"{'kind':13s}{'method':8s}{'best s':>9s}{'median s':>10s}{'compile s':>10s}"
        f"{'positions':>11s}{'rows':>8s}{'max |dv|':>10s}")
  with jax.default_device(device):
    for kind in _KERNEL_KINDS.value:
      runs = kernel_compare.compare(x, table, k, kind, precision, _KERNEL_REPEATS.value,
                                    impl="platform")
      for name, run in runs.items():
        del run["out"]
        a = run["agreement"]
        print(f"{kind:13s}{name:8s}{run['best_s']:9.4f}{run['median_s']:10.4f}"
              f"{run['compile_s']:10.2f}{a['positions_equal']:11.5f}{a['rows_equal']:8.4f}"
              f"{a['max_abs_value_diff']:10.2g}")
      runs["speedup"] = runs["xla"]["best_s"] / runs["topk"]["best_s"]
      out["kinds"][kind] = runs
  return out


def cold_probe(name: str, probe_dir: Path, out_path: Path, capture: str):
  """The probe process: `name` once on the stored capture, cold (compilation included,
  through the persistent cache that lla.runtime points at $LLA_COMPILATION_CACHE_DIR)."""
  runtime.configure()
  registry.load_builtin()
  spec = json.loads((probe_dir / "spec.json").read_text())
  arrays = np.load(probe_dir / "capture.npz")
  ckpt = checkpoint.restore(spec["checkpoint"])
  ws = Workspace(arrays["h"], arrays["g"] if capture == "training" else None, ckpt.params,
                 ckpt.cfg, spec["cut"], arrays["calibration"], mesh=document_mesh(),
                 batch_docs=arrays["batch_docs"])
  start = time.perf_counter()
  with runtime.compile_meter() as spent:
    result, charge = registry.execute(name, ws, spec["budget"], jax.random.key(0))
  cold_s = time.perf_counter() - start
  truth = arrays["tokens"]
  out = {"attack": name, "capture": capture, "cold_s": cold_s, "compile_s": charge.compile_s,
         "jax_compile": spent,
         "token_recovery": float(np.mean(result.predictions == truth)),
         "exact_documents": float(np.mean(np.all(result.predictions == truth, axis=1))),
         "predictions_sha256": files.int32_sha256(result.predictions)}
  out_path.write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")


def cold_starts(work: Path, capture: str, rows: dict, platform: str) -> None:
  """Adds `cold_start` to each row: a first and a second probe process on one fresh
  persistent-cache directory per attack (module docstring)."""
  for name, row in rows.items():
    cache = work / f"cache_{name}"
    env = {**os.environ, runtime.ENV_VAR: str(cache)}
    runs = {}
    for which in ("first", "second"):
      out = work / f"probe_{name}_{which}.json"
      start = time.perf_counter()
      proc = subprocess.run(
          [sys.executable, "-m", "experiments.bench_attacks", f"--cold_probe={name}",
           f"--probe_dir={work}", f"--probe_out={out}", f"--captures={capture}",
           f"--device={platform}"], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
      if proc.returncode:
        raise RuntimeError(f"cold-start probe {name} ({which} process) failed:\n"
                           f"{proc.stderr[-4000:]}")
      runs[which] = {**json.loads(out.read_text()), "process_s": time.perf_counter() - start}
      if which == "first":
        runs[which]["cache_entries_written"] = sum(1 for _ in cache.iterdir())
      if runs[which]["predictions_sha256"] != row["predictions_sha256"]:
        raise AssertionError(f"{name}: the {which} probe process's predictions differ from "
                             "the in-process run's")
    overhead = runs["second"]["cold_s"] - row["warm_s"]
    row["cold_start"] = {**runs, "second_overhead_s": overhead,
                         "second_overhead_fraction": overhead / row["warm_s"]}
    logging.info("cold start %s %s: %s", capture, name, row["cold_start"])


def main(argv):
  del argv
  device = select_device(_DEVICE.value)
  if _COLD_PROBE.value:
    cold_probe(_COLD_PROBE.value, Path(_PROBE_DIR.value), Path(_PROBE_OUT.value),
               _CAPTURES.value[0])
    return
  # The persistent compilation cache stays off in this process, so that its cold runs
  # compile from scratch; the cold-start probes measure the cache.
  runtime.configure_matmul_precision()
  with tempfile.TemporaryDirectory(prefix="bench_attacks_") as work:
    bench(Path(work), device)


def write_probe_inputs(work: Path, params, cfg, k: int, budget: dict, arrays: dict) -> None:
  """The checkpoint (the random one written once; a --checkpoint is used in place), the
  capture and the run's settings, for the cold-start probes."""
  path = _CHECKPOINT.value
  if not path:
    path = str(work / "checkpoint")
    checkpoint.save(path, params, cfg, export_hf=False)
  np.savez(work / "capture.npz", **arrays)
  (work / "spec.json").write_text(json.dumps({"checkpoint": path, "cut": k, "budget": budget}))


def bench(work: Path, device: jax.Device):
  k = _CUT.value
  registry.load_builtin()
  budget = budget_lib.parse_items(_BUDGET.value)
  params, cfg, tokens, cal, model_name = target_model(_SEED.value)
  b, t = tokens.shape
  hs, gs, batch_docs = [], [], []
  step = _CAPTURE_BATCH.value
  for s in range(0, b, step):
    h, g = split.boundary_messages(params, cfg, jnp.asarray(tokens[s:s + step]), k)
    hs.append(np.asarray(h))
    gs.append(np.asarray(g))
    batch_docs += [len(h)] * len(h)
  h, g = np.concatenate(hs), np.concatenate(gs)
  mesh = document_mesh()
  captures = {"training": g, "inference": None}
  if _COLD_START.value:
    write_probe_inputs(work, params, cfg, k, budget, {
        "h": h, "g": g, "tokens": tokens, "calibration": cal,
        "batch_docs": np.asarray(batch_docs, np.int32)})

  torch_device = torch_on(device.platform)
  peak = matmul_flops(_MATMUL_N.value, torch_device)
  logging.info("matmul: %s", peak)
  results, beams = {}, {}
  for capture in _CAPTURES.value:
    gradients = captures[capture]
    observed = {"activations"} | ({"gradients"} if gradients is not None else set())
    make_ws = lambda: Workspace(h, gradients, params, cfg, k, cal, mesh=mesh,
                                batch_docs=np.asarray(batch_docs, np.int32))
    rows = {}
    for name in _ATTACKS.value:
      if not registry.fits(registry.get(name).spec, observed, "public", "none"):
        continue
      rows[name], preds, ws = lla_attack(name, make_ws, budget, tokens)
      logging.info("%s %s: %s", capture, name, {key: v for key, v in rows[name].items()
                                                 if key != "details"})
      if capture == "training" and name in ("activation", "joint"):
        beams[name] = (beam_candidates(name, ws, budget), preds)
    reference = rows.get(REFERENCE)
    for row in rows.values():
      if reference:
        row["flops_ratio"] = row["flops"] / reference["flops"]
        row["warm_s_ratio"] = row["warm_s"] / reference["warm_s"]
    results[capture] = rows
  cold_capture = next(iter(results), None)
  if _COLD_START.value and cold_capture:
    cold_starts(work, cold_capture, results[cold_capture], device.platform)

  torch_runs = {}
  nocache = _TORCH_NOCACHE_BATCH.value
  nocache = _TORCH_BATCH.value if nocache < 0 else nocache
  width = int({**budget_lib.defaults(), **budget}["beam_width"])
  if beams and (_TORCH_BATCH.value > 0 or nocache > 0):
    with tempfile.TemporaryDirectory(prefix="bench_attacks_") as tmp:
      hf_io.save_hf_dir(params, cfg, tmp)
      torch_runs = torch_side(tmp, k, beams, h, width, _TORCH_BATCH.value, nocache,
                              torch_device)

  print(f"\n{model_name} (d={cfg.n_embd}, L={cfg.n_layer}, V={cfg.vocab_size}), k={k}, T={t}, "
        f"B={b} on {device.device_kind} ({device.platform}, {len(jax.devices())} device(s)); "
        f"jax matmul {peak['jax_flops_per_s'] / 1e9:.1f} GFLOP/s, torch matmul "
        f"{peak['torch_flops_per_s'] / 1e9:.1f} GFLOP/s on {torch_device} ({peak['n']}^3 "
        "float32)")
  print(f"{'capture':10s}{'attack':12s}{'tokens':>8s}{'exact':>7s}{'GFLOP/doc':>11s}"
        f"{'x ' + REFERENCE:>14s}{'warm s/doc':>11s}{'x ' + REFERENCE:>14s}{'compile s':>10s}"
        f"{'GFLOP/s':>9s}")
  for capture, rows in results.items():
    for name, row in rows.items():
      ratio = lambda key: f"{row[key]:.3f}" if key in row else "-"
      print(f"{capture:10s}{name:12s}{100 * row['token_recovery']:7.2f}%"
            f"{100 * row['exact_documents']:6.1f}%{row['flops_per_doc'] / 1e9:11.2f}"
            f"{ratio('flops_ratio'):>14s}{row['warm_s_per_doc']:11.3f}{ratio('warm_s_ratio'):>14s}"
            f"{row['compile_s']:10.1f}{row['achieved_flops_per_s'] / 1e9:9.1f}")
  if _COLD_START.value and cold_capture:
    print(f"cold starts ({cold_capture} capture): a fresh process with an empty, then a second "
          "with the populated, persistent compilation cache, against warm in-process")
    print(f"{'attack':12s}{'1st cold s':>11s}{'2nd cold s':>11s}{'warm s':>9s}"
          f"{'2nd - warm':>11s}{'/ warm':>8s}{'1st compile':>12s}{'2nd compile':>12s}"
          f"{'in-proc cold':>13s}{'1st XLA s':>10s}{'1st exec':>9s}{'2nd hits':>9s}"
          f"{'2nd compiled':>13s}")
    for name, row in results[cold_capture].items():
      c = row["cold_start"]
      first, second = c["first"]["jax_compile"], c["second"]["jax_compile"]
      print(f"{name:12s}{c['first']['cold_s']:11.2f}{c['second']['cold_s']:11.2f}"
            f"{row['warm_s']:9.2f}{c['second_overhead_s']:11.2f}"
            f"{100 * c['second_overhead_fraction']:7.1f}%{c['first']['compile_s']:12.2f}"
            f"{c['second']['compile_s']:12.2f}{row['cold_s']:13.2f}"
            f"{first['seconds']:10.2f}{first['executables']:9d}{second['cache_hits']:9d}"
            f"{second['compiled']:13d}")
  for capture, rows in results.items():
    if "sipit" in rows:
      d = rows["sipit"]["details"]
      print(f"sipit {capture}: acceptance {100 * d['acceptance_rate']:.2f}%, tolerance "
            f"{d['tolerance']:.3g}, runner-up margin {d['runner_up_margin']}, verified per "
            f"position {d['mean_verified_per_position']:.2f} "
            f"{json.dumps(d['mean_verified_per_position_by_stage'])}, resolved "
            f"{json.dumps(d['resolved_by_stage'])}, GFLOPs by stage "
            + json.dumps({s: round(f / 1e9, 2) for s, f in d["flops_by_stage"].items()
                          if f is not None}))
  for key, tr in torch_runs.items():
    name = key.split("/")[0]
    lla_row = results["training"][name]
    print(f"torch {key:24s} {tr['docs']:4d} docs {tr['per_doc_s']:8.3f} s/doc "
          f"({tr['per_doc_s'] / lla_row['warm_s_per_doc']:.2f} x lla warm), agreement "
          f"{100 * tr['agreement']:.2f}%")
  kernel = kernel_comparison(device)
  result = {
      "config": {"model": model_name, "cut": k, "seq_len": t, "batch": b,
                 "torch_batch": _TORCH_BATCH.value, "budget": budget,
                 "devices": str(jax.devices()), "cpu_count": os.cpu_count(),
                 "device": {"platform": device.platform, "device_kind": device.device_kind,
                            "count": len(jax.devices())},
                 "matmul_precision": vocab_topk.matmul_precision(),
                 "cold_start_capture": cold_capture if _COLD_START.value else None},
      "matmul": peak,
      "kernel": kernel,
      "lla": results,
      "torch": torch_runs,
  }
  if _OUT_JSON.value:
    with open(_OUT_JSON.value, "w") as f:
      json.dump(result, f, indent=2, sort_keys=True)
    print(f"wrote {_OUT_JSON.value}")


if __name__ == "__main__":
  app.run(main)
