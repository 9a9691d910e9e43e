"""Split fine-tuning with an honest or a malicious server: runs, captures, detection, replay.

This is the only module that holds both parties' states. A step is one jitted pure
function of (client state, server state, batch, public batch, fake-batch shift, step, key):
the client sends a `Forward`, the server answers a `Backward`, the client applies it. Keys
are split per step from the run's seed and the batch order, fake-batch plan and public
batches come from seeded numpy generators, so a run replays bit for bit.

Layout of `workdir`:

    base/                   the base model when it is made here (tiny variant)
    pilot/                  the server's pilot/decoder pre-trained on public text (hashed)
    runs/<run>.json         one run: detector windows, task loss, per-step logs, captures
    captures/<run>/step_<N> the evaluation documents through the client frozen at step N,
                            with the server's reply (and, hijacked, its decoder)
    thresholds.json         detector thresholds from the calibration seeds, hashed, written
                            before any judged run
    study/                  replay records, scored and sealed (unless the caller names
                            its own study)
    summary.json            recovery, task loss and detection, pooled over seeds

Every finished run, capture and replay is reused when the experiment is run again on the
same workdir with the same config (a different config is refused).
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from safetensors.numpy import load as load_safetensors
from safetensors.numpy import save as save_safetensors

from lla import data
from lla.active import attack as fsha_attack
from lla.active import client, detectors, fsha, parts, public, servers
from lla.active.protocol import check_forward
from lla.replay import driver as replay
from lla.capture import capture, store
from lla.evidence import files, rundir
from lla.model import checkpoint as ckpt
from lla.model import loading
from lla.model import split
from lla.protocol import tuple as protocol
from lla.scoring import metrics
from lla.train import loop

ACTIVE_SERVER = protocol.Attacker("active_server", ("observe", "write_gradient"))


class ActiveInputError(ValueError):
  """The experiment's inputs do not fit together (found before anything is trained)."""


# --- what all runs of one experiment share ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Setup:
  """The experiment's fixed inputs (host side).

  Attributes:
    config: configs/active.py.
    config_sha256: identity of the config; stored runs made under another are refused.
    cfg, base: the base GPT-2 and its parameters (the client's starting point; its tail
      is the honest server's starting point and the client's public reference tail).
    base_id, base_source: params sha256 and how to load them (lla.model.loading).
    splits: the client's documents (training batches, evaluation documents).
    public: [n_public, T] the server's public windows.
    pilot, pilot_sha256: the pre-trained pilot/decoder, or None without FSHA runs.
    cspec: the client's static description.
    tokenizer: the base's own tokenizer (None: GPT-2's), part of each trained client's
      model id (lla.model.loading.identify).
  """

  config: ml_collections.ConfigDict
  config_sha256: str
  cfg: split.ModelConfig
  base: dict
  base_id: str
  base_source: dict
  splits: data.Splits
  public: np.ndarray
  pilot: dict | None
  pilot_sha256: str | None
  cspec: client.ClientSpec
  pilot_self_inversion: float | None = None
  tokenizer: object = None

  @property
  def cut(self) -> int:
    return int(self.config.cut)

  @property
  def eval_tokens(self) -> np.ndarray:
    return np.asarray(self.splits.evaluation.tokens)

  @functools.cached_property
  def ref_tail(self) -> dict:
    return parts.tail_params(self.base, self.cfg, self.cut)

  @functools.cached_property
  def splitout_sets(self) -> dict:
    """SplitOut's honest sets by seed (`splitout_honest_set`), computed once per process."""
    return {}


