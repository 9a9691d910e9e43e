"""The decoy-row experiment end to end: train + capture, attack, calibrate, tabulate.

For every seed: train the split twice with identical seeds (without and with the gradient
mitigation), capturing every frame the cloud sees; then replay each capture through the
structural and content attacks, calibrate the instrument by leak injection (first
`calibration.seeds` seeds), and write `seed_<s>/result.json`. A finished seed is reused, a
verified capture is replayed rather than retrained, so an interrupted run resumes.

Entry point: `run(config, workdir) -> summary dict` (also written as results.json / .md).
"""

from __future__ import annotations

import os
import re
import time

import jax
import numpy as np
from absl import logging

from lla.decoy import attacks, capture, data, modules, system
from lla.decoy import records as decoy_records
from lla.evidence import files
from lla.model import gpt2, loading, split

POLICY_DIR = os.path.join(os.path.dirname(__file__), "policies")
ARMS = ("none", "mitigated")
# PROTOCOL section 7: leak classes this experiment does not measure.
DECLARED_UNMEASURED = (
    "membership/property inference", "response-side recovery", "timing metadata",
    "stateful remote state", "accumulated history across steps",
    "active perturbation by the cloud")


def load_policy(name: str) -> tuple[dict, str]:
  """(policy dict, sha256 of the file's bytes) of policies/<name>.json (a name, never a
  path)."""
  if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name) or ".." in name:
    raise ValueError(f"decoy policy name {name!r}: expected a file name under {POLICY_DIR}")
  path = os.path.join(POLICY_DIR, name + ".json")
  with open(path, "rb") as f:
    raw = f.read()
  return files.read_json(path), files.sha256_bytes(raw)


def load_model(config, vocab: int, seed: int) -> tuple[dict, split.ModelConfig, str]:
  """(params, cfg, model id): the checkpoint in `model.hf_dir` (any family; lla.model.loading),
  else a seeded random init of a GPT-2."""
  if config.model.hf_dir:
    loaded = loading.load_model({"hf_dir": config.model.hf_dir})
    if loaded.cfg.vocab_size < vocab:
      raise ValueError(f"{config.model.hf_dir}: vocabulary {loaded.cfg.vocab_size} < data's "
                       f"{vocab}")
    return loaded.params, loaded.cfg, loaded.model_id
  cfg = gpt2.GPT2Config(vocab_size=vocab, n_positions=config.model.n_positions,
                        n_embd=config.model.n_embd, n_layer=config.model.n_layer,
                        n_head=config.model.n_head)
  return gpt2.init_params(cfg, jax.random.PRNGKey(seed)), cfg, f"random-init:seed{seed}"


def make_spec(config, cfg: split.ModelConfig, mitigated: bool) -> system.SplitSpec:
  p = config.protocol
  return system.SplitSpec(
      cfg=cfg, cut=config.model.cut, n_real=p.n_real, n_decoy=p.n_decoy, width=p.width,
      pool_size=p.pool_size, fwd_clip=p.fwd_clip, fwd_noise=p.fwd_noise,
      grad_clip=config.mitigation.grad_clip if mitigated else 0.0,
      grad_noise=config.mitigation.grad_noise, ucn_hidden=config.ucn.hidden,
      train_model=config.train.train_model, lr_tln=config.train.lr_tln,
      lr_ucn=config.train.lr_ucn, weight_decay=config.train.weight_decay)


# O of a decoy-row capture: the frames the cloud is sent and the gradient rows it returns
# (lla.decoy.modules), observation kinds of their own.
OBSERVED = {modules.FORWARD: True, modules.GRADIENTS: True}


def _protocol_tuple(config, seed: int, arm: str, model_id: str, policy_sha: str) -> dict:
  return {"config": config.to_dict(), "seed": seed, "mitigation": arm, "model_id": model_id,
          "policy_sha256": policy_sha, "O": dict(OBSERVED)}


def e_hash(config, seed: int, arm: str, model_id: str, policy_sha: str) -> str:
  """sha256 of the canonical protocol tuple: the identity of one (seed, arm) run."""
  return files.sha256_bytes(files.canonical_json(
      _protocol_tuple(config, seed, arm, model_id, policy_sha)))


