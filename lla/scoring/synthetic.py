"""Synthetic captures and run directories with known answers.

Used by the tests and by `validation`: predictions hit exactly a chosen
number of tokens per document, so every count, bound and decision can be
computed by hand. Nothing here is used to score real runs.
"""

import dataclasses
import os
import zlib

import numpy as np

from lla.evidence import files
from lla.evidence import manifest
from lla.evidence import rundir
from lla.evidence.records import AttackRecord

RUN_TIME = "2026-12-01T00:00:00+00:00"


def truth_tokens(docs: int = 64, seq_len: int = 32, vocab: int = 50,
                 seed: int = 0, baseline_token: int = 0,
                 baseline_rate: float = 0.05) -> np.ndarray:
  """[docs, seq_len] int32 tokens; `baseline_token` at ~baseline_rate."""
  rng = np.random.default_rng(seed)
  t = rng.integers(1, vocab, size=(docs, seq_len))
  t[rng.random((docs, seq_len)) < baseline_rate] = baseline_token
  return t.astype(np.int32)


def make_capture(capture_dir: str, tokens: np.ndarray) -> str:
  """Writes truth.safetensors, metadata.json and the manifest; returns its sha."""
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  os.makedirs(capture_dir, exist_ok=True)
  save_file({"tokens": np.asarray(tokens, np.int32)},
            os.path.join(capture_dir, "truth.safetensors"))
  files.atomic_write_json(os.path.join(capture_dir, "metadata.json"),
                          {"synthetic": True, "docs": int(tokens.shape[0])})
  return files.sha256_file(manifest.write_manifest(capture_dir))


def predict(truth: np.ndarray, correct_per_doc: int, seed: int,
            vocab: int = 50, jitter: int = 0) -> np.ndarray:
  """Predictions right on exactly `correct_per_doc` positions of each row.

  With `jitter` > 0 each row's count is moved by a seeded uniform integer in
  [-jitter, jitter] (clipped to [0, T]), so that documents differ.
  Wrong guesses are never the true token; they may equal the baseline token,
  which does not matter because the baseline is computed from the truth.
  """
  rng = np.random.default_rng(seed)
  b, t = truth.shape
  pred = (truth + rng.integers(1, vocab, size=truth.shape)) % vocab
  counts = np.clip(correct_per_doc + rng.integers(-jitter, jitter + 1, b), 0, t)
  for i in range(b):
    keep = rng.permutation(t)[:counts[i]]
    pred[i, keep] = truth[i, keep]
  return pred.astype(np.int32)


@dataclasses.dataclass(frozen=True)
class Spec:
  """One synthetic attack run; `correct_per_doc` sets its token recovery."""
  attack: str
  family: str
  correct_per_doc: int
  model_seed: int = 0
  seed: int = 0
  defense: str = "none"
  status: str = "ok"
  reference: str | None = None
  scored_positions: str = "all"
  cut: int = 6
  knowledge: str = "public"
  corpus: str = "synthetic"
  jitter: int = 0
  attack_revision: int = 1
  attack_code_sha256: str | None = None

  @property
  def run_id(self) -> str:
    return (f"k{self.cut}/{self.knowledge}/{self.defense}/m{self.model_seed}/"
            f"s{self.seed}/{self.attack}"
            + ("" if self.scored_positions == "all" else "_t1"))


def make_run(run_dir: str, capture_dir: str, specs: list[Spec],
             policy_sha256: str | None, time: str = RUN_TIME,
             baseline_token: int = 0, finalize: bool = True) -> list[str]:
  """Writes a complete synthetic run directory; returns the record run_ids."""
  protocol = {"T": "synthetic", "G": {"policy_sha256": policy_sha256}}
  h = rundir.create(run_dir, protocol, time=time)
  truth_path = os.path.join(capture_dir, "truth.safetensors")
  truth = rundir.load_truth(truth_path)
  cap_sha = files.sha256_file(os.path.join(capture_dir,
                                           manifest.MANIFEST_NAME))
  truth_rel = os.path.relpath(truth_path, run_dir)
  for sp in specs:
    name = sp.run_id.replace("/", "__")
    pred_file = pred_sha = error = None
    if sp.status == "ok":
      seed = zlib.crc32(f"{sp.run_id}".encode())
      pred_file, pred_sha = rundir.save_predictions(
          run_dir, name, predict(truth, sp.correct_per_doc, seed, jitter=sp.jitter))
    else:
      error = f"synthetic {sp.status} module"
    rec = AttackRecord(
        run_id=sp.run_id, attack=sp.attack, family=sp.family,
        status=sp.status, error=error, e_hash=h,
        capture_dir=os.path.relpath(capture_dir, run_dir),
        capture_sha256=cap_sha, truth_file=truth_rel,
        prediction_file=pred_file, prediction_sha256=pred_sha,
        scored_positions=sp.scored_positions, baseline_token=baseline_token,
        model_id=f"synthetic-model-{sp.model_seed}",
        model_seed=sp.model_seed, cut=sp.cut, knowledge=sp.knowledge,
        corpus=sp.corpus, defense=sp.defense, defense_params={},
        reference=sp.reference, seed=sp.seed, budget={"C": 32, "W": 2},
        flops=1.0e9, flops_source="analytic", flops_analytic=1.0e9, wall_s=1.5,
        compile_s=0.0, stages={}, details={}, provenance={"lla": "synthetic"},
        attack_revision=sp.attack_revision, attack_code_sha256=sp.attack_code_sha256)
    rundir.save_record(run_dir, name, rec)
  if finalize:
    rundir.finalize(run_dir, time=time)
  return [sp.run_id for sp in specs]
