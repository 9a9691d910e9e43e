"""Mixed rows scored per document (lla.scoring.per_document), against hand computations.

A synthetic mixup batch (m = 2, each row its own document plus a partner, the partner map
a cycle as lla.defenses.SecretMixup makes it) whose attacker unmixed every document
exactly: per row it can credit only the rows whose heaviest partner is their own (counted
here by hand), per document every document. The pairing is checked against brute force
over every one-to-one map on small random cases, and a study's scorecard carries both
figures and the verdicts under each.
"""

import itertools
import os

import numpy as np
import pytest

from lla.evidence import files, manifest, rundir
from lla.evidence.records import AttackRecord
from lla.scoring import metrics
from lla.scoring import per_document
from lla.scoring import policy as policy_lib
from lla.scoring import scorecard
from lla.scoring import synthetic as syn

POL = policy_lib.load_policy()
B, T, VOCAB = 16, 12, 50


def mixup_batch(seed: int):
  """truth [B, T] (no two documents share a token at any position, so a document's text
  scores nothing on another's), partner [B] (row b mixes b and partner[b]), heaviest [B]
  (the document with the larger coefficient in row b)."""
  rng = np.random.default_rng(seed)
  truth = np.stack([rng.permutation(VOCAB)[:B] for _ in range(T)], 1)
  sigma = rng.permutation(B)
  partner = sigma[(np.argsort(sigma) + 1 + rng.integers(0, B - 1)) % B]
  lam = rng.dirichlet([1.0, 1.0], B)
  heaviest = np.where(lam[:, 0] >= lam[:, 1], np.arange(B), partner)
  return truth, partner, heaviest


def exact_claims(truth, partner, seed: int):
  """Every document's text, in a shuffled order, with the rows whose mixture holds it:
  its own row and the row that takes it as partner."""
  order = np.random.default_rng(seed).permutation(B)
  holder = np.argsort(partner)  # holder[i]: the row whose partner is document i
  rows = [[int(i), int(holder[i])] for i in order]
  return truth[order], rows


def test_exact_unmixing_scores_every_document_and_half_the_rows():
  truth, partner, heaviest = mixup_batch(0)
  assert (partner != np.arange(B)).all() and sorted(partner) == list(range(B))
  texts, rows = exact_claims(truth, partner, 1)
  per_row = metrics.count(truth[heaviest], truth, 0, "all")
  # By hand: a row is right where its heaviest partner is its own document.
  own = int((heaviest == np.arange(B)).sum())
  assert 0 < own < B
  assert (per_row.hits, per_row.docs_exact) == (own * T, own)
  counts = per_document.count({"documents": {"texts": texts.tolist(), "rows": rows}},
                              truth, 0, "all", "test")
  assert (counts.hits, counts.n, counts.docs_exact, counts.docs) == (B * T, B * T, B, B)
  assert counts.baseline_hits == int((truth == 0).sum())
  # Over many draws the per-row figure is about half.
  shares = []
  for seed in range(200):
    _, _, heavy = mixup_batch(seed)
    shares.append(np.mean(heavy == np.arange(B)))
  assert abs(np.mean(shares) - 0.5) < 0.03


def test_one_claim_per_row_scores_as_the_rows_do():
  truth, _, heaviest = mixup_batch(3)
  rows = [[b] for b in range(B)]
  details = {"documents": {"texts": truth[heaviest].tolist(), "rows": rows}}
  assert per_document.count(details, truth, 0, "t>=1", "test") == metrics.count(
      truth[heaviest], truth, 0, "t>=1")


def test_a_claim_credits_only_documents_of_the_rows_it_names():
  truth, partner, _ = mixup_batch(4)
  texts, rows = exact_claims(truth, partner, 5)
  # The right texts, each tied to rows that do not hold it.
  wrong = [[next(r for r in range(B) if r not in named)] for named in rows]
  counts = per_document.count({"documents": {"texts": texts.tolist(), "rows": wrong}},
                              truth, 0, "all", "test")
  # No text matches another document anywhere (mixup_batch), so nothing is credited.
  assert (counts.hits, counts.docs_exact) == (0, 0)


@pytest.mark.parametrize("seed", range(6))
def test_the_pairing_is_the_best_one_to_one_map(seed):
  rng = np.random.default_rng(seed)
  docs, claims_n, t = 5, int(rng.integers(1, 6)), 4
  truth = rng.integers(0, 3, (docs, t))
  texts = rng.integers(0, 3, (claims_n, t))
  rows = [sorted(rng.choice(docs, int(rng.integers(1, 3)), replace=False).tolist())
          for _ in range(claims_n)]
  paired = per_document.pairing(texts, rows, truth, "all")
  got = sum(int((texts[c] == truth[i]).sum()) for i, c in enumerate(paired) if c >= 0)
  assert len({c for c in paired if c >= 0}) == sum(paired >= 0)  # one document per claim
  assert all(i in rows[c] for i, c in enumerate(paired) if c >= 0)
  best = 0  # brute force: every injective map of claims to documents or to nothing
  for target in itertools.product([None, *range(docs)], repeat=claims_n):
    used = [d for d in target if d is not None]
    if len(used) != len(set(used)):
      continue
    best = max(best, sum(int((texts[c] == truth[d]).sum()) for c, d in enumerate(target)
                         if d is not None and d in rows[c]))
  assert got == best