def train_and_capture(config, seed: int, arm: str, blocks, policy_sha: str, directory: str):
  """Trains one (seed, arm) system and writes its capture to `directory`."""
  train_blocks, heldout, vocab = blocks
  rng = np.random.default_rng(seed)
  n_pool = config.protocol.pool_size // config.protocol.n_real
  # A seeded order of training blocks; np.resize wraps around a corpus shorter than the run.
  order = np.resize(rng.permutation(len(train_blocks)), n_pool + config.protocol.steps)
  pool_blocks, run_blocks = train_blocks[order[:n_pool]], train_blocks[order[n_pool:]]
  params, cfg, model_id = load_model(config, vocab, seed)
  spec = make_spec(config, cfg, arm == "mitigated")
  key = jax.random.PRNGKey(seed)
  k_init, k_run, k_eval = jax.random.split(key, 3)
  state = system.init_state(spec, params, pool_blocks, k_init)
  eval_blocks = heldout[:config.eval.blocks]
  ce = lambda s: float(system.heldout_ce(spec, s["tln"], s["ucn"], eval_blocks, k_eval))
  ce_initial = ce(state)
  t0 = time.time()
  state, out = system.train(spec, state, run_blocks, k_run, chunk=config.train.chunk,
                            log=lambda n, l: logging.info("seed %d %s: step %d loss %.3f",
                                                          seed, arm, n, l))
  protocol = _protocol_tuple(config, seed, arm, model_id, policy_sha)
  metadata = {"session_id": f"decoy/seed{seed}/{arm}", "protocol": protocol,
              "e_hash": e_hash(config, seed, arm, model_id, policy_sha),
              "model_id": model_id, "policy_sha256": policy_sha,
              "heldout_ce": {"initial": ce_initial, "final": ce(state)},
              "train_loss_last_256": float(np.mean(out["loss"][-256:])),
              "train_wall_s": time.time() - t0}
  truth = capture.truth_from_perm(out["perm"], run_blocks, config.protocol.n_real)
  _, test = attacks.split_frames(out["forward"].shape[0], seed)
  capture.write(directory, out["forward"], out["gradient"], truth, metadata,
                views=capture.scored_views(truth, config.probe.label, test))


def calibrate(forward, gradient, labels, train, test, base_forward: dict, config, policy,
              seed: int) -> dict:
  """Dose-response of the gate to leak injection into the returned-gradient rows.

  The injection goes into the gradient rows as the cloud receives them (after the
  rotation, post hoc on the capture): the gradient-only arm sees it directly, the joined
  arm through its gradient block, and the forward arm is an untouched internal control.
  Every dose replays the same capture, so doses differ only by the injection.
  """
  n_arms = len(attacks.FEATURES) * len(config.probe.classifiers)
  doses = ([("rho", rho, rho, 1.0) for rho in policy["calibration"]["rho_at_a1"]] +
           [("a", a, 1.0, a) for a in policy["calibration"]["a_at_rho1"]])
  points = []
  for series, x, rho, amp in doses:
    grad = attacks.inject(gradient, labels, rho, amp, seed)
    feats = attacks.arm_features(forward, grad, train)
    res = attacks.content({k: feats[k] for k in ("gradient", "joined")}, labels, train, test,
                          config.probe, n_arms, policy, seed, controls=(rho == 1 and amp == 1))
    res["arms"].update(base_forward)
    g = max(a["gate_pp"] for a in res["arms"].values())
    points.append({"series": series, "x": x, "rho": rho, "a": amp, "G_pp": g,
                   "fires": g > policy["threshold_pp"], "arms": res["arms"]})
  first = {s: next((p["x"] for p in points if p["series"] == s and p["fires"]), None)
           for s in ("rho", "a")}
  return {"points": points, "first_firing": first, "injected_into": "returned-gradient rows"}


def analyse(directory: str, config, policy: dict, seed: int, calibrate_it: bool,
            predictions: dict | None = None) -> dict:
  """Replays one capture through the attacks (and, if asked, the calibration).

  `predictions`, if given, receives "structural" and "norm" ([S, M] row masks), "content"
  ({arm: [S_test, R]}) and "content_baseline" (the constant predictor's token): what the
  study's records store (lla.decoy.records.write).
  """
  messages, truth, metadata, sha = capture.read(directory)
  fwd, grad, labels = attacks.real_rows(messages, truth, config.probe.label)
  train, test = attacks.split_frames(len(labels), seed)
  feats = attacks.arm_features(fwd, grad, train)
  n_arms = len(feats) * len(config.probe.classifiers)
  content_predictions = {} if predictions is not None else None
  structural = attacks.structural_prediction(messages["gradient"])
  norm = attacks.norm_prediction(messages["gradient"], int(config.protocol.n_real))
  result = {"capture_sha256": sha, "e_hash": metadata["e_hash"], "model_id": metadata["model_id"],
            "heldout_ce": metadata["heldout_ce"],
            "structural": attacks.row_mask_scores(structural, truth["real_mask"]),
            "norm": attacks.row_mask_scores(norm, truth["real_mask"]),
            "content": attacks.content(feats, labels, train, test, config.probe, n_arms,
                                       policy, seed, predictions=content_predictions)}
  if predictions is not None:
    predictions.update(structural=structural, norm=norm, content=content_predictions,
                       content_baseline=result["content"]["baseline"]["token"])
  if calibrate_it:
    base_forward = {k: {kk: vv for kk, vv in v.items() if kk != "shuffled"}
                    for k, v in result["content"]["arms"].items() if k.startswith("forward/")}
    result["calibration"] = calibrate(fwd, grad, labels, train, test, base_forward, config,
                                      policy, seed)
  return result


