"""The main job: from a base model to a scored, verifiable study directory and a report.

Layout of `workdir`:

    pretrain/checkpoint            the base model (cached)
    finetune/k{k}_{knowledge}/     fine-tuned targets, one per model seed (cached)
    captures/<name>/               boundary messages of each target (cached, hash-verified)
    study/                         the run directory of every attack record (lla.evidence)
    decoy/                         the decoy-row training split (lla.decoy): its captures and
                                   own table; its attacks' results are records of study/
    active/                        the active-server tier (lla.active), its own study
    frontier/                      the FLOP-matched frontier sweep (lla.sweep), its own study
    report/                        report.md and its figures

Every phase reuses finished artifacts: checkpoints and captures are verified by hash, and
replay skips attacks whose predictions and records are already in the study. The scorecard
carries coverage over every registered module and the qualification matrix
(lla.study.qualification). A finished (sealed) study is verified and only its report is
rendered again.
"""

from __future__ import annotations

import dataclasses
import resource
import json
import pathlib
import time

import ml_collections
import numpy as np
from absl import logging
from tqdm import tqdm

from lla import allocator
from lla import data
from lla import runtime
from lla.attacks import memory, registry
from lla.replay import driver as replay
from lla.capture import capture, store
from lla.decoy import run as decoy_run
from lla.evidence import files, manifest, rundir
from lla.scoring import scorecard
from lla.scoring import threat_space
from lla.scoring.policy import load_policy
from lla.study import defense_sweep
from lla.study import qualification as study_qualification
from lla.train import finetune as finetune_lib
from lla.model import loading
from lla.train import pretrain as pretrain_lib
from lla.model import checkpoint as checkpoint_lib

STUDY, CAPTURES, DECOY, ACTIVE, TIMING = "study", "captures", "decoy", "active", "timing.json"
FRONTIER = "frontier"


class WorkdirMismatch(ValueError):
  """The workdir's study cannot be resumed by this job: another config or binary started
  it, or it fails verification."""


class DocumentCountError(ValueError):
  """The config asks a phase for more evaluation documents than the job draws."""


def check_document_counts(config: ml_collections.ConfigDict) -> None:
  """The defended captures and the published attacks take the first documents of the
  evaluation split; asked for more than it holds, they would run on fewer, silently (and a
  defense gate's floor would be wider than its config says)."""
  n_eval = int(config.data.n_eval)
  for field, wanted in (("defense_docs", config.defense_docs),
                        ("published.docs", config.published.docs)):
    if int(wanted) > n_eval:
      raise DocumentCountError(
          f"config.{field} = {int(wanted)} exceeds config.data.n_eval = {n_eval}, the "
          "evaluation documents it is taken from; raise data.n_eval or lower it")


# Fine-tuned copies held in memory at once: the defense phase cycles over one per model seed
# (3 in every CPU variant), and each phase goes over the copies in order, so no copy is
# restored twice within a phase.
RESIDENT_COPIES = 3


@dataclasses.dataclass(frozen=True)
class Target:
  """One fine-tuned target and the attacker that faces it. Its params are restored from its
  checkpoint when a phase reads them (`resident` holds a few), so that the job never holds
  every copy it has made."""

  cut: int
  knowledge: str
  model_seed: int
  checkpoint: pathlib.Path
  cfg: object
  model_id: str           # identity in E (lla.model.loading.identify)
  params_sha256: str      # its checkpoint's params
  attacker_source: dict   # lla.model.loading spec of the attacker's weights
  # Trained knowledge: the base model's (params, sha256), which the job holds anyway; None:
  # the attacker holds the target's exact client layers (public knowledge).
  base: tuple[dict, str] | None
  resident: checkpoint_lib.Resident = dataclasses.field(repr=False, compare=False)

  @property
  def params(self) -> dict:
    return self.resident.params(self.checkpoint, self.params_sha256)

  def attacker(self, calibration: np.ndarray) -> replay.Attacker:
    params, model_id = (self.params, self.model_id) if self.base is None else self.base
    return replay.Attacker(params, self.cfg, model_id, calibration, self.knowledge,
                           self.attacker_source)

  @property
  def name(self) -> str:
    return f"k{self.cut}_{self.knowledge}_m{self.model_seed}"