def load_base(config, workdir: pathlib.Path) -> tuple[loading.LoadedModel, dict]:
  """(the base model, its loading source) (lla.model.loading.load_model, which checks an lla
  checkpoint's architecture against the config; a GGUF file's or a directory's is its own).
  With no source and `init_seed` >= 0, a seeded random init saved once under workdir/base
  (the tiny variant).
  """
  model = ml_collections.ConfigDict(config.model.to_dict())
  if not loading.source_of(model):
    if model.init_seed < 0:
      raise ValueError("config.model names no checkpoint, hf_dir or hub: name the pre-trained "
                       "base (e.g. --config.model.checkpoint=RUN/pretrain/checkpoint)")
    cfg = loading.architecture(model)
    create = lambda: (split.init_params(cfg, jax.random.key(model.init_seed)), cfg,
                      {"kind": "random-init", "seed": int(model.init_seed)})
    checkpoint, _ = ckpt.load_or_create(workdir / "base", create, export_hf=False)
    model.checkpoint = str(checkpoint.path)
  return loading.load_model(model, check_architecture=True), loading.source_of(model)


def fsha_spec(config, cfg: split.ModelConfig) -> fsha.FSHASpec:
  f = config.fsha
  return fsha.FSHASpec(vocab_size=cfg.vocab_size, seq_len=int(config.data.seq_len),
                       width=cfg.n_embd, critic_hidden=int(f.critic_hidden),
                       gp_weight=float(f.gp_weight), lr_pilot=float(f.lr_pilot),
                       lr_critic=float(f.lr_critic), critic_steps=int(f.critic_steps),
                       train_pilot=bool(f.train_pilot),
                       alpha=float(f.alpha),
                       stats_steps=int(f.stats_steps), zero_last_row=bool(f.zero_last_row))


def pretrained_pilot(config, cfg, public_tokens: np.ndarray, directory: pathlib.Path):
  """(pilot, sha256, history): the server's pilot/decoder trained on public text, cached."""
  path, meta_path = directory / "pilot.safetensors", directory / "pilot.json"
  spec = fsha_spec(config, cfg)
  f = config.fsha
  plan = {"pretrain_steps": int(f.pretrain_steps), "pretrain_lr": float(f.pretrain_lr),
          "batch_size": int(config.batch_size), "seed": int(f.pilot_seed),
          "public_sha256": data.token_sha256(public_tokens),
          "shape": [spec.vocab_size, spec.seq_len, spec.width]}
  if meta_path.exists():
    meta = files.read_json(str(meta_path))
    raw = path.read_bytes()
    if meta["plan"] != plan or files.sha256_bytes(raw) != meta["sha256"]:
      raise ValueError(f"{directory}: pilot made with another plan or changed; use a new workdir")
    pilot = {k: jnp.asarray(v) for k, v in load_safetensors(raw).items()}
    return pilot, meta["sha256"], meta["history"]
  rng = np.random.default_rng(int(f.pilot_seed))
  batches = (public_tokens[rng.integers(0, len(public_tokens), int(config.batch_size))]
             for _ in range(int(f.pretrain_steps)))
  pilot = fsha.init_pilot(spec, jax.random.key(int(f.pilot_seed)))
  pilot, losses = fsha.pretrain(pilot, batches, float(f.pretrain_lr))
  raw = save_safetensors({k: np.asarray(v) for k, v in pilot.items()})
  directory.mkdir(parents=True, exist_ok=True)
  files.atomic_write_bytes(str(path), raw, overwrite=True)
  history = {"first": losses[:5], "last": losses[-5:], "every_10": losses[::10]}
  files.atomic_write_json(str(meta_path), {"plan": plan, "sha256": files.sha256_bytes(raw),
                                           "history": history}, overwrite=True)
  return pilot, files.sha256_bytes(raw), history