def run_seed(config, seed: int, blocks, policy: dict, policy_sha: str, workdir: str,
             study: str | None = None) -> dict:
  """One seed, resumable: a finished result.json is returned as is.

  With `study` (a run directory), each capture's attacks are also written there as records
  (lla.decoy.records); a finished seed whose records are missing is replayed for them.
  """
  seed_dir = os.path.join(workdir, f"seed_{seed}")
  done = os.path.join(seed_dir, "result.json")

  def check(arm, record):
    # A result or capture made under another config or policy must not be mixed in.
    if record["e_hash"] != e_hash(config, seed, arm, record["model_id"], policy_sha):
      raise ValueError(f"{seed_dir}: seed {seed} ({arm}) was run with another config or "
                       "policy (E hash differs); use a fresh --workdir")

  def record(arm, directory, predictions, wall_s):
    if study is not None:
      decoy_records.write(study, directory, config, seed, arm, predictions, wall_s)

  if os.path.exists(done):
    logging.info("seed %d: reusing %s", seed, done)
    result = files.read_json(done)
    for arm in ARMS:
      check(arm, result[arm])
      if study is not None and decoy_records.missing(study, config, seed, arm):
        directory = os.path.join(seed_dir, f"capture_{arm}")
        predictions, t0 = {}, time.time()
        analyse(directory, config, policy, seed, calibrate_it=False, predictions=predictions)
        record(arm, directory, predictions, time.time() - t0)
    return result
  result = {"seed": seed, "policy_sha256": policy_sha}
  for arm in ARMS:
    directory = os.path.join(seed_dir, f"capture_{arm}")
    if capture.is_complete(directory):
      check(arm, files.read_json(os.path.join(directory, capture.METADATA)))
    else:
      train_and_capture(config, seed, arm, blocks, policy_sha, directory)
    predictions, t0 = {}, time.time()
    result[arm] = analyse(directory, config, policy, seed,
                          calibrate_it=(arm == "none" and seed < config.calibration.seeds),
                          predictions=predictions)
    record(arm, directory, predictions, time.time() - t0)
  cost = result["mitigated"]["heldout_ce"]["final"] - result["none"]["heldout_ce"]["final"]
  result["utility"] = {"ce_cost_nats": cost,
                       "gate": "PASS" if cost <= policy["utility_max_ce_increase_nats"]
                       else "FAIL"}
  files.atomic_write_json(done, result)
  return result


def load_data(config):
  """(train blocks, held-out blocks, vocabulary size) of the configured source."""
  d = config.data
  return data.load_blocks(d.source, config.protocol.n_real, data_dir=d.data_dir,
                          vocab=d.synthetic_vocab, n_tokens=d.synthetic_tokens,
                          seed=d.synthetic_seed)


def run(config, workdir: str, study: str | None = None) -> dict:
  """Runs every seed and writes results.json, results.md, dose_response.{json,png}; with
  `study`, also each capture's attacks as records of that run directory."""
  from lla.decoy import report  # Matplotlib is imported only when a run reports.
  os.makedirs(workdir, exist_ok=True)
  policy, policy_sha = load_policy(config.policy)
  blocks = load_data(config)
  seeds = []
  for seed in range(config.num_seeds):
    t0 = time.time()
    seeds.append(run_seed(config, seed, blocks, policy, policy_sha, workdir, study))
    logging.info("seed %d done in %.0f s", seed, time.time() - t0)
  summary = report.summarise(seeds, policy, policy_sha, DECLARED_UNMEASURED)
  report.write(workdir, summary)
  return summary
