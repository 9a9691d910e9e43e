"""Benchmark: an adaptive attack against `activation` on the undefended capture, random weights.

A random-weight GPT-2 (no language prior to lean on) of the chosen shape, cut k, B WikiText-2
evaluation documents of T tokens and N calibration documents. The clean messages h are
computed once; the defense (with a secret drawn from the OS that the attack never sees)
makes the defended messages. Reports token recovery, exact documents, FLOPs (XLA cost
analysis) and wall time of `activation` on h, of `activation` on the defended messages,
and of the adaptive attack on them; the ratio adaptive / undefended is the figure of
PROTOCOL section 5a's must-show.

  python -m experiments.bench_adaptive --model=small --out_json=/tmp/small.json
  nice -n 10 python -m experiments.bench_adaptive --model=gpt2_124m --docs=64 --cut=6 \
      --out_json=/tmp/gpt2.json
  # issue 21: the Haar route on 8 documents of a d = 128 model, and at GPT-2 124M shape
  python -m experiments.bench_adaptive --model=small_d128 --docs=8 --cut=2
  python -m experiments.bench_adaptive --model=gpt2_124m --docs=8 --cut=6

`--budget=name=value,...` changes budget fields (of the adaptive attack) from their defaults;
`--defended_activation=false` skips `activation` on the defended capture.

Needs LLA_DATA_DIR (WikiText-2 and the GPT-2 tokenizer).
"""

from __future__ import annotations

import json
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from lla import data, defenses
from lla.attacks import budget as budget_lib
from lla.attacks import registry
from lla.attacks.workspace import Workspace
from lla.model import split
from lla.model.gpt2 import GPT2Config, random_params

SHAPES = {
    "small": dict(n_layer=4, n_embd=64, n_head=4),
    "small_d128": dict(n_layer=4, n_embd=128, n_head=4),
    "gpt2_124m": dict(n_layer=12, n_embd=768, n_head=12),
}
_MODEL = flags.DEFINE_enum("model", "small", sorted(SHAPES), "Architecture (random weights).")
_DOCS = flags.DEFINE_integer("docs", 32, "Evaluation documents B.")
_CALIBRATION = flags.DEFINE_integer("calibration", 32, "Calibration documents N.")
_CUT = flags.DEFINE_integer("cut", 2, "Cut k.")
_DEFENSE = flags.DEFINE_string("defense", "projection", "Registered defense.")
_PARAMS = flags.DEFINE_string("params", "kind=haar", "Its public parameters: name=value,...")
_ATTACK = flags.DEFINE_string("attack", "projection_adaptive", "The adaptive attack.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the weights (and the attacks' keys).")
_BUDGET = flags.DEFINE_string("budget", "", "Budget fields of the adaptive attack: "
                              "name=value,... (the rest at their defaults).")
_DEFENDED_ACTIVATION = flags.DEFINE_bool("defended_activation", True,
                                         "Also run `activation` on the defended capture.")
_OUT_JSON = flags.DEFINE_string("out_json", "", "Where to write the results (JSON).")


def _parse(text: str, name: str) -> dict:
  declared = defenses.declared(name)
  out = {}
  for item in filter(None, (p.strip() for p in text.split(","))):
    key, _, value = item.partition("=")
    kind = declared.get(key, str)
    out[key] = (value == "True") if kind is bool else kind(value)
  return out


def _budget(text: str) -> dict:
  """name=value,... as budget fields, each of its declared type."""
  registry.load_builtin()  # the adaptive attacks declare their fields on import
  out = budget_lib.defaults()
  for item in filter(None, (p.strip() for p in text.split(","))):
    key, _, value = item.partition("=")
    kind = type(out[key]) if key in out else None
    if kind is None:
      raise app.UsageError(f"--budget: no budget field named {key!r}")
    out[key] = (value.lower() in ("1", "true")) if kind is bool else kind(value)
  return out


def _run(ws: Workspace, name: str, truth: np.ndarray, budget: dict | None = None) -> dict:
  start = time.perf_counter()
  result, charge = registry.execute(name, ws, budget or budget_lib.defaults(),
                                    jax.random.key(_SEED.value))
  hits = result.predictions == truth
  return {"attack": name, "token_recovery": float(hits.mean()),
          "exact_documents": float(hits.all(1).mean()), "flops": charge.flops,
          "flops_source": charge.flops_source, "wall_s": time.perf_counter() - start,
          "compile_s": charge.compile_s,
          "details": {k: v for k, v in result.details.items() if k != "refits"}}


def main(argv):
  del argv
  cfg = GPT2Config(vocab_size=50257, n_positions=32, **SHAPES[_MODEL.value])
  params = random_params(cfg, _SEED.value)
  splits = data.load_splits(n_eval=_DOCS.value, n_calibration=_CALIBRATION.value)
  truth = splits.evaluation.tokens.astype(np.int32)
  k = _CUT.value
  h = np.asarray(split.client(params, cfg, jnp.asarray(truth), k))
  defense = defenses.make(_DEFENSE.value, **_parse(_PARAMS.value, _DEFENSE.value))
  secret = defenses.Secret.draw()
  defended = np.asarray(defenses.apply(defense, jnp.asarray(h),
                                       secret.keys(defense.name) if defense.has_secret else None))
  public = {"name": defense.name, "params": defense.to_record()["params"]}
  cal = splits.calibration.tokens
  clean = Workspace(h, None, params, cfg, k, cal)
  attacked = Workspace(defended, None, params, cfg, k, cal, defense=public)
  budget = _budget(_BUDGET.value)
  runs = [dict(_run(clean, "activation", truth), capture="undefended")]
  if _DEFENDED_ACTIVATION.value:
    runs.append(dict(_run(attacked, "activation", truth), capture="defended"))
  runs.append(dict(_run(attacked, _ATTACK.value, truth, budget), capture="defended"))
  changed = {key: value for key, value in budget.items() if value != budget_lib.defaults()[key]}
  out = {"model": _MODEL.value, "shape": SHAPES[_MODEL.value], "cut": k, "docs": _DOCS.value,
         "calibration": _CALIBRATION.value, "defense": defense.to_record(secret),
         "budget_changes": changed, "runs": runs,
         "adaptive_over_undefended": runs[-1]["token_recovery"] / max(runs[0]["token_recovery"],
                                                                      1e-12)}
  for r in runs:
    print(f"{r['attack']:>22} on {r['capture']:<10}: token {100 * r['token_recovery']:6.2f}%  "
          f"exact docs {100 * r['exact_documents']:5.1f}%  {r['flops']:.3g} FLOPs  "
          f"{r['wall_s']:.0f} s ({r['compile_s']:.0f} s compiling)")
  print(f"adaptive / undefended activation: {out['adaptive_over_undefended']:.3f}"
        + (f"  (budget changes: {changed})" if changed else ""))
  details = runs[-1]["details"]
  summary = ("route", "acceptance_rate", "inexact_documents", "first_chunk_hits", "widened_rows",
             "widened_hits", "fallback_rows", "fallback_hits", "rejected_rows",
             "mean_candidates_verified_per_position", "tolerance", "accepted_max_rms",
             "runner_up_min_rms", "rows_recognised", "rank")
  print("  " + "  ".join(f"{key}={details[key]}" for key in summary if key in details))
  if _OUT_JSON.value:
    with open(_OUT_JSON.value, "w") as f:
      json.dump(out, f, indent=2, sort_keys=True, default=str)


if __name__ == "__main__":
  app.run(main)
