"""Benchmark: how often an attack's predictions change when the attacker computes in bf16.

A GPT-2 with random weights (GPT-2's initialisation; `small` or `gpt2_124m` shapes, the
GPT-2 tokenizer's vocabulary) runs the client in float32 on WikiText-2 evaluation
passages and captures h and g at the cut. The attacker then runs the registered attacks
once per precision, each precision in a fresh process (executables are cached per
process): float32, and bfloat16 = the attacker's model with compute dtype bfloat16
(weights and activations rounded to bf16 at every matmul, GPT2Config.dtype) and the
vocabulary scans on bf16 operands with float32 accumulation (JAX's "bfloat16" matmul
precision, read by lla_kernels.vocab_topk). Reported per attack: the fraction of predicted
tokens that agree with the float32 run, the same over the tokens the float32 run
recovered (agree|right), and each run's accuracy against the truth. The emulation also
rounds every matmul's output to bf16 (the model's bf16 compute dtype), which a GPU's
bf16 x bf16 -> float32 products do not: it is the harsher of the two.

On CPU this is the emulation that is possible: XLA:CPU ignores JAX's matmul precision, so
TF32 cannot be measured here, and the ridge decoding stays float32. On GPU/TPU the
process-wide setting of lla.runtime ($LLA_MATMUL_PRECISION) is what a run uses; measure
it there with --precisions=float32,tensorfloat32,bfloat16 --mode=runtime.

  LLA_DATA_DIR=/work/shared/data python -m experiments.bench_precision --model=small \
      --docs=32 --out_json=/tmp/precision_small.json
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from lla import runtime
from lla.attacks import registry
from lla.attacks.workspace import Workspace
from lla.data import load as data_load
from lla.model import split
from lla.model.gpt2 import GPT2Config, random_params

MODELS = {
    "small": (GPT2Config(vocab_size=50257, n_positions=64, n_embd=64, n_head=4, n_layer=4), 2),
    "gpt2_124m": (GPT2Config.gpt2_124m(), 6),
}

_MODEL = flags.DEFINE_enum("model", "small", list(MODELS), "Random-weight model and its cut.")
_DOCS = flags.DEFINE_integer("docs", 32, "Evaluation documents attacked.")
_ATTACKS = flags.DEFINE_list("attacks", ["ridge", "activation", "joint"], "Registered attacks.")
_PRECISIONS = flags.DEFINE_list("precisions", ["float32", "bfloat16"],
                                "Attacker precisions; the first is the reference.")
_MODE = flags.DEFINE_enum("mode", "emulate", ["emulate", "runtime"],
                          "emulate: bf16 via the model's compute dtype (any backend); "
                          "runtime: lla.runtime's process-wide setting (GPU/TPU).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the weights.")
_OUT_JSON = flags.DEFINE_string("out_json", "", "Where to write the results (JSON).")
_WORKER = flags.DEFINE_string("worker", "", "Internal: run one precision, save to --save.")
_SAVE = flags.DEFINE_string("save", "", "Internal: the worker's .npz.")

BUDGET = {"candidates": 32, "beam_width": 2, "c_a": 16, "c_g": 16, "ridge_alpha": 1e-3,
          "shuffle_seed": 17}


def worker(precision: str) -> None:
  cfg, cut = MODELS[_MODEL.value]
  params = random_params(cfg, _SEED.value)
  splits = data_load.load_splits(n_eval=_DOCS.value, n_calibration=32, n_train=16)
  tokens = splits.evaluation.tokens
  with jax.default_matmul_precision("highest"):  # the client and its capture: float32
    h, g = split.boundary_messages(params, cfg, jnp.asarray(tokens), cut)
  if _MODE.value == "runtime":
    runtime.configure_matmul_precision(precision)
    context, attacker_cfg = contextlib.nullcontext(), cfg
  else:
    bf16 = precision == "bfloat16"
    if precision not in ("float32", "bfloat16"):
      raise ValueError(f"--mode=emulate measures float32 and bfloat16, not {precision}")
    context = jax.default_matmul_precision("bfloat16") if bf16 else contextlib.nullcontext()
    attacker_cfg = cfg.replace(dtype="bfloat16") if bf16 else cfg
  out = {"truth": tokens}
  with context:
    ws = Workspace(np.asarray(h), np.asarray(g), params, attacker_cfg, cut,
                   splits.calibration.tokens)
    for name in _ATTACKS.value:
      start = time.perf_counter()
      result, _ = registry.execute(name, ws, BUDGET, jax.random.key(0))
      out[name] = np.asarray(result.predictions)
      out[f"{name}_wall_s"] = np.float64(time.perf_counter() - start)
  np.savez(_SAVE.value, **out)


def main(argv):
  del argv
  if _WORKER.value:
    worker(_WORKER.value)
    return
  runs = {}
  with tempfile.TemporaryDirectory(prefix="bench_precision_") as tmp:
    for precision in _PRECISIONS.value:
      path = os.path.join(tmp, f"{precision}.npz")
      args = [a for a in sys.argv[1:] if not a.startswith(("--out_json", "--worker", "--save"))]
      subprocess.run([sys.executable, "-m", "experiments.bench_precision", *args,
                      f"--worker={precision}", f"--save={path}"], check=True)
      with np.load(path) as f:
        runs[precision] = dict(f)
  reference_name = _PRECISIONS.value[0]
  reference = runs[reference_name]
  truth = reference["truth"]
  cfg, cut = MODELS[_MODEL.value]
  result = {"config": {"model": _MODEL.value, "cut": cut, "docs": _DOCS.value,
                       "seq_len": int(truth.shape[1]), "mode": _MODE.value, "budget": BUDGET,
                       "backend": jax.default_backend(), "seed": _SEED.value},
            "attacks": {}}
  print(f"{_MODEL.value} (random weights), k={cut}, {_DOCS.value} documents x "
        f"{truth.shape[1]} tokens, mode {_MODE.value}, agreement against {reference_name}")
  print(f"{'attack':14s}{'precision':15s}{'agree':>9s}{'differ':>8s}{'agree|right':>14s}"
        f"{'accuracy':>10s}{'wall s':>9s}")
  for name in _ATTACKS.value:
    rows = {}
    for precision, run in runs.items():
      agree = float(np.mean(run[name] == reference[name]))
      recovered = reference[name] == truth
      rows[precision] = {"agreement": agree,
                         "tokens_differing": int(np.sum(run[name] != reference[name])),
                         "agreement_where_reference_recovered": float(
                             np.mean(run[name][recovered] == truth[recovered])),
                         "accuracy": float(np.mean(run[name] == truth)),
                         "wall_s": float(run[f"{name}_wall_s"])}
      r = rows[precision]
      print(f"{name:14s}{precision:15s}{100 * agree:8.3f}%{r['tokens_differing']:8d}"
            f"{100 * r['agreement_where_reference_recovered']:13.3f}%"
            f"{100 * r['accuracy']:9.2f}%{r['wall_s']:9.1f}")
    result["attacks"][name] = rows
  if _OUT_JSON.value:
    with open(_OUT_JSON.value, "w") as f:
      json.dump(result, f, indent=2, sort_keys=True)
    print(f"wrote {_OUT_JSON.value}")


if __name__ == "__main__":
  app.run(main)
