"""An active probe of the decoy-row split (PROTOCOL section 7): which rows are real?

The cloud node (UCN) owns its output frame. In every step it adds a secret random unit
vector u_r, at amplitude a, to each output row r. A real row's returned gradient
dL/d(out_r) is evaluated at the perturbed point, so it moves by a H_r u_r (H_r the loss
Hessian for that row, whose Gauss-Newton part is positive semi-definite): its component
along u_r grows by a u_r^T H_r u_r >= 0 on average. A decoy row never reaches the loss,
so its returned gradient is zero, or, under the mitigation, pure clip-and-noise
(lla.decoy.system.mitigate) that ignores u_r. Statistic s_r = <g_r, u_r>; the UCN predicts
the R rows with the largest s_r as real (notes/active-server.md 4.6).

Controls, on the same frames: a = 0 (the probe off: s_r is chance), and the passive
ranking by |g_r| (what the UCN gets without crafting anything). The cost to the trusted
node is its loss: the perturbation is noise on the real rows it decodes, so the TLN's
held-out CE after training and its training loss, against the a = 0 run of the same seed,
are both the utility cost and the natural detector (the TLN owns the loss).

`probe_step` is `lla.decoy.system.step` with the perturbation added to the UCN's output;
at a = 0 it is that step bit for bit (tested), so every other part of the system is the
measured one.
"""

from __future__ import annotations

import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from lla.decoy import attacks as decoy_attacks
from lla.decoy import run as decoy_run
from lla.decoy import system
from lla.evidence import files


def secret_directions(key: jax.Array, rows: int, width: int) -> jax.Array:
  """[M, D] independent uniform unit vectors: the UCN's secret for one frame."""
  u = jax.random.normal(key, (rows, width), jnp.float32)
  return u / jnp.linalg.norm(u, axis=-1, keepdims=True)


def probe_step(spec: system.SplitSpec, amplitude: jax.Array, state: dict, block: jax.Array,
               key: jax.Array):
  """`system.step` with the UCN adding amplitude * u_r to every output row.

  Returns:
    (new state, out) with out = {forward [M, D], gradient [M, D] as the UCN receives it,
    perm [M], loss, directions [M, D] the UCN's u}.
  """
  k_probe = jax.random.fold_in(key, 0x9E37)  # The UCN's own secret, not any of the TLN's.
  directions = secret_directions(k_probe, spec.n_rows, spec.width)
  new_state, out = system.step(spec, state, block, key, ucn_offset=amplitude * directions)
  return new_state, {**out, "directions": directions}


@functools.partial(jax.jit, static_argnames=("spec",))
def run_probe_steps(spec: system.SplitSpec, amplitude: jax.Array, state: dict, blocks, keys):
  """`lax.scan` of `probe_step`; outputs stacked over steps."""
  return jax.lax.scan(lambda s, xs: probe_step(spec, amplitude, s, *xs), state, (blocks, keys))


def agreement(pred: np.ndarray, real: np.ndarray) -> dict:
  """Row agreement and exact frames of a [S, M] real-row prediction."""
  return {"row_agreement": float(np.mean(pred == real)),
          "frames_exact": int(np.all(pred == real, axis=1).sum())}


def chance_agreement(n_real: int, n_rows: int) -> float:
  """Expected row agreement of n_real rows picked at random: 1 - 2 R (M - R) / M^2."""
  return 1.0 - 2.0 * n_real * (n_rows - n_real) / n_rows**2


def score_frames(gradient: np.ndarray, directions: np.ndarray, perm: np.ndarray,
                 n_real: int) -> dict:
  """The probe (<g_r, u_r>) and the passive control (|g_r|) against the real-row truth."""
  real = perm < n_real
  probe = np.einsum("smd,smd->sm", gradient.astype(np.float64), directions.astype(np.float64))
  return {"probe": agreement(decoy_attacks.top_rows(probe, n_real), real),
          "passive_norm": agreement(decoy_attacks.norm_prediction(gradient, n_real) == 1, real),
          "frames": int(len(real)), "chance": chance_agreement(n_real, real.shape[1])}


