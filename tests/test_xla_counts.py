"""lla.attacks.xla_counts (experiments/flops_probe.py) on CPU: XLA's counts against counts
by hand."""

import pytest

from lla.attacks import xla_counts


def test_cpu_counts_match_the_hand_counts():
  n, trips, n_embd, cut, docs, seq_len = 64, 4, 64, 1, 2, 8
  pieces = xla_counts.probe(n, trips, n_embd, cut, docs, seq_len)
  assert pieces["matmul"]["by_hand"] == 2 * 64**3
  assert pieces["scan"]["by_hand"] == 2 * 64**3 * 4
  for way in ("lowered", "compiled"):  # on CPU the two agree
    assert pieces["matmul"][way] == pytest.approx(2 * n**3), way
    # The loop's body once (matmul, tanh, add: n^2 each beyond the product), times trips.
    assert pieces["scan"][way] == pytest.approx(trips * (2 * n**3 + 2 * n**2), rel=0.01), way
    # The client: the blocks' matmuls by hand; XLA adds the norms, softmax and GELU.
    assert 1.0 <= pieces["client"][f"{way}_ratio"] <= 1.1, way