def make_setup(config, workdir: pathlib.Path) -> Setup:
  base, source = load_base(config, workdir)
  params, cfg, base_id = base.params, base.cfg, base.model_id
  # The model's own tokenizer (a GGUF's, an hf_dir's tokenizer.json) cuts the documents and
  # the public windows; its BOS, if any, starts each, public and unscored.
  tokenizer = base.text_tokenizer("token files, which the active tier does not take")
  splits = data.load_splits(**config.data.to_dict(), tokenizer=tokenizer)
  largest = max(int(np.max(part.tokens)) for _, part in splits.items())
  if largest >= cfg.vocab_size:
    # An embedding lookup would clamp the id silently: refuse the pairing instead.
    raise ActiveInputError(f"the documents hold token id {largest}, beyond the model's vocabulary of "
                     f"{cfg.vocab_size}: use a model with the data's tokenizer")
  public_tokens = public.public_windows(splits, int(config.public.n_docs),
                                        int(config.public.seed), config.data.data_dir,
                                        tokenizer)
  pilot = pilot_sha = self_inversion = None
  if any(kind != "honest" for kind, _ in config.attacks):
    pilot, pilot_sha, _ = pretrained_pilot(config, cfg, public_tokens, workdir / "pilot")
    held_out = jnp.asarray(public_tokens[-int(config.batch_size):])
    identity = (jnp.zeros(cfg.n_embd), jnp.ones(cfg.n_embd))
    decoded = fsha.invert(pilot["emb"], pilot["tau"], pilot["bias"], *identity,
                          fsha.pilot_features(pilot, held_out))
    self_inversion = float(jnp.mean(decoded == held_out))
  cspec = client.ClientSpec.make(cfg, int(config.cut), config.client_optimizer,
                                 int(config.num_steps))
  return Setup(config, files.sha256_bytes(files.canonical_json(config.to_dict())), cfg, params,
               base_id, source, splits, public_tokens, pilot, pilot_sha, cspec, self_inversion,
               tokenizer)


def make_server(setup: Setup, kind: str, beta: float):
  honest = servers.HonestServer(setup.cfg, setup.cut,
                                setup.config.server_optimizer.to_json(sort_keys=True),
                                int(setup.config.num_steps))
  if kind == "honest":
    return honest
  hijack = servers.FSHAServer(fsha_spec(setup.config, setup.cfg))
  if kind == "fsha":
    return hijack
  if kind == "mixed":
    return servers.MixedFSHAServer(honest, hijack, float(beta))
  raise ValueError(f"server kind {kind!r}: expected one of {servers.KINDS}")


def init_server(setup: Setup, server, key: jax.Array) -> dict:
  tail = parts.tail_params(setup.base, setup.cfg, setup.cut)
  if server.kind == "honest":
    return server.init(tail)
  if server.kind == "fsha":
    return server.init(setup.pilot, key)
  return server.init(tail, setup.pilot, key)


# --- the jitted step and its companions --------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("cspec", "server"))
def train_step(cspec: client.ClientSpec, server, cstate: dict, sstate: dict, tokens, public_batch,
               shift, step, run_id, key):
  """One split step: (client state, server state, out {h, g, probe, log})."""
  forward, vjp = client.forward(cspec, cstate, tokens, step, run_id)
  check_forward(forward)
  oracle = client.oracle_for(tokens, shift, cspec.cfg.vocab_size)
  sstate, backward, log = server.step(sstate, forward, oracle, public_batch, key)
  cstate, grads = client.apply(cspec, cstate, vjp, backward, shift > 0)
  return cstate, sstate, {"h": forward.h, "g": backward.g, "probe": client.probe_vector(grads),
                          "log": log}


@functools.partial(jax.jit, static_argnames=("cspec", "server"))
def frozen_reply(cspec: client.ClientSpec, server, cstate: dict, sstate: dict, tokens):
  """(h, g) of documents [B, T] through the frozen client and the server's reply."""
  forward = client.forward(cspec, cstate, tokens, jnp.int32(-1), jnp.int32(-1))[0]
  oracle = client.oracle_for(tokens, jnp.int32(0), cspec.cfg.vocab_size)
  return forward.h, server.respond(sstate, forward, oracle).g