def run_one(config, amplitude: float, seed: int, mitigated: bool, blocks, steps: int) -> dict:
  """Trains the decoy split for `steps` steps with the probe at `amplitude`; scores it."""
  train_blocks, heldout, vocab = blocks
  rng = np.random.default_rng(seed)
  n_pool = config.protocol.pool_size // config.protocol.n_real
  order = np.resize(rng.permutation(len(train_blocks)), n_pool + steps)
  params, cfg, model_id = decoy_run.load_model(config, vocab, seed)
  spec = decoy_run.make_spec(config, cfg, mitigated)
  k_init, k_run, k_eval = jax.random.split(jax.random.PRNGKey(seed), 3)
  state = system.init_state(spec, params, train_blocks[order[:n_pool]], k_init)
  start = time.time()
  state, out = run_probe_steps(spec, jnp.float32(amplitude), state,
                               jnp.asarray(train_blocks[order[n_pool:]]),
                               jax.random.split(k_run, steps))
  out = jax.device_get(out)
  ce = float(system.heldout_ce(spec, state["tln"], state["ucn"],
                               heldout[:config.eval.blocks], k_eval))
  return {"amplitude": float(amplitude), "seed": seed, "mitigated": mitigated,
          "model_id": model_id, "heldout_ce": ce, "train_loss": float(np.mean(out["loss"])),
          **score_frames(out["gradient"], out["directions"], out["perm"], spec.n_real),
          "wall_s": time.time() - start}


def run(config, workdir: str) -> dict:
  """Every (seed, mitigation, amplitude) of `config` (configs/active.py `decoy_probe`);
  each result is stored and reused. Returns and writes workdir/decoy_probe.json."""
  decoy = config.system
  os.makedirs(workdir, exist_ok=True)
  config_sha = files.sha256_bytes(files.canonical_json(
      {"system": decoy.to_dict(), "steps": int(config.steps)}))
  blocks = decoy_run.load_data(decoy)
  results = []
  for seed in config.seeds:
    for mitigated in (False, True):
      for amplitude in sorted({0.0, *config.amplitudes}):
        path = os.path.join(workdir, f"seed{seed}_{'mitigated' if mitigated else 'none'}_"
                                     f"a{amplitude:g}.json")
        if os.path.exists(path):
          stored = files.read_json(path)
          if stored.get("config_sha256") != config_sha:
            raise ValueError(f"{path} was made under another decoy config; use a new workdir")
          results.append(stored)
          continue
        result = run_one(decoy, amplitude, int(seed), mitigated, blocks, int(config.steps))
        result["config_sha256"] = config_sha
        files.atomic_write_json(path, result)
        logging.info("decoy probe seed %d %s a=%g: probe %.3f passive %.3f CE %.3f", seed,
                     "mitigated" if mitigated else "none", amplitude,
                     result["probe"]["row_agreement"], result["passive_norm"]["row_agreement"],
                     result["heldout_ce"])
        results.append(result)
  summary = summarise(results)
  files.atomic_write_json(os.path.join(workdir, "decoy_probe.json"), summary, overwrite=True)
  return summary


def summarise(results: list[dict]) -> dict:
  """Per (mitigation, amplitude): mean row agreement of the probe and of the passive
  control, and the TLN's CE increase over the a = 0 run of the same seed and arm."""
  base = {(r["seed"], r["mitigated"]): r for r in results if r["amplitude"] == 0.0}
  rows = {}
  for r in results:
    key = ("mitigated" if r["mitigated"] else "none", r["amplitude"])
    ref = base[(r["seed"], r["mitigated"])]
    rows.setdefault(key, []).append({
        "probe": r["probe"]["row_agreement"], "passive": r["passive_norm"]["row_agreement"],
        "exact": r["probe"]["frames_exact"], "frames": r["frames"],
        "ce_increase": r["heldout_ce"] - ref["heldout_ce"],
        "loss_increase": r["train_loss"] - ref["train_loss"], "chance": r["chance"]})
  table = []
  for (arm, amplitude), rs in sorted(rows.items()):
    mean = lambda k: float(np.mean([x[k] for x in rs]))
    table.append({"mitigation": arm, "amplitude": amplitude, "seeds": len(rs),
                  "probe_agreement": mean("probe"), "passive_agreement": mean("passive"),
                  "frames_exact": int(sum(x["exact"] for x in rs)),
                  "frames": int(sum(x["frames"] for x in rs)), "chance": rs[0]["chance"],
                  "ce_increase": mean("ce_increase"), "loss_increase": mean("loss_increase"),
                  "per_seed_probe": [x["probe"] for x in rs]})
  return {"table": table, "runs": results}
