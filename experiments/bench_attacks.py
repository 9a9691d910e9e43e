"""Benchmark: lla's activation-only and joint attacks against a plain PyTorch beam search.

GPT-2 124M configuration with random weights (lla draws them; the PyTorch side loads the
same weights through `save_hf_dir` -> `GPT2LMHeadModel.from_pretrained`), cut k, B
documents of T tokens. Reports, side by side in one run:

  * lla: wall time cold (compile + XLA cost analysis included) and warm (compiled, per
    stage: ridge fit, activation candidates, gradient ranking, beam search), FLOPs (XLA
    cost analysis and analytic) and achieved FLOP/s;
  * the machine's float32 matmul FLOP/s (2048 x 2048, jax and torch);
  * the same beam search written plainly in PyTorch with transformers' GPT-2 on the same
    candidates: once recomputing every (beam, candidate) prefix through the first k blocks
    at each step, once with a `past_key_values` cache; per-document times are
    extrapolated to B documents; token agreement with lla's predictions.

  python -m experiments.bench_attacks --batch 16 --torch_batch 4 --torch_nocache_batch 1 \
      --out_json /tmp/bench.json

torch is imported inside this benchmark only.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

from absl import app, flags, logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from lla.attacks import beam, beam_attacks, registry
from lla.attacks import candidates as cand_lib
from lla.attacks.workspace import Workspace, map_documents
from lla.model import hf_io, split
from lla.model.gpt2 import GPT2Config, init_params

_BATCH = flags.DEFINE_integer("batch", 256, "Documents attacked by lla (paper: 256).")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 32, "Tokens per document T.")
_CUT = flags.DEFINE_integer("cut", 6, "Cut k.")
_TORCH_BATCH = flags.DEFINE_integer("torch_batch", 32,
                                    "Documents for the cached PyTorch search (extrapolated).")
_TORCH_NOCACHE_BATCH = flags.DEFINE_integer(
    "torch_nocache_batch", -1, "Documents for the uncached PyTorch search (-1: torch_batch).")
_CALIBRATION = flags.DEFINE_integer("calibration", 32, "Calibration documents.")
_CANDIDATES = flags.DEFINE_integer("candidates", 32, "C (activation-only).")
_WIDTH = flags.DEFINE_integer("beam_width", 2, "W.")
_C_A = flags.DEFINE_integer("c_a", 16, "Joint: activation candidates.")
_C_G = flags.DEFINE_integer("c_g", 16, "Joint: gradient candidates.")
_MATMUL_N = flags.DEFINE_integer("matmul_n", 2048, "Size of the peak-FLOP/s matmul probe.")
_OUT_JSON = flags.DEFINE_string("out_json", "", "Where to write the results (JSON).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of weights and tokens.")


def random_params(cfg: GPT2Config, seed: int) -> dict:
  """GPT-2 initialisation (normal 0.02, wpe 0.01, LayerNorm 1/0), drawn with numpy.

  Same distribution as `init_params` without an eager Flax init of 124M parameters.
  """
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    name = path[-1].key
    if name == "scale":
      return jnp.ones(leaf.shape, jnp.float32)
    if name == "bias":
      return jnp.zeros(leaf.shape, jnp.float32)
    std = 0.01 if path[0].key == "wpe" else 0.02
    return jnp.asarray(std * rng.standard_normal(leaf.shape, dtype=np.float32))

  shapes = jax.eval_shape(lambda key: init_params(cfg, key), jax.random.key(0))
  return jax.tree_util.tree_map_with_path(draw, shapes)


def _timed(fn, repeats=1):
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    out = fn()
    jax.block_until_ready(out)
    best = min(best, time.perf_counter() - start)
  return out, best


def matmul_flops(n: int) -> dict:
  import torch
  a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n), dtype=np.float32))
  mm = jax.jit(lambda x, y: x @ y)
  mm(a, a).block_until_ready()
  _, t_jax = _timed(lambda: mm(a, a), repeats=5)
  ta = torch.from_numpy(np.asarray(a))
  torch.mm(ta, ta)
  best = float("inf")
  for _ in range(5):
    start = time.perf_counter()
    torch.mm(ta, ta)
    best = min(best, time.perf_counter() - start)
  flops = 2.0 * n**3
  return {"n": n, "jax_flops_per_s": flops / t_jax, "torch_flops_per_s": flops / best,
          "torch_threads": torch.get_num_threads()}


def lla_attack(name: str, ws_args: tuple, budget, key) -> dict:
  """Cold run through the registry, then warm stages with the compiled functions."""
  ws = Workspace(*ws_args)
  start = time.perf_counter()
  result = registry.get(name)(ws, budget, key)
  cold = time.perf_counter() - start

  # Warm: a fresh workspace, the same jitted functions and chunk shapes, no cost analysis.
  ws = Workspace(*ws_args)
  stages = {}
  start = time.perf_counter()
  decoder = ws.decoder  # client on the calibration documents + float64 solve
  stages["ridge_s"] = time.perf_counter() - start
  wte = ws.wte
  vocab, t = ws.cfg.vocab_size, ws.seq_len
  nearest = lambda num: (lambda h: cand_lib.nearest_tokens(decoder.decode(h), wte, num))
  chunk_c = ws.chunk_for(8.0 * t * vocab)
  if name == "activation":
    num = int(budget.candidates)
    (cands, _), stages["activation_candidates_s"] = _timed(
        lambda: map_documents(nearest(num), (ws.activations,), chunk_c, None))
  else:
    c_a, c_g = int(budget.c_a), int(budget.c_g)
    (act, _), stages["activation_candidates_s"] = _timed(
        lambda: map_documents(nearest(c_a + c_g), (ws.activations,), chunk_c, None))
    rank = lambda g: cand_lib.gradient_ranked_tokens(g, wte, c_a + c_g)
    (grad, _), stages["gradient_ranking_s"] = _timed(
        lambda: map_documents(rank, (ws.gradients,), chunk_c, None))
    cands, stages["joint_merge_s"] = _timed(
        lambda: np.asarray(cand_lib.joint_candidates(act, grad, c_a, c_g)))
  width = int(budget.beam_width)
  chunk_b = ws.chunk_for(beam_attacks.beam_bytes_per_doc(ws, width, cands.shape[-1]))
  fn = lambda h, c: beam.beam_search(ws.params, ws.cfg, ws.cut, h, c, width)[0]
  (preds, _), stages["beam_s"] = _timed(
      lambda: map_documents(fn, (ws.activations, cands.astype(np.int32)), chunk_b, None))
  warm = sum(stages.values())
  if not np.array_equal(preds, result.predictions):
    raise AssertionError(f"{name}: warm predictions differ from the registry's")
  beam_analytic = beam.analytic_flops(ws.cfg, ws.cut, ws.num_docs, width, cands.shape[-1], t)
  return {"attack": name, "cold_s": cold, "warm_s": warm, "warm_stages": stages,
          "flops": result.flops, "flops_source": result.flops_source,
          "flops_analytic": result.flops_analytic, "beam_flops_analytic": beam_analytic,
          "achieved_flops_per_s": result.flops / warm,
          "beam_achieved_flops_per_s": beam_analytic / stages["beam_s"],
          "candidates": cands, "predictions": result.predictions}


def torch_beam(model, h: np.ndarray, cands: np.ndarray, width: int, cached: bool) -> np.ndarray:
  """The pinned beam search, plainly, batched over documents. model: truncated GPT2Model."""
  import torch
  n, t_len, c = cands.shape
  target = torch.from_numpy(h)
  cand = torch.from_numpy(cands.astype(np.int64))
  scores = torch.full((n, width), float("inf"))
  scores[:, 0] = 0.0
  tokens = torch.zeros((n, width, t_len), dtype=torch.long)
  cache = None
  rows = torch.arange(n)[:, None]
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
  return tokens[:, 0].numpy()


def torch_side(hf_dir: str, cut: int, lla_runs: dict, h: np.ndarray, width: int,
               docs_cached: int, docs_nocache: int) -> dict:
  import torch
  from transformers import GPT2LMHeadModel
  torch.set_num_threads(os.cpu_count() or 1)
  full = GPT2LMHeadModel.from_pretrained(hf_dir, attn_implementation="eager").eval()
  model = full.transformer
  model.h = model.h[:cut]          # the client: first k blocks, no ln_f
  model.ln_f = torch.nn.Identity()
  # Warm-up: one document through both variants, so that torch's one-time start-up costs
  # (allocator, kernel selection) are not billed to the first timed run.
  first = next(iter(lla_runs.values()))
  for cached in (True, False):
    torch_beam(model, h[:1], first["candidates"][:1], width, cached)
  out = {}
  for name, run in lla_runs.items():
    for cached, docs in ((True, docs_cached), (False, docs_nocache)):
      if docs <= 0:
        continue
      start = time.perf_counter()
      preds = torch_beam(model, h[:docs], run["candidates"][:docs], width, cached)
      wall = time.perf_counter() - start
      key = f"{name}/{'cached' if cached else 'recompute'}"
      out[key] = {"docs": docs, "wall_s": wall, "per_doc_s": wall / docs,
                  "agreement": float(np.mean(preds == run["predictions"][:docs]))}
      logging.info("torch %s: %d docs in %.1fs, agreement %.4f", key, docs, wall,
                   out[key]["agreement"])
  return out


def main(argv):
  del argv
  cfg = GPT2Config()
  b, t, k = _BATCH.value, _SEQ_LEN.value, _CUT.value
  params = random_params(cfg, _SEED.value)
  rng = np.random.default_rng(_SEED.value)
  tokens = rng.integers(0, cfg.vocab_size, (b, t)).astype(np.int32)
  cal = rng.integers(0, cfg.vocab_size, (_CALIBRATION.value, t)).astype(np.int32)
  hs, gs = [], []
  for s in range(0, b, 32):
    h, g = split.boundary_messages(params, cfg, jnp.asarray(tokens[s:s + 32]), k)
    hs.append(np.asarray(h))
    gs.append(np.asarray(g))
  h, g = np.concatenate(hs), np.concatenate(gs)
  budget = ml_collections.ConfigDict(dict(
      candidates=_CANDIDATES.value, beam_width=_WIDTH.value, c_a=_C_A.value, c_g=_C_G.value,
      ridge_alpha=1e-3, shuffle_seed=17))
  ws_args = (h, g, params, cfg, k, cal)

  peak = matmul_flops(_MATMUL_N.value)
  logging.info("matmul: %s", peak)
  runs = {}
  for name in ("activation", "joint"):
    runs[name] = lla_attack(name, ws_args, budget, jax.random.key(0))
    logging.info("lla %s: cold %.1fs warm %.1fs %s", name, runs[name]["cold_s"],
                 runs[name]["warm_s"], runs[name]["warm_stages"])
  nocache = _TORCH_NOCACHE_BATCH.value
  with tempfile.TemporaryDirectory(prefix="bench_attacks_") as tmp:
    hf_io.save_hf_dir(params, cfg, tmp)
    torch_runs = torch_side(tmp, k, runs, h, _WIDTH.value, _TORCH_BATCH.value,
                            _TORCH_BATCH.value if nocache < 0 else nocache)

  rows = []
  for name, run in runs.items():
    per_doc = run["warm_s"] / b
    rows.append((f"lla {name} (warm)", b, run["warm_s"], per_doc, 1.0,
                 run["achieved_flops_per_s"], None))
    for variant in ("cached", "recompute"):
      tr = torch_runs.get(f"{name}/{variant}")
      if tr:
        rows.append((f"torch {name} {variant}", tr["docs"], tr["wall_s"], tr["per_doc_s"],
                     tr["per_doc_s"] / per_doc, run["beam_flops_analytic"] / b / tr["per_doc_s"],
                     tr["agreement"]))
  print(f"\nGPT-2 124M (random weights), k={k}, T={t}, W={_WIDTH.value}, lla B={b}; "
        f"jax matmul {peak['jax_flops_per_s'] / 1e9:.1f} GFLOP/s, torch matmul "
        f"{peak['torch_flops_per_s'] / 1e9:.1f} GFLOP/s ({peak['n']}^2 float32)")
  print(f"{'':34s}{'docs':>5s}{'wall s':>9s}{'s/doc':>8s}{'x lla':>7s}"
        f"{'GFLOP/s':>9s}{'agree':>8s}")
  for label, docs, wall, per_doc, ratio, fps, agree in rows:
    print(f"{label:34s}{docs:5d}{wall:9.2f}{per_doc:8.3f}{ratio:7.2f}{fps / 1e9:9.1f}"
          f"{'' if agree is None else f'{100 * agree:7.2f}%':>8s}")
  for name, run in runs.items():
    stages = ", ".join(f"{s[:-2]} {v:.2f}s" for s, v in run["warm_stages"].items())
    print(f"lla {name}: cold {run['cold_s']:.1f}s (compile + cost analysis); warm stages: "
          f"{stages}; FLOPs {run['flops']:.3g} ({run['flops_source']}), analytic "
          f"{run['flops_analytic']:.3g}; {run['achieved_flops_per_s'] / 1e9:.1f} GFLOP/s = "
          f"{100 * run['achieved_flops_per_s'] / peak['jax_flops_per_s']:.0f}% of matmul; "
          f"beam stage {run['beam_achieved_flops_per_s'] / 1e9:.1f} GFLOP/s")
  print("torch GFLOP/s counts lla's analytic beam-search FLOPs (cached algorithm) per document; "
        "torch per-document times are extrapolated to B.")
  result = {
      "config": {"model": "gpt2_124m_random", "cut": k, "seq_len": t, "batch": b,
                 "torch_batch": _TORCH_BATCH.value, "budget": budget.to_dict(),
                 "devices": str(jax.devices()), "cpu_count": os.cpu_count()},
      "matmul": peak,
      "lla": {n: {k_: v for k_, v in r.items() if k_ not in ("candidates", "predictions")}
              for n, r in runs.items()},
      "torch": torch_runs,
      "torch_extrapolated_to_batch_s": {key: v["per_doc_s"] * b for key, v in torch_runs.items()},
  }
  if _OUT_JSON.value:
    with open(_OUT_JSON.value, "w") as f:
      json.dump(result, f, indent=2, sort_keys=True)
    print(f"wrote {_OUT_JSON.value}")


if __name__ == "__main__":
  app.run(main)