@functools.partial(jax.jit, static_argnames=("cfg", "k"))
def reference_gradient(ref_tail: dict, h, labels, cfg: split.ModelConfig, k: int):
  return client.reference_gradient(ref_tail, cfg, h, labels, k)


@functools.partial(jax.jit, static_argnames=("cfg", "k"))
def heldout_ce(own: dict, ref_tail: dict, tokens, cfg: split.ModelConfig, k: int):
  return client.heldout_ce(own, ref_tail, cfg, tokens, k)


# --- one run ------------------------------------------------------------------------------


def server_label(kind: str, beta: float) -> str:
  """'honest', 'fsha' or 'mixed0.2'."""
  return f"mixed{beta:g}" if kind == "mixed" else kind


def run_name(kind: str, beta: float, seed: int) -> str:
  return f"{server_label(kind, beta)}_s{seed}"


def _task_loss(setup: Setup, cstate: dict, tail: dict) -> float:
  """Held-out CE of the client's current layers followed by `tail`, over its evaluation
  documents."""
  tokens, size = setup.eval_tokens, int(setup.config.batch_size)
  total = sum(float(heldout_ce(cstate["params"], tail, tokens[i:i + size],
                               cfg=setup.cfg, k=setup.cut)) * len(tokens[i:i + size])
              for i in range(0, len(tokens), size))
  return total / len(tokens)


def write_capture(setup: Setup, server, cstate: dict, sstate: dict, name: str, kind: str,
                  seed: int, step: int, directory: pathlib.Path) -> str:
  """The evaluation documents through the client frozen at `step` and the server's reply;
  a hijacking server's decoder of that step goes with it (hashed)."""
  def write(path: str) -> str:
    tokens, size = setup.eval_tokens, int(setup.config.batch_size)
    hs, gs = [], []
    for i in range(0, len(tokens), size):
      h, g = frozen_reply(setup.cspec, server, cstate, sstate, jnp.asarray(tokens[i:i + size]))
      hs.append(np.asarray(h))
      gs.append(np.asarray(g))
    active = {"run": name, "server": kind, "seed": seed, "step": step,
              "config_sha256": setup.config_sha256}
    extra_files, attacker = None, None
    hijack = servers.fsha_state(server, sstate)
    if hijack is not None:
      raw = fsha_attack.decoder_bytes(fsha.decoder_of(hijack))
      extra_files = {fsha_attack.DECODER_FILE: raw}
      active.update(decoder_file=fsha_attack.DECODER_FILE, decoder_sha256=files.sha256_bytes(raw),
                    pilot_sha256=setup.pilot_sha256)
      attacker = ACTIVE_SERVER
    if kind == "mixed":
      active["beta"] = float(server.beta)
    return capture.capture_target(
        path, None, setup.cfg, tokens, setup.splits.evaluation.document_ids, setup.cut,
        model_id=loading.identify(ckpt.params_sha256(cstate["params"]), setup.cfg,
                                  setup.tokenizer)[0], corpus=setup.splits.corpus,
        split_hashes={n: p.sha256 for n, p in setup.splits.items()}, training=True,
        batch_size=size, messages=(np.concatenate(hs), np.concatenate(gs)),
        extra_metadata={"active": active}, attacker=attacker, extra_files=extra_files,
        known_prefix=setup.splits.known_prefix, corpus_copy=setup.splits.copy)

  return store.reuse_or_write(directory, write)