def test_malformed_claims_are_refused_in_one_line():
  truth = np.zeros((3, 4), np.int64)
  for entry, match in [({"texts": [[0] * 4] * 4, "rows": [[0]] * 4}, "1 to 3 texts"),
                       ({"texts": [[0] * 5], "rows": [[0]]}, "of 4 tokens"),
                       ({"texts": [[0] * 4], "rows": [[3]]}, r"rows in \[0, 3\)"),
                       ({"texts": [[0] * 4], "rows": [[]]}, r"rows in \[0, 3\)")]:
    with pytest.raises(ValueError, match=match):
      per_document.claims({"documents": entry}, truth.shape, "record 'x'")
  assert per_document.claims({}, truth.shape, "record 'x'") is None


def _study(root, truth, records):
  """A run of records (spec kwargs, predictions, details), like lla.scoring.synthetic's."""
  cap, run = str(root / "cap"), str(root / "run")
  syn.make_capture(cap, truth)
  h = rundir.create(run, {"T": "synthetic", "G": {"policy_sha256": POL.sha256}})
  for spec, predictions, details in records:
    name = spec.run_id.replace("/", "__")
    pred_file, pred_sha = rundir.save_predictions(run, name, predictions.astype(np.int32))
    rundir.save_record(run, name, AttackRecord(
        run_id=spec.run_id, attack=spec.attack, family=spec.family, status="ok", error=None,
        e_hash=h, capture_dir=os.path.relpath(cap, run),
        capture_sha256=files.sha256_file(os.path.join(cap, manifest.MANIFEST_NAME)),
        truth_file=os.path.relpath(os.path.join(cap, "truth.safetensors"), run),
        prediction_file=pred_file, prediction_sha256=pred_sha, scored_positions="all",
        baseline_token=0, model_id=f"m{spec.model_seed}", model_seed=spec.model_seed,
        cut=6, knowledge="public", corpus="synthetic", defense=spec.defense,
        defense_params={}, reference=None, seed=0, budget={}, flops=1.0, flops_source="analytic",
        flops_analytic=1.0, wall_s=1.0, compile_s=0.0, stages={}, details=details,
        provenance={}, attack_revision=1, attack_code_sha256=None))
  rundir.finalize(run)
  return run


def test_the_scorecard_reports_both_figures_and_the_verdicts_under_each(tmp_path):
  truth, partner, heaviest = mixup_batch(7)
  texts, rows = exact_claims(truth, partner, 8)
  details = {"documents": {"texts": texts.tolist(), "rows": rows}}
  records = []
  for m in range(3):
    records += [(syn.Spec("activation", "beam_inversion", 0, m), truth, {}),
                (syn.Spec("mixup_adaptive", "beam_inversion", 0, m, defense="mixup"),
                 truth[heaviest], details)]
  run = _study(tmp_path, truth, records)
  card = scorecard.build(run, POL, modules=None, contrasts=False)
  section = card["per_document"]
  assert sorted(section["rows"]) == [f"k6/public/mixup/m{m}/s0/mixup_adaptive"
                                     for m in range(3)]
  p0 = float((truth == 0).mean())
  for run_id, m in section["rows"].items():
    assert (m["token_recovery"], m["exact_doc_recovery"]) == (1.0, 1.0)
    row = next(r for r in card["rows"] if r["run_id"] == run_id)["metrics"]
    assert row["token_recovery"] == np.mean(heaviest == np.arange(B))
  (gate,), (per_row_gate,) = section["gates"], card["gates"]
  # U(1, n) = 1 (Wilson), so the per-document envelope is 100 (1 - p0).
  assert gate["envelope"]["argmax"] == "mixup_adaptive"
  assert gate["envelope"]["envelope_pp"] == pytest.approx(100 * (1 - p0))
  assert per_row_gate["envelope"]["envelope_pp"] < gate["envelope"]["envelope_pp"]
  text = scorecard.markdown(card)
  assert "## Mixed rows scored per document" in text
  assert f"**{per_row_gate['decision']}** | {per_row_gate['envelope']['envelope_pp']:+.3f}" in text
  # A study without claims has no such section, as before.
  plain = _study(tmp_path / "plain", truth, [(spec, pred, {}) for spec, pred, _ in records])
  assert "per_document" not in scorecard.build(plain, POL, modules=None, contrasts=False)
