"""Fine-tuning N independently seeded copies of a base model on the protocol's training split.

  checkpoints = finetune(config, workdir)   # workdir/seed_{s}/, one per seed, reused if valid

Each copy starts from the same base weights and is trained with AdamW on the 128 training
passages (T = 32) of `lla.data.load_splits`; the seed sets the batch order. With
`train_client_layers=False` (knowledge `public`) the client layers of cut k (wte, wpe,
h_0..h_{k-1}, hence also the tied head) are frozen bit for bit; with True (`trained`) every
parameter trains. Every seed's directory is an lla checkpoint (orbax + HF export) whose
metadata.json holds its params sha256, the base's sha256, k, the knowledge level, the data
hashes and the held-out CE before and after. `workdir/models.json` lists them all.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

import ml_collections
from absl import logging

from lla import data
from lla.model import checkpoint as ckpt
from lla.model import split
from lla.train import loop
from lla.model import loading
from lla.train.pretrain import json_config

MANIFEST_FILE = "models.json"


def seeds(config: ml_collections.ConfigDict) -> list[int]:
  return [config.first_seed + i for i in range(config.num_models)]


def seed_dir(workdir: str | os.PathLike, seed: int) -> pathlib.Path:
  return pathlib.Path(workdir) / f"seed_{seed}"


def defense_weights_file(workdir: str | os.PathLike, seed: int, defense) -> pathlib.Path:
  """Where the defender keeps the trained weights of a defense that has them (mid)."""
  return pathlib.Path(workdir) / "defender" / f"seed_{seed}_{defense.name}.npz"


def knowledge(train_client_layers: bool) -> str:
  """PROTOCOL.md section 1, K: what an attacker holding the base client weights knows."""
  return "trained" if train_client_layers else "public"


def num_steps(config: ml_collections.ConfigDict, n_train: int) -> int:
  """`num_epochs` passes over the training passages in full batches."""
  return config.num_epochs * max(n_train // config.batch_size, 1)


class CheckpointMismatch(ValueError):
  """A cached fine-tune made under another config, base or defense secret (one line)."""


def _differences(old, new, path: str) -> list[str]:
  """The paths at which two JSON values differ (dicts compared key by key)."""
  if isinstance(old, dict) and isinstance(new, dict):
    return [d for key in sorted(set(old) | set(new))
            for d in _differences(old.get(key), new.get(key), f"{path}.{key}")]
  return [] if old == new else [path]


def base_provenance(base: loading.LoadedModel) -> dict:
  """What a fine-tuned checkpoint records of its base: where it was loaded from and its
  model id (`params_sha256`: the name records have carried since the id was the params'
  hash alone; a GPT-2 preset's id still is), and the loader's info."""
  return {"source": base.source, "params_sha256": base.model_id, "model": base.info}


def finetune(config: ml_collections.ConfigDict, workdir: str | os.PathLike,
             splits: data.Splits | None = None,
             base: tuple[dict, object, dict] | None = None,
             defense=None, secret=None) -> list[ckpt.Checkpoint]:
  """Fine-tunes (or reuses) one model per seed; returns their checkpoints in seed order.

  Args:
    config: see configs/finetune.py.
    workdir: run directory; seed s goes to `workdir/seed_{s}`.
    splits: overrides `load_splits(**config.data)` (tests).
    base: the base model (`lla.model.loading.LoadedModel`; the main job's, tests'), else
      `loading.load_model(config.model)` with its architecture checked. Its tokenizer (one it
      brings, or GPT-2's) is recorded in every fine-tuned checkpoint: the copy is cut, and
      identified, as the base.
    defense: an `lla.defenses` defense kept in the loop while fine-tuning (its mechanism
      on h, mixed labels, clipped gradients or the NoPeek term); recorded by its public
      description only.
    secret: the defense's `lla.defenses.Secret` (its hash is recorded), for a defense that
      draws secrets.

  Raises:
    CheckpointMismatch: a cached seed was made with a different config or base (or a
      defense's secret with another hash: a lost key store); one line naming what differs.
  """
  run_config = json_config(config)
  loss_fn, loss_inputs = loop.lm_step_loss, None
  if defense is not None:
    from lla.defenses.training import DefendedStepLoss  # Only defended fine-tunes need it.
    if defense.has_secret and secret is None:
      raise ValueError(f"defense {defense.name!r} draws secrets: pass its Secret")
    run_config = {**run_config, "defense": defense.to_record(secret)}
    loss_fn = DefendedStepLoss(defense, int(config.k))
    loss_inputs = secret.root_keys(defense.name) if defense.has_secret else None
  if splits is None:
    splits = data.load_splits_from_config(config.data)
  if base is None:
    base = loading.load_model(config.model, check_architecture=True)
  params, cfg, provenance = base.params, base.cfg, base_provenance(base)
  if not 1 <= config.k < cfg.n_layer:
    raise ValueError(f"cut k={config.k} must satisfy 1 <= k < n_layer={cfg.n_layer}")
  # A defense with trained weights of its own (mid's bottleneck): the client's secret,
  # initialised from it, trained with the model under params[defense.params_key], then kept
  # by the defender beside the checkpoint (its hash in the metadata), never in it.
  own_weights = defense is not None and not defense.off and hasattr(defense, "params_key")
  if own_weights:
    params = {**params, defense.params_key: defense.init_weights(cfg, secret)}
  # Their own learning rate, where the defense declares one (MID's `weights_lr`).
  own_lr = getattr(defense, "weights_lr", None) if own_weights else None
  own_rate = None if own_lr is None else (defense.params_key, own_lr)
  tokens = splits.training.tokens
  steps = num_steps(config, tokens.shape[0])
  trainable = loop.trainable_mask(params, config.k, config.train_client_layers)
  base_eval = loop.evaluate(params, cfg, splits.evaluation.tokens, config.eval_batch_size)

  checkpoints = []
  for seed in seeds(config):
    def create(seed=seed):
      result = loop.train(params, cfg, tokens, optimizer=config.optimizer, num_steps=steps,
                          batch_size=config.batch_size, seed=seed, trainable=trainable,
                          log_every=config.log_every, desc=f"finetune seed {seed}",
                          loss_fn=loss_fn, loss_inputs=loss_inputs,
                          own_weights=own_rate)
      model = result.params
      if own_weights:
        model = {n: v for n, v in result.params.items() if n != defense.params_key}
        weights_sha256 = defense.save_weights(defense_weights_file(workdir, seed, defense),
                                              result.params[defense.params_key])
      held_out = loop.evaluate(model, cfg, splits.evaluation.tokens, config.eval_batch_size)
      logging.info("seed %d: held-out CE %.4f -> %.4f", seed, base_eval["ce"], held_out["ce"])
      metadata = {
          "kind": "finetune",
          "run_config": run_config,
          "seed": seed,
          "k": config.k,
          "train_client_layers": config.train_client_layers,
          "knowledge": knowledge(config.train_client_layers),
          "frozen": [] if config.train_client_layers else list(split.client_layer_names(params, config.k)),
          "base": provenance,
          "num_steps": steps,
          "history": result.history,
          "eval_before": base_eval,
          "eval_after": held_out,
          "data": splits.to_json(),
      }
      if own_weights:
        metadata["defense_weights_sha256"] = weights_sha256
      return model, cfg, metadata

    checkpoint, _ = ckpt.load_or_create(seed_dir(workdir, seed), create, export_hf=config.export_hf,
                                        tokenizer=base.recorded_tokenizer)
    differ = _differences(checkpoint.metadata.get("run_config"), run_config, "run_config")
    if checkpoint.metadata["base"]["params_sha256"] != provenance["params_sha256"]:
      differ.append("base.params_sha256")
    if differ:
      raise CheckpointMismatch(f"{checkpoint.path} was made with a different config or base "
                               f"(differs in {', '.join(differ)[:300]}); use another --workdir "
                               "or delete it")
    if own_weights:
      weights = defense.load_weights(defense_weights_file(workdir, seed, defense),
                                     checkpoint.metadata.get("defense_weights_sha256", ""))
      checkpoint = dataclasses.replace(
          checkpoint, params={**checkpoint.params, defense.params_key: weights})
    checkpoints.append(checkpoint)
  _write_manifest(workdir, checkpoints)
  return checkpoints


def _write_manifest(workdir: str | os.PathLike, checkpoints: list[ckpt.Checkpoint]) -> None:
  """workdir/models.json: seed -> directory and params sha256 (written atomically)."""
  manifest = [{"seed": c.metadata["seed"], "path": str(c.path), "params_sha256": c.sha256,
               "hf_dir": str(c.hf_dir) if c.hf_dir else None,
               "knowledge": c.metadata["knowledge"], "k": c.metadata["k"]} for c in checkpoints]
  path = pathlib.Path(workdir) / MANIFEST_FILE
  tmp = path.with_suffix(".json.tmp")
  tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
  os.replace(tmp, path)