def splitout_honest_set(setup: Setup, seed: int) -> np.ndarray:
  """SplitOut's honest set [n, p]: the probe vectors of the split training that the client
  of `seed` simulates before it trains: `detectors.splitout_honest_steps` steps on batches
  of its own training documents (drawn apart from the run's batch order), against an
  honest server that starts from the client's copy of the public pre-trained tail. It does
  not depend on the server: the client cannot tell servers apart before training."""
  if seed not in setup.splitout_sets:
    size = int(setup.config.batch_size)
    server = make_server(setup, "honest", 0.0)
    cstate = client.init(setup.cspec, setup.base)
    sstate = init_server(setup, server, jax.random.key(0))
    rng = np.random.default_rng([seed, 3])
    tokens = np.asarray(setup.splits.training.tokens)
    unused = setup.public[:size]  # The honest server reads neither public text nor a key.
    vectors = []
    for s in range(int(setup.config.detectors.splitout_honest_steps)):
      batch = tokens[rng.choice(len(tokens), size, replace=False)]
      cstate, sstate, out = train_step(setup.cspec, server, cstate, sstate, batch, unused,
                                       jnp.int32(0), jnp.int32(s), jnp.int32(seed),
                                       jax.random.key(0))
      vectors.append(np.asarray(out["probe"]))
    setup.splitout_sets[seed] = np.stack(vectors)
  return setup.splitout_sets[seed]


def simulate(setup: Setup, kind: str, beta: float, seed: int, workdir: pathlib.Path,
             capture_steps=()) -> dict:
  """One split fine-tuning run; writes runs/<name>.json (reused if finished).

  Returns:
    {"name", "kind", "beta", "seed", "windows": {detector: [[step, alarm score], ...]},
     "task_loss": {step: held-out CE with the server's task tail (the public one if none)},
     "public_tail_loss": {step: held-out CE with the public pre-trained tail},
     "captures": {step: manifest sha256}, "steps": [per-step log], "wall_s"}.
  """
  config = setup.config
  name = run_name(kind, beta, seed)
  path = workdir / "runs" / f"{name}.json"
  if path.exists():
    result = files.read_json(str(path))
    if result["config_sha256"] != setup.config_sha256:
      raise ValueError(f"{path} was made under another config; use a new workdir")
    return result
  start = time.time()
  server = make_server(setup, kind, beta)
  k_init, k_steps = jax.random.split(jax.random.key(seed))
  cstate, sstate = client.init(setup.cspec, setup.base), init_server(setup, server, k_init)
  num_steps, size = int(config.num_steps), int(config.batch_size)
  det = config.detectors
  guard = detectors.SplitGuard(int(det.splitguard_warmup), float(det.p_fake), float(det.mult),
                               float(det.exp))
  shifts = guard.plan(num_steps, setup.cfg.vocab_size, np.random.default_rng([seed, 1]))
  scrutinizer = detectors.Scrutinizer(int(det.scrutinizer_every))
  splitout = detectors.SplitOut(splitout_honest_set(setup, seed), int(det.splitout_window))
  public_rng = np.random.default_rng([seed, 2])
  batches = loop.batches(np.asarray(setup.splits.training.tokens), size, seed)
  keys = jax.random.split(k_steps, num_steps)
  windows = {name_: [] for name_ in detectors.DETECTORS}
  task_loss, public_tail_loss, captures, steps = {}, {}, {}, []
  for s in range(num_steps + 1):
    if s in capture_steps:
      # The model the client is served: its layers and the server's task tail (FSHA trains
      # none: the public pre-trained tail); and, for comparison, the public tail for all.
      deployed = servers.task_tail(server, sstate)
      task_loss[str(s)] = _task_loss(setup, cstate,
                                     setup.ref_tail if deployed is None else deployed)
      public_tail_loss[str(s)] = _task_loss(setup, cstate, setup.ref_tail)
      captures[str(s)] = write_capture(setup, server, cstate, sstate, name, kind, seed, s,
                                       workdir / "captures" / name / f"step_{s}")
    if s == num_steps:
      break
    tokens = next(batches)
    public_batch = setup.public[public_rng.integers(0, len(setup.public), size)]
    cstate, sstate, out = train_step(setup.cspec, server, cstate, sstate, tokens, public_batch,
                                     jnp.int32(shifts[s]), jnp.int32(s), jnp.int32(seed), keys[s])
    g = out["g"]
    # The labels the client sent (a fake batch's are shifted): the reference must answer
    # the same question as the server, and the Scrutinizer groups rows by them.
    labels = (tokens + shifts[s]) % setup.cfg.vocab_size if shifts[s] else tokens
    if s % int(det.reference_every) == 0:
      g_ref = reference_gradient(setup.ref_tail, out["h"], labels, cfg=setup.cfg, k=setup.cut)
      windows["reference_cosine"].append(
          [s, 1.0 - detectors.reference_cosine(np.asarray(g), np.asarray(g_ref))])
    window = guard.observe(s, np.asarray(out["probe"]), int(shifts[s]))
    if window is not None:
      windows["splitguard"].append(list(window))
    window = scrutinizer.observe(s, np.asarray(g), np.asarray(labels))
    if window is not None:
      windows["scrutinizer"].append(list(window))
    # SplitGuard's fake batches are the client's own probes, not training: SplitOut skips them.
    window = None if shifts[s] else splitout.observe(s, np.asarray(out["probe"]))
    if window is not None:
      windows["splitout"].append(list(window))
    log = {k: float(v) for k, v in jax.device_get(out["log"]).items()}
    row_norm = float(jnp.mean(jnp.sqrt(jnp.sum(g[:, :-1] ** 2, axis=-1))))
    steps.append({"step": s, "fake": bool(shifts[s]), "g_row_norm": row_norm, **log})
    if not np.isfinite(row_norm) or not all(np.isfinite(v) for v in log.values()):
      raise FloatingPointError(f"run {name}: non-finite value at step {s}: {log}")
  result = {"name": name, "kind": kind, "beta": float(beta), "seed": seed,
            "config_sha256": setup.config_sha256, "windows": windows, "task_loss": task_loss,
            "public_tail_loss": public_tail_loss, "captures": captures, "steps": steps,
            "wall_s": time.time() - start}
  path.parent.mkdir(parents=True, exist_ok=True)
  files.atomic_write_json(str(path), result, overwrite=True)
  logging.info("active run %s: %d steps in %.0f s", name, num_steps, result["wall_s"])
  return result