def _peak_rss_mb() -> float:
  """The process's resident high-water mark so far (Linux reports ru_maxrss in KiB)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _phase(workdir: pathlib.Path, name: str) -> None:
  """Starts phase `name`: logged, and timed in timing.json (each phase ends when the next
  one, or the invocation, does), with the process's peak RSS so far (the phase whose end
  raises it holds the job's peak) and, once the heap's free pages are given back where
  many are resident (lla.allocator.release_free), malloc's bytes in use and kept free
  (lla.allocator.heap_usage: what the phases before it left held), how much of it is JAX
  arrays still referenced (lla.runtime.held_arrays), the RSS left and what the process
  has compiled so far (lla.runtime.compile_totals; a phase's own: the next phase's minus
  its). A long
  study's compiled executables are dropped here before they exhaust the process's memory
  mappings (lla.runtime)."""
  runtime.release_compiled_when_crowded()
  allocator.release_free()
  logging.info("== phase: %s", name)
  tqdm.write(f"[main_table] phase: {name}")
  path = workdir / TIMING
  if path.exists():
    timing = files.read_json(str(path))
    timing["invocations"][-1].setdefault("phases", []).append(
        {"name": name, "started_unix": time.time(), "peak_rss_mb": _peak_rss_mb(),
         "heap": allocator.heap_usage(), "jax_arrays": runtime.held_arrays(),
         "rss_mb": allocator.resident_mb(), "compile": runtime.compile_totals()})
    files.atomic_write_json(str(path), timing, overwrite=True)


def base_model(config: ml_collections.ConfigDict, workdir: pathlib.Path, splits,
               loaded: loading.LoadedModel | None):
  """(base, source) of the base (`lla.model.loading.LoadedModel`): `loaded` (paper, a GGUF
  file: loaded before the splits, which its tokenizer cuts), else pre-trained here (never on
  this job's training or evaluation passages, `splits`)."""
  if loaded is not None:
    return loaded, loading.source_of(config.model)
  model = ml_collections.ConfigDict(config.model.to_dict())
  checkpoint = pretrain_lib.pretrain(config.pretrain, workdir / "pretrain", exclude=splits)
  model.checkpoint = str(checkpoint.path)
  return loading.load_model(model, check_architecture=True), loading.source_of(model)


def target_id(checkpoint: checkpoint_lib.Checkpoint) -> str:
  """A fine-tuned checkpoint's model id: its params with its config and tokenizer."""
  return loading.identify(checkpoint.sha256, checkpoint.cfg, checkpoint.tokenizer)[0]


def fine_tuned_targets(config, workdir: pathlib.Path, splits, base, base_source) -> list[Target]:
  targets = []
  base_params, base_id = base.params, base.model_id
  resident = checkpoint_lib.Resident(RESIDENT_COPIES)
  for cut, knowledge in config.settings:
    ft = ml_collections.ConfigDict(config.finetune.to_dict())
    ft.k, ft.train_client_layers = int(cut), knowledge == "trained"
    ft.data = config.data
    checkpoints = finetune_lib.finetune(ft, workdir / "finetune" / f"k{cut}_{knowledge}",
                                        splits=splits, base=base)
    for seed, checkpoint in zip(finetune_lib.seeds(ft), checkpoints):
      # Public: the attacker holds the target's exact client layers; trained: only the base.
      public = knowledge == "public"
      targets.append(Target(int(cut), knowledge, seed, checkpoint.path, checkpoint.cfg,
                            target_id(checkpoint), checkpoint.sha256,
                            {"checkpoint": str(checkpoint.path)} if public else base_source,
                            None if public else (base_params, base_id), resident))
    del checkpoints, checkpoint  # Their params: restored again when a phase reads them.
  return targets


def capture_targets(config, workdir: pathlib.Path, targets: list[Target], splits) -> dict:
  hashes = {name: p.sha256 for name, p in splits.items()}
  out = {}
  for target in tqdm(targets, desc="captures", unit="capture"):
    directory = workdir / CAPTURES / target.name
    store.reuse_or_write(directory, lambda d, t=target: capture.capture_target(
        d, t.params, t.cfg, splits.evaluation.tokens, splits.evaluation.document_ids, t.cut,
        model_id=t.model_id, corpus=splits.corpus, split_hashes=hashes, training=True,
        batch_size=int(config.capture_batch_size), known_prefix=splits.known_prefix,
        corpus_copy=splits.copy),
        expected=capture_expectation(target, splits))
    out[target.name] = directory
  return out


def capture_expectation(target: Target, splits) -> dict:
  """What a reused capture of `target` must match (lla.capture.store.reuse_or_write)."""
  return {"T.model_id": target.model_id, "T.cut": target.cut,
          "C.split_hashes": {name: p.sha256 for name, p in splits.items()}}


def attack_targets(config, study: pathlib.Path, targets: list[Target], captures: dict,
                   calibration: np.ndarray) -> None:
  jobs = [(t, s) for t in targets for s in config.attack_seeds]
  chunk_budget, where = memory.chunk_budget_bytes(int(config.memory_budget_mb) << 20)
  if targets:
    logging.info("attacks on %s:\n%s", targets[0].name, memory.describe_replay(
        str(captures[targets[0].name]), targets[0].cfg, config.attacks, config.budget.to_dict(),
        chunk_budget, where))
  for target, seed in tqdm(jobs, desc="attacks", unit="replay"):
    primary = target.cut == int(config.primary_cut) and target.knowledge == "public"
    attacks = list(config.attacks if primary else config.secondary_attacks)
    replay.replay(str(study), str(captures[target.name]), target.attacker(calibration), attacks,
                  registry.relevant_budget(config.budget, attacks), int(seed),
                  run_prefix=f"{target.name}/s{seed}/", model_seed=target.model_seed,
                  memory_budget_bytes=chunk_budget)


def published_attacks(config, workdir: pathlib.Path, study: pathlib.Path, targets: list[Target],
                      splits, calibration: np.ndarray) -> None:
  """The published attacks (SipIt, SIP, EIA, BiSR, TAG, LAMP) at the primary setting.

  Their optimisation loops cost 10-100x the beam search per document, so on CPU they run on
  the first `config.published.docs` evaluation documents of the first fine-tuned model at the
  primary setting (a capture of its own, same batch size as the main captures), with the
  budgets of `config.budget` (recorded in each record's E).
  """
  attacks = list(config.published.attacks)
  if not attacks:
    return
  target = next(t for t in targets if t.cut == int(config.primary_cut)
                and t.knowledge == "public")
  docs = int(config.published.docs)
  directory = workdir / CAPTURES / f"published_{target.name}"
  hashes = {name: p.sha256 for name, p in splits.items()}
  store.reuse_or_write(directory, lambda d: capture.capture_target(
      d, target.params, target.cfg, splits.evaluation.tokens[:docs],
      splits.evaluation.document_ids[:docs], target.cut, model_id=target.model_id,
      corpus=splits.corpus, split_hashes=hashes, training=True,
      batch_size=int(config.capture_batch_size), known_prefix=splits.known_prefix,
      corpus_copy=splits.copy),
      expected=capture_expectation(target, splits))
  chunk_budget, _ = memory.chunk_budget_bytes(int(config.memory_budget_mb) << 20)
  for seed in config.attack_seeds:
    replay.replay(str(study), str(directory), target.attacker(calibration), attacks,
                  registry.relevant_budget(config.budget, attacks), int(seed),
                  run_prefix=f"published/{target.name}/s{seed}/", model_seed=target.model_seed,
                  memory_budget_bytes=chunk_budget)


def active_server(config, workdir: pathlib.Path, base_source: dict) -> None:
  """The active-server tier (lla.active) on the base model, in its own scored study."""
  if not config.active.enabled:
    return
  from lla.active import run as active_run  # pylint: disable=g-import-not-at-top
  active = ml_collections.ConfigDict(config.active.to_dict())
  # The base from a checkpoint pre-trained here, a GGUF file or a directory: the tier loads
  # it, and its tokenizer, as this job did (a file's architecture is its own; a checkpoint's
  # is checked against the tier's model config).
  for field in loading.SOURCES:
    active.model[field] = base_source.get(field, "")
  active_run.run(active, str(workdir / ACTIVE))


def flop_frontier(config, workdir: pathlib.Path, targets: list[Target],
                  base_source: dict) -> None:
  """The FLOP-matched frontier (lla.sweep.frontier): `config.frontier.sweep`'s cells on the
  first fine-tuned model at the primary setting, with the base as the trained-knowledge
  attacker, in a sweep study of its own (resumable like the rest). A base that brings its
  own tokenizer (a GGUF file) cuts the cells' documents, as it cut the job's."""
  if not config.frontier.enabled:
    return
  from lla.sweep import driver  # pylint: disable=g-import-not-at-top
  target = next(t for t in targets if t.cut == int(config.primary_cut)
                and t.knowledge == "public")
  sweep = ml_collections.ConfigDict(config.frontier.sweep.to_dict())
  for model, source in ((sweep.cell.target, target.attacker_source),
                        (sweep.cell.pretrained, base_source)):
    for field in ("gguf", "gguf_package", "hf_dir", "checkpoint", "hub"):
      model[field] = source.get(field, "")
  sweep.cell.model_seed = target.model_seed
  driver.run(sweep, str(workdir / FRONTIER))


def corpus_study(config, workdir: pathlib.Path, study: pathlib.Path, base, base_source,
                 tokenizer) -> None:
  """Ridge inversion alone on each corpus (cut by `tokenizer`), k = corpus_study.cut, the
  base model."""
  params, cfg, base_id = base.params, base.cfg, base.model_id
  cut = int(config.corpus_study.cut)
  for corpus in tqdm(config.corpus_study.corpora, desc="corpus study", unit="corpus"):
    splits = data.load_splits(**{**config.data.to_dict(), "corpus": corpus,
                                 "n_eval": int(config.corpus_study.n_eval)},
                              tokenizer=tokenizer)
    directory = workdir / CAPTURES / f"corpus_{corpus}_k{cut}"
    hashes = {n: p.sha256 for n, p in splits.items()}
    store.reuse_or_write(directory, lambda d, s=splits: capture.capture_target(
        d, params, cfg, s.evaluation.tokens, s.evaluation.document_ids, cut,
        model_id=base_id, corpus=s.corpus, split_hashes=hashes,
        training=False, known_prefix=s.known_prefix, corpus_copy=s.copy),
        expected={"T.model_id": base_id, "T.cut": cut,
                  "C.split_hashes": hashes})
    attacker = replay.Attacker(params, cfg, base_id,
                               splits.calibration.tokens, "public", base_source)
    replay.replay(str(study), str(directory), attacker, ["ridge"],
                  registry.relevant_budget(config.budget, ["ridge"]), 0,
                  run_prefix=f"corpus_{corpus}/", memory_budget_bytes=memory.chunk_budget_bytes(
                      int(config.memory_budget_mb) << 20)[0])


def planned_modules(config) -> list[str]:
  """The modules whose records the job's phases write into its study: the attack lists,
  the published attacks, the corpus study's ridge, every defense's fitting attacks and
  baselines (public knowledge, as the sweep attacks them) and the decoy split's modules.
  The frontier and the active tier score studies of their own. A superset of what a run
  measures (a phase with no target runs none), so the checks started from it hold every
  measured module's."""
  from lla.decoy import records as decoy_records  # pylint: disable=g-import-not-at-top
  names = [*config.attacks, *config.secondary_attacks, *config.published.attacks]
  if config.corpus_study.corpora:
    names.append("ridge")
  for configuration in defense_sweep.configurations(config):
    attacks, baselines = defense_sweep.fitting_attacks(
        configuration.defense(), {"activations", "gradients"}, "public",
        tuple(config.defense_skip_attacks))
    names += attacks + baselines
  names += decoy_records.names(config.decoy)
  return sorted(set(names))


def start_checks(config) -> study_qualification.ChecksRun | None:
  """The qualification tests of the modules the job will measure (`planned_modules`; of
  those `qualification.modules` names, where it names some), started in the background
  before the phases (None where the config carries outcomes, runs no tests or plans no
  module with a check); `score` keeps the measured modules'."""
  checks = config.get("qualification")
  if checks is None or checks.outcomes or not checks.run_checks:
    return None
  planned = set(planned_modules(config))
  chosen = [m for m in registry.module_entries() if m["name"] in planned
            and (not checks.modules or m["name"] in checks.modules)]
  if not study_qualification.check_ids(chosen):
    return None
  return study_qualification.start_checks(chosen)


def score(config, study: pathlib.Path,
          started: study_qualification.ChecksRun | None = None) -> dict:
  """The study's scorecard, with every registered module's coverage and qualification.

  The registered modules are recorded first as the study's threat space (the decoy
  driver's records join the study without a replay), and scoring reads them from there.
  Scoring is a pure function of the study's files, so a rerun after an interruption
  rewrites it. started: `start_checks`'s run, whose outcomes of the measured modules'
  checks are recorded (they run now if it lacks any).
  """
  replay.record_threat_space(str(study))
  modules = threat_space.read(str(study)).modules
  checks = config.get("qualification")
  if checks is not None and checks.outcomes:
    study_qualification.carry_outcomes(str(study), checks.outcomes)
  elif checks is not None and checks.run_checks:
    study_qualification.run_and_record(str(study), modules,
                                       timeout_s=60.0 * checks.timeout_minutes,
                                       only=tuple(checks.modules), started=started)
  evidence = study_qualification.evidence(str(study), config.scoring.policy, modules)
  return scorecard.score_run(str(study), config.scoring, qualification_evidence=evidence,
                             overwrite=True)


def _log_invocation(workdir: pathlib.Path, event: str, when: float) -> None:
  """timing.json: when each invocation started and (if it got there) finished, so that a
  killed and resumed run reports its whole elapsed time."""
  path = workdir / TIMING
  invocations = files.read_json(str(path))["invocations"] if path.exists() else []
  if event == "started_unix":
    invocations.append({"started_unix": when, "finished_unix": None})
  else:
    invocations[-1]["finished_unix"] = when
    invocations[-1]["peak_rss_mb"] = _peak_rss_mb()
    invocations[-1]["heap"] = allocator.heap_usage()
    invocations[-1]["jax_arrays"] = runtime.held_arrays()
    invocations[-1]["compile"] = runtime.compile_totals()
  workdir.mkdir(parents=True, exist_ok=True)
  files.atomic_write_json(str(path), {"invocations": invocations}, overwrite=True)


def run(config: ml_collections.ConfigDict, workdir: str) -> pathlib.Path:
  """Runs (or resumes) the whole main job; returns the report's path.

  The study's lock (lla.evidence.rundir.locked) is held from the first check to the last
  write: a second main job or a replay on the same --workdir is refused with one line
  naming this one, before it writes anything.
  """
  check_document_counts(config)
  defense_sweep.configurations(config)  # A bad defense entry costs nothing.
  _check_not_a_run(pathlib.Path(workdir))
  study = pathlib.Path(workdir) / STUDY
  with rundir.locked(str(study), what="experiments.main_table"):
    return _run_locked(config, pathlib.Path(workdir))


def _check_not_a_run(workdir: pathlib.Path) -> None:
  """Refuses a --workdir that is itself a run or a capture (a replay's run directory, a
  sweep's study, a capture): the job would write its study inside it, and that run would
  verify no more."""
  for name, what in ((rundir.LOG, "a run (a replay's or a study's log)"),
                     (manifest.MANIFEST_NAME, "a sealed run or a capture (its manifest)")):
    if (workdir / name).exists():
      raise WorkdirMismatch(f"{workdir}: holds {what}, not a main job's workdir; the job "
                            "writes its study inside its --workdir: use a new --workdir")


def _run_locked(config: ml_collections.ConfigDict, workdir: pathlib.Path) -> pathlib.Path:
  from lla.study import report
  study = workdir / STUDY
  start = time.time()
  config_json = json.loads(config.to_json())
  # Checked before any phase runs, so a wrong --workdir costs nothing and changes nothing.
  if rundir.started(str(study)) and \
      files.read_json(str(study / rundir.PROTOCOL)).get("config") != config_json:
    raise WorkdirMismatch(f"{study}: this workdir's study was started with a different config "
                          "(or by another binary, e.g. a sweep); resume it with the same "
                          "config or use a new --workdir")
  if rundir.started(str(study)) and rundir.log(str(study)).sealed:
    # Finished; a crash between the seal and the manifest left the manifest to write.
    rundir.finalize(str(study))
    problems = rundir.verify(str(study))
    if problems:
      raise WorkdirMismatch(f"{study}: finished study fails verification: " +
                            "; ".join(problems))
    _phase(workdir, "report (study already finished and verified)")
    return report.render(config, workdir)

  registry.load_plugins(config.plugins)
  # A named base (a GGUF file, a directory, a checkpoint) is loaded, with its tokenizer,
  # before anything is written, so that a file lla cannot read, weights nobody named or a
  # model without a tokenizer cost nothing. Its tokenizer cuts the same text into its own
  # passages; None: GPT-2's, which the models pre-trained here use.
  loading.check_weights(config.model)
  loaded = (loading.load_model(config.model, check_architecture=True)
            if loading.source_of(config.model) else None)
  tokenizer = None if loaded is None else loaded.text_tokenizer(
      "token files, which the main job does not take")
  _log_invocation(workdir, "started_unix", start)
  checks = start_checks(config)
  try:
    return _phases(config, config_json, workdir, start, loaded, tokenizer, checks)
  finally:
    if checks is not None:
      checks.cancel()  # (collected at scoring; stopped here if a phase failed)


def _phases(config, config_json: dict, workdir: pathlib.Path, start: float, loaded,
            tokenizer, checks: study_qualification.ChecksRun | None) -> pathlib.Path:
  """Every phase of the job after its inputs were checked (`_run_locked`), from the base
  model to the report."""
  from lla.study import report
  study = workdir / STUDY
  _phase(workdir, "pretrain / base model")
  splits = data.load_splits(**config.data.to_dict(), tokenizer=tokenizer)
  base, base_source = base_model(config, workdir, splits, loaded)
  _phase(workdir, "fine-tune")
  targets = fine_tuned_targets(config, workdir, splits, base, base_source)
  if not rundir.started(str(study)):  # a create interrupted before its log entry: redone
    policy = load_policy(config.scoring.policy)
    rundir.create_study(str(study), {"G": {"policy": policy.policy_id,
                                           "policy_sha256": policy.sha256},
                                     "config": config_json})
    replay.record_threat_space(str(study))
  if tokenizer is not None:
    # Scoring decodes text (ROUGE-L) with it; pinned in the study, a rescore needs nothing
    # else (without one, scoring pins the data directory's GPT-2 tokenizer).
    scorecard.pin_tokenizer(str(study), tokenizer)
  _phase(workdir, "captures")
  captures = capture_targets(config, workdir, targets, splits)
  _phase(workdir, "attacks")
  attack_targets(config, study, targets, captures, splits.calibration.tokens)
  _phase(workdir, "published attacks")
  published_attacks(config, workdir, study, targets, splits, splits.calibration.tokens)
  _phase(workdir, "FLOP-matched frontier")
  flop_frontier(config, workdir, targets, base_source)
  _phase(workdir, "corpus study")
  corpus_study(config, workdir, study, base, base_source, tokenizer)
  _phase(workdir, "defenses")
  defense_sweep.run(config, workdir, workdir / CAPTURES, study, targets, splits, base)
  _phase(workdir, "decoy-row training split")
  # Its attacks' results are records of the study, so that coverage counts them.
  decoy_run.run(config.decoy, str(workdir / DECOY), study=str(study))
  _phase(workdir, "active server")
  active_server(config, workdir, base_source)
  _phase(workdir, "scoring")
  score(config, study, checks)
  rundir.finalize(str(study))
  logging.info("main table finished in %.0f s", time.time() - start)
  _phase(workdir, "report")
  report.render(config, workdir)
  _log_invocation(workdir, "finished_unix", time.time())
  # Rendered again so that the phase table includes the report and the total.
  return report.render(config, workdir)
