"""`mixup_adaptive`'s per-document claims on a mixup-defended tiny model, scored per document.

The mixed capture of tests/test_attacks_adaptive.py (m = 2, the mechanism's own partners):
the attack unmixes every row, so it claims every document once, each with the rows whose
mixtures hold it (read off the secret partners here by hand); scored per document
(lla.scoring.per_document) it recovers about as much as undefended, while per row, against
each row's own document, it is credited only where the heaviest partner is the own one.
"""

import jax
import numpy as np

from lla.attacks import registry
from lla.scoring import metrics
from lla.scoring import per_document
from test_attacks_adaptive import B, budget, case, mixed_capture, undefended, workspace  # pylint: disable=unused-import


def test_mixup_adaptive_claims_each_document_with_its_rows(case, undefended):
  _, _, truth, _ = case
  mixed, lam, partners = mixed_capture(case, 2)
  ws = workspace(case, mixed, {"name": "mixup", "params": {"m": 2, "alpha": 1.0}})
  result, _ = registry.execute("mixup_adaptive", ws, budget(), jax.random.key(0))
  assert result.details["rows_unmixed"] == B
  claims = result.details["documents"]
  # By hand: document i is held by the rows b with i among partners[b].
  holders = sorted(tuple(int(b) for b in range(B) if i in partners[b]) for i in range(B))
  assert sorted(map(tuple, claims["rows"])) == holders
  texts = np.asarray(claims["texts"])
  assert texts.shape == truth.shape
  by_document = per_document.count(result.details, truth, 0, "all", "mixup_adaptive")
  per_row = metrics.count(result.predictions, truth, 0, "all")
  own_heaviest = partners[np.arange(B), lam.argmax(1)] == np.arange(B)
  assert 0 < own_heaviest.sum() < B  # so per row it cannot credit every row
  assert by_document.hits / by_document.n >= 0.9 * undefended
  assert by_document.hits > per_row.hits
  # Per row only the rows whose heaviest partner is their own can be right.
  assert per_row.hits <= int(own_heaviest.sum()) * truth.shape[1]