# --- thresholds, judged runs, replays, summary ----------------------------------------------------


def thresholds(setup: Setup, workdir: pathlib.Path) -> dict:
  """Detector thresholds from the calibration honest seeds: written (hashed) once, before
  any judged run; a stored file is checked against its hash and the config."""
  path = workdir / "thresholds.json"
  source = {"seeds": [int(s) for s in setup.config.calibration_seeds], "server": "honest",
            "config_sha256": setup.config_sha256}
  if path.exists():
    stored = files.read_json(str(path))
    detectors.check_thresholds(stored)
    if stored["source"] != source:
      raise ValueError(f"{path} was fixed for another config or seeds; use a new workdir")
    return stored
  pooled = {name: [] for name in detectors.DETECTORS}
  for seed in setup.config.calibration_seeds:
    result = simulate(setup, "honest", 0.0, int(seed), workdir)
    for name in detectors.DETECTORS:
      pooled[name] += [score for _, score in result["windows"][name]]
  fixed = detectors.calibrate(pooled, float(setup.config.detectors.quantile), source)
  files.atomic_write_json(str(path), fixed)
  return fixed


def _attacker(setup: Setup, knowledge: str) -> replay.Attacker:
  # Knowledge `none` still names the base weights: the replay runtime loads an attacker
  # model for every attack; `fsha_decode` declares needs_weights=False and never reads them.
  return replay.Attacker(setup.base, setup.cfg, setup.base_id,
                         np.asarray(setup.splits.calibration.tokens), knowledge,
                         setup.base_source)


def replay_run(setup: Setup, result: dict, workdir: pathlib.Path, study: pathlib.Path) -> None:
  """Replays the configured attacks on every capture of one judged run into `study`."""
  config = setup.config
  names = config.replay.honest if result["kind"] == "honest" else config.replay.hijacked
  by_knowledge = {}
  for attack_name in names:
    knowledge = "none" if attack_name == "fsha_decode" else "trained"
    by_knowledge.setdefault(knowledge, []).append(attack_name)
  for step in result["captures"]:
    directory = workdir / "captures" / result["name"] / f"step_{step}"
    for knowledge, attacks in sorted(by_knowledge.items()):
      replay.replay(str(study), str(directory), _attacker(setup, knowledge), attacks,
                    config.replay.budget, 0, run_prefix=f"active/{result['name']}/step{step}/",
                    model_seed=int(result["seed"]),
                    memory_budget_bytes=int(config.replay.memory_budget_mb) << 20)


def recovery(study: pathlib.Path, run: str, step: str, attack_name: str) -> dict | None:
  """Token recovery (hits, n) and the frequency baseline of one replayed attack, or None."""
  name = replay.file_name(f"active/{run}/step{step}/{attack_name}")
  path = study / rundir.RECORDS / f"{name}.json"
  if not path.exists():
    return None
  record = files.read_json(str(path))
  if record["status"] != "ok":
    return {"status": record["status"], "error": record["error"]}
  pred = rundir.load_predictions(rundir.resolve(str(study), record["prediction_file"]))
  truth = rundir.load_truth(rundir.resolve(str(study), record["truth_file"]))
  hits, n = metrics.token_recovery(pred, truth, record["scored_positions"])
  base, _ = metrics.baseline_hits(truth, record["baseline_token"], record["scored_positions"])
  return {"status": "ok", "hits": hits, "n": n, "baseline_hits": base}



def summarise(setup: Setup, calibration: dict, judged: list[dict], study: pathlib.Path) -> dict:
  """Recovery per (server, step, attack) and task loss per (server, step), pooled over
  seeds; detection per (detector, server) at the fixed thresholds."""
  config = setup.config
  z = float(config.detectors.wilson_z)
  groups = {}
  for result in judged:
    groups.setdefault(server_label(result["kind"], result["beta"]), []).append(result)
  recovery_rows, loss_rows, progress_rows = [], [], []
  for group, results in sorted(groups.items()):
    if results[0]["kind"] != "honest":
      # The critic's estimate of how far the client's h are from the pilot's features
      # (the Wasserstein gap D(h) - D(z')); a converging hijack drives it to 0.
      for step in results[0]["captures"]:
        if int(step) > 0:
          gaps = [r["steps"][int(step) - 1]["critic_client"]
                  - r["steps"][int(step) - 1]["critic_pilot"] for r in results]
          progress_rows.append({"server": group, "step": int(step),
                                "critic_gap": float(np.mean(gaps)), "per_seed": gaps})
    names = config.replay.honest if results[0]["kind"] == "honest" else config.replay.hijacked
    for step in results[0]["captures"]:
      losses = [r["task_loss"][step] for r in results]
      loss_rows.append({"server": group, "step": int(step), "task_loss": float(np.mean(losses)),
                        "public_tail_loss": float(np.mean([r["public_tail_loss"][step]
                                                           for r in results])),
                        "per_seed": losses})
      for attack_name in names:
        per_seed = [recovery(study, r["name"], step, attack_name) for r in results]
        ok = [p for p in per_seed if p and p["status"] == "ok"]
        hits, n = sum(p["hits"] for p in ok), sum(p["n"] for p in ok)
        recovery_rows.append({
            "server": group, "step": int(step), "attack": attack_name, "seeds": len(ok),
            "token_recovery": hits / n if n else None,
            "baseline": sum(p["baseline_hits"] for p in ok) / n if n else None,
            "per_seed": [p["hits"] / p["n"] if p and p["status"] == "ok" else None
                         for p in per_seed]})
  detection = {}
  for name in detectors.DETECTORS:
    threshold = calibration["thresholds"][name]
    detection[name] = {"threshold": threshold}
    for group, results in sorted(groups.items()):
      judged_runs = [detectors.judge(r["windows"][name], threshold) for r in results]
      detection[name][group] = detectors.rates(judged_runs, z)
  return {"config_sha256": setup.config_sha256, "thresholds_sha256": calibration["sha256"],
          "pilot_self_inversion": setup.pilot_self_inversion,
          "thresholds": calibration["thresholds"], "calibration_windows": calibration["windows"],
          "recovery": recovery_rows, "task_loss": loss_rows, "hijack_progress": progress_rows,
          "detection": detection,
          "curves": {r["name"]: {"kind": r["kind"], "beta": r["beta"], "windows": r["windows"]}
                     for r in judged},
          "wall_s": {r["name"]: r["wall_s"] for r in judged}}


def run(config: ml_collections.ConfigDict, workdir: str, study: str | None = None) -> dict:
  """The whole experiment; returns (and writes) summary.json.

  Its own study (workdir/study) is held under its lock from the first check to its seal,
  scored and sealed (lla.evidence.rundir.finalize) as the main job's studies are: a second
  run on the same workdir is refused (rundir.RunLockedError) before anything is trained, and
  a run on a finished study verifies it and summarises its records again, writing nothing
  into it.

  Args:
    config: configs/active.py.
    workdir: its directory (resumable).
    study: a study directory (lla.evidence.rundir) to replay into, e.g. the main job's;
      default workdir/study. A caller's study is locked, scored and sealed by the caller.

  Raises:
    rundir.RunLockedError: another process is writing workdir/study.
    ActiveInputError: a finished study that fails verification, or inputs that do not fit.
  """
  workdir = pathlib.Path(workdir)
  if study is not None:
    return _run(config, workdir, pathlib.Path(study), own_study=False)
  own = workdir / "study"
  with rundir.locked(str(own), what="experiments.active_server"):
    return _run(config, workdir, own, own_study=True)


def _run(config, workdir: pathlib.Path, study_dir: pathlib.Path, own_study: bool) -> dict:
  finished = own_study and rundir.started(str(study_dir)) and rundir.log(str(study_dir)).sealed
  if finished:
    # A crash between the seal and the manifest left the manifest to write.
    rundir.finalize(str(study_dir))
    problems = rundir.verify(str(study_dir))
    if problems:
      raise ActiveInputError(f"{study_dir}: finished study fails verification: "
                             + "; ".join(problems))
  workdir.mkdir(parents=True, exist_ok=True)
  setup = make_setup(config, workdir)
  fixed = thresholds(setup, workdir)
  steps = tuple(int(s) for s in config.capture_steps)
  judged = []
  for seed in config.seeds:
    judged.append(simulate(setup, "honest", 0.0, int(seed), workdir, steps))
    for kind, beta in config.attacks:
      judged.append(simulate(setup, kind, float(beta), int(seed), workdir, steps))
  if not finished:
    if not rundir.started(str(study_dir)):  # a create interrupted before its log entry: redone
      rundir.create_study(str(study_dir), {"config": config.to_dict(), "kind": "active_server"})
    for result in judged:
      replay_run(setup, result, workdir, study_dir)
    if own_study:
      # Scored with the modules its threat space records, then sealed.
      from lla.scoring import scorecard  # pylint: disable=g-import-not-at-top
      replay.record_threat_space(str(study_dir))
      scorecard.score_run(str(study_dir), config.scoring, overwrite=True)
      rundir.finalize(str(study_dir))
  summary = summarise(setup, fixed, judged, study_dir)
  if config.decoy_probe.enabled:
    from lla.active import decoy_probe  # pylint: disable=g-import-not-at-top
    summary["decoy_probe"] = decoy_probe.run(config.decoy_probe, str(workdir / "decoy_probe"))
  files.atomic_write_json(str(workdir / "summary.json"), summary, overwrite=True)
  return summary
