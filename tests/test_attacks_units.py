"""Attack building blocks against independent computations (PROTOCOL section 4).

Ridge weights against `numpy.linalg.solve` in float64; candidate sets and the gradient
ranking against brute-force numpy sorts on integer-valued embeddings (float32 arithmetic
is then exact, so ties are real ties); the joint and random candidate sets against plain
python; the beam search against exhaustive enumeration and against a python
reimplementation of the pinned algorithm driven by a float64 numpy GPT-2 client.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lla.attacks.seed import beam
from lla.attacks import candidates as cand_lib
from lla.attacks import ridge
from lla.attacks.workspace import iterate_chunks
from lla.model.gpt2 import GPT2Config, init_params


def random_params(cfg: GPT2Config, seed: int, std: float = 0.02, emb_std: float = 0.02) -> dict:
  """Random parameters drawn with numpy into `init_params`'s structure (no Flax init)."""
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    noise = rng.standard_normal(leaf.shape).astype(np.float32)
    name = path[-1].key
    if name == "embedding":
      return jnp.asarray(emb_std * noise)
    return jnp.asarray({"scale": 1 + 0.1 * noise, "bias": 0.1 * noise}.get(name, std * noise))

  shapes = jax.eval_shape(lambda key: init_params(cfg, key), jax.random.key(0))
  return jax.tree_util.tree_map_with_path(draw, shapes)


def np_client(params, cfg: GPT2Config, tokens: np.ndarray, k: int) -> np.ndarray:
  """float64 numpy GPT-2 client (HF semantics): tokens [B, T] -> h [B, T, d]."""
  p = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), params)
  tokens = np.asarray(tokens)
  t = tokens.shape[-1]
  x = p["wte"]["embedding"][tokens] + p["wpe"]["embedding"][:t]

  def ln(y, q):
    mu = y.mean(-1, keepdims=True)
    var = ((y - mu) ** 2).mean(-1, keepdims=True)
    return (y - mu) / np.sqrt(var + cfg.layer_norm_epsilon) * q["scale"] + q["bias"]

  def dense(y, q):
    return y @ q["kernel"] + q["bias"]

  heads, hd = cfg.n_head, cfg.head_dim
  for i in range(k):
    blk = p[f"h_{i}"]
    qkv = dense(ln(x, blk["ln_1"]), blk["attn"]["c_attn"])
    q, kk, v = np.split(qkv, 3, axis=-1)
    sh = lambda a: a.reshape(a.shape[:-1] + (heads, hd))
    q, kk, v = sh(q), sh(kk), sh(v)
    logits = np.einsum("bqhd,bkhd->bhqk", q, kk) / math.sqrt(hd)
    logits = np.where(np.tril(np.ones((t, t), bool)), logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    att = np.einsum("bhqk,bkhd->bqhd", w, v).reshape(x.shape)
    x = x + dense(att, blk["attn"]["c_proj"])
    hid = dense(ln(x, blk["ln_2"]), blk["mlp"]["c_fc"])
    hid = 0.5 * hid * (1 + np.tanh(math.sqrt(2 / math.pi) * (hid + 0.044715 * hid**3)))
    x = x + dense(hid, blk["mlp"]["c_proj"])
  return x


# --- ridge ------------------------------------------------------------------------------


def test_ridge_matches_float64_normal_equations():
  rng = np.random.default_rng(0)
  m, d, d_e = 600, 24, 16
  h = rng.standard_normal((m, d)) * np.r_[np.ones(d - 2), 300.0, 1e3]  # outlier dimensions
  h += 50.0  # a large mean, removed by the centring
  e = h[:, :d_e] @ rng.standard_normal((d_e, d_e)) * 1e-3 + rng.standard_normal((m, d_e)) * 0.01
  alpha = 1e-3
  dec = ridge.fit_ridge(h.astype(np.float32), e.astype(np.float32), alpha)

  h64 = h.astype(np.float32).astype(np.float64)
  e64 = e.astype(np.float32).astype(np.float64)
  hc, ec = h64 - h64.mean(0), e64 - e64.mean(0)
  gram = hc.T @ hc
  lam = alpha * np.trace(gram) / d
  w = np.linalg.solve(gram + lam * np.eye(d), hc.T @ ec)
  np.testing.assert_allclose(dec.lam, lam, rtol=1e-12)
  assert np.max(np.abs(dec.weights - w)) <= 1e-5 * np.max(np.abs(w))
  np.testing.assert_allclose(dec.mu_h, h64.mean(0), rtol=1e-6)
  np.testing.assert_allclose(dec.mu_e, e64.mean(0), rtol=1e-6, atol=1e-9)
  # Decoding: (h - mu_h) W + mu_e.
  probe = h64[:5]
  want = (probe - h64.mean(0)) @ w + e64.mean(0)
  got = np.asarray(dec.decode(jnp.asarray(probe, jnp.float32)))
  assert np.max(np.abs(got - want)) <= 1e-3 * np.max(np.abs(want))
  with pytest.raises(ValueError, match="600 activation rows but 5 target rows"):
    ridge.fit_ridge(h, e[:5], alpha)


# --- candidate sets ---------------------------------------------------------------------


def _integer_wte(rng, vocab: int, d: int) -> np.ndarray:
  """Integer-valued embeddings with exact duplicates (rows 3 = 40, 7 = 8 = 50)."""
  wte = rng.integers(-3, 4, (vocab, d)).astype(np.float32)
  wte[40] = wte[3]
  wte[8] = wte[7]
  wte[50] = wte[7]
  return wte


def _brute_nearest(e_hat, wte, num):
  dist = ((e_hat.astype(np.int64)[..., None, :] - wte.astype(np.int64)) ** 2).sum(-1)
  return np.argsort(dist, axis=-1, kind="stable")[..., :num]  # ties: lower id


def test_nearest_tokens_brute_force_with_exact_ties():
  rng = np.random.default_rng(1)
  vocab, d, num = 64, 6, 20
  wte = _integer_wte(rng, vocab, d)
  e_hat = rng.integers(-3, 4, (3, 5, d)).astype(np.float32)
  e_hat[0, 0] = wte[7]  # distance 0 to tokens 7, 8, 50 exactly
  e_hat[1, 2] = wte[3]  # distance 0 to tokens 3, 40
  got = np.asarray(cand_lib.nearest_tokens(jnp.asarray(wte), jnp.asarray(e_hat), num))
  want = _brute_nearest(e_hat, wte, num)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(got[0, 0, :3], [7, 8, 50])
  np.testing.assert_array_equal(got[1, 2, :2], [3, 40])
  # Ties beyond the constructed ones do occur (integer distances): the test exercises them.
  dist = ((e_hat[..., None, :] - wte) ** 2).sum(-1)
  assert sum(len(np.unique(r[:num])) < num for r in np.sort(dist, -1).reshape(-1, vocab)) >= 10


def test_gradient_ranking_brute_force_with_exact_ties():
  rng = np.random.default_rng(2)
  vocab, d, num = 64, 6, 24
  wte = _integer_wte(rng, vocab, d)
  g = rng.integers(-3, 4, (2, 6, d)).astype(np.float32)
  got = np.asarray(cand_lib.gradient_ranked_tokens(jnp.asarray(wte), jnp.asarray(g), num))
  assert got.shape == (2, 6, num)
  for b in range(2):
    for t in range(1, 6):
      score = -(g[b, t - 1].astype(np.int64) @ wte.astype(np.int64).T)
      want = sorted(range(vocab), key=lambda v: (-score[v], v))[:num]  # higher first, lower id
      np.testing.assert_array_equal(got[b, t], want, err_msg=f"doc {b} position {t}")
  # Duplicated rows are tied everywhere: 7, 8, 50 always appear in id order, adjacent.
  for row in got[:, 1:].reshape(-1, num):
    where = [list(row).index(v) for v in (7, 8, 50) if v in row]
    assert where == sorted(where)


def test_joint_candidates_brute_force():
  rng = np.random.default_rng(3)
  b, t, vocab, c_a, c_g = 3, 7, 40, 5, 4
  act = np.stack([rng.permutation(vocab)[:c_a + c_g] for _ in range(b * t)]).reshape(b, t, -1)
  grad = np.stack([rng.permutation(vocab)[:c_a + c_g] for _ in range(b * t)]).reshape(b, t, -1)
  # Worst case: the first c_a gradient tokens are the activation ones (rankings stay distinct).
  grad[0, 1] = list(act[0, 1, :c_a][::-1]) + [v for v in range(vocab) if v not in act[0, 1, :c_a]][:c_g]
  grad[1, 2] = [grad[1, 2, 0], act[1, 2, 0]] + [v for v in grad[1, 2, 1:] if v != act[1, 2, 0]][:c_a + c_g - 2]
  got = np.asarray(cand_lib.joint_candidates(jnp.asarray(act, jnp.int32),
                                             jnp.asarray(grad, jnp.int32), c_a, c_g))
  assert got.shape == (b, t, c_a + c_g)
  overlaps = 0
  for i in range(b):
    np.testing.assert_array_equal(got[i, 0], act[i, 0, :c_a + c_g])
    for j in range(1, t):
      first = list(act[i, j, :c_a])
      fill = [v for v in grad[i, j] if v not in first][:c_g]
      overlaps += any(v in first for v in grad[i, j][:c_g])
      np.testing.assert_array_equal(got[i, j], first + fill, err_msg=f"doc {i} position {j}")
      assert len(set(got[i, j])) == c_a + c_g
  assert overlaps >= 2


def test_random_candidates_control():
  rng = np.random.default_rng(4)
  b, t, vocab, c_a, c_g = 6, 5, 30, 4, 6
  act = np.stack([rng.permutation(vocab)[:c_a + c_g] for _ in range(b * t)]).reshape(b, t, -1)
  act = jnp.asarray(act, jnp.int32)
  key = jax.random.key(7)
  fn = lambda a, idx: cand_lib.random_fill_candidates(key, a, idx, c_a, c_g, vocab)
  doc_index = np.arange(b, dtype=np.int32)
  full = np.asarray(fn(act, jnp.asarray(doc_index)))
  np.testing.assert_array_equal(full[:, 0], np.asarray(act)[:, 0])
  for i in range(b):
    for j in range(1, t):
      row = full[i, j]
      np.testing.assert_array_equal(row[:c_a], np.asarray(act)[i, j, :c_a])
      assert len(set(row)) == c_a + c_g and row.min() >= 0 and row.max() < vocab
  # Deterministic for a key, different for another, independent of the chunking.
  np.testing.assert_array_equal(full, np.asarray(fn(act, jnp.asarray(doc_index))))
  other = cand_lib.random_fill_candidates(jax.random.key(8), act, jnp.asarray(doc_index), c_a,
                                          c_g, vocab)
  assert np.mean(np.asarray(other)[:, 1:, c_a:] != full[:, 1:, c_a:]) > 0.5
  for chunk in (1, 4):
    pieces = [np.asarray(fn(*piece))[:real]
              for real, piece in iterate_chunks((np.asarray(act), doc_index), chunk, None)]
    np.testing.assert_array_equal(np.concatenate(pieces), full)
  # Uniform over the allowed tokens: draw many rows with the same activation part.
  many = 2000
  same = jnp.broadcast_to(act[:1], (many,) + act.shape[1:])
  draws = np.asarray(fn(same, jnp.arange(many, dtype=jnp.int32)))[:, 1:, c_a:]
  counts = np.stack([np.bincount(draws[:, j].reshape(-1), minlength=vocab)
                     for j in range(t - 1)])
  allowed = np.ones((t - 1, vocab), bool)
  for j in range(t - 1):
    allowed[j, np.asarray(act)[0, j + 1, :c_a]] = False
  assert counts[~allowed].sum() == 0
  expected = many * c_g / (vocab - c_a)
  assert np.max(np.abs(counts[allowed] - expected)) < 5 * math.sqrt(expected)


def test_derangement():
  for num in (2, 3, 17, 256):
    perm = cand_lib.derangement(num, seed=17)
    np.testing.assert_array_equal(np.sort(perm), np.arange(num))
    assert not np.any(perm == np.arange(num))
    np.testing.assert_array_equal(perm, cand_lib.derangement(num, seed=17))
  assert not np.array_equal(cand_lib.derangement(256, 1), cand_lib.derangement(256, 2))
  with pytest.raises(ValueError, match="at least 2"):
    cand_lib.derangement(1, 0)


# --- beam search ------------------------------------------------------------------------

BEAM_CFG = GPT2Config(vocab_size=64, n_positions=8, n_embd=32, n_head=4, n_layer=3)
BEAM_K = 2


@pytest.fixture(scope="module")
def beam_model():
  params = random_params(BEAM_CFG, seed=5, std=0.1, emb_std=0.3)
  wte = np.array(params["wte"]["embedding"])
  wte[41] = wte[9]   # exact duplicate embeddings: tied costs
  wte[60] = wte[12]
  params["wte"]["embedding"] = jnp.asarray(wte)
  return params


def test_beam_search_equals_exhaustive_enumeration(beam_model):
  rng = np.random.default_rng(6)
  b, t, c, w = 3, 3, 4, 16
  cands = np.stack([rng.permutation(BEAM_CFG.vocab_size)[:c] for _ in range(b * t)])
  cands = cands.reshape(b, t, c).astype(np.int32)
  # Targets: the client on random tokens (often outside the candidates) plus noise.
  other = rng.integers(0, BEAM_CFG.vocab_size, (b, t))
  target = np_client(beam_model, BEAM_CFG, other, BEAM_K)
  target += 0.05 * rng.standard_normal(target.shape)
  tokens, score = beam.search(beam_model, BEAM_CFG, BEAM_K, jnp.asarray(target, jnp.float32),
                                   jnp.asarray(cands), w)
  tokens, score = np.asarray(tokens), np.asarray(score)
  grid = np.stack(np.meshgrid(*[np.arange(c)] * t, indexing="ij"), -1).reshape(-1, t)  # [C^T, T]
  for i in range(b):
    seqs = cands[i][np.arange(t), grid]                                  # [64, T]
    h = np_client(beam_model, BEAM_CFG, seqs, BEAM_K)
    total = ((h - target[i]) ** 2).sum((-1, -2))
    order = np.argsort(total)
    assert total[order[1]] - total[order[0]] > 1e-4 * total[order[0]]  # unambiguous optimum
    np.testing.assert_array_equal(tokens[i], seqs[order[0]], err_msg=f"document {i}")
    np.testing.assert_allclose(score[i], total[order[0]], rtol=1e-4)


def python_beam_search(params, cfg, k, target, cands, width):
  """The pinned algorithm, plainly: full recomputation in float64, stable sorts."""
  beams = [(0.0, [])]
  for t in range(target.shape[0]):
    pairs = []
    for score, prefix in beams:               # beams sorted best first: beam-major order
      seqs = np.array([prefix + [int(c)] for c in cands[t]])
      h = np.stack([np_client(params, cfg, s[None], k)[0, t] for s in seqs])  # one at a time
      cost = ((h - target[t]) ** 2).sum(-1)
      pairs += [(score + cost[r], prefix + [int(cands[t][r])]) for r in range(len(cands[t]))]
    beams = sorted(pairs, key=lambda p: p[0])[:width]  # stable: lower beam, then lower rank
  return beams[0][1], beams[0][0], beams


def test_beam_search_width2_matches_python_with_ties(beam_model):
  rng = np.random.default_rng(7)
  b, t, c, w = 3, 5, 4, 2
  truth = rng.integers(0, BEAM_CFG.vocab_size, (b, t))
  truth[0, :3] = [9, 12, 5]
  target = np_client(beam_model, BEAM_CFG, truth, BEAM_K)
  cands = np.empty((b, t, c), np.int32)
  for i in range(b):
    for j in range(t):
      rest = [v for v in rng.permutation(BEAM_CFG.vocab_size) if v not in (truth[i, j], 9, 41, 12, 60)]
      row = [truth[i, j]] + rest[:c - 1]
      cands[i, j] = rng.permutation(row)
  # Document 0: position 0 offers 41 (rank 0) and its twin 9 (rank 2): the tie goes to rank 0;
  # position 1 offers 12 (rank 1) and 60 (rank 3): the twins' beams tie, then the ranks do.
  cands[0, 0] = [41, 1, 9, 2]
  cands[0, 1] = [3, 12, 4, 60]
  # Document 1: the twins at position 2, 60 first.
  truth[1, 2] = 12
  target[1] = np_client(beam_model, BEAM_CFG, truth[1:2], BEAM_K)[0]
  cands[1, 2] = [60, 12, 6, 7]
  tokens, score = beam.search(beam_model, BEAM_CFG, BEAM_K, jnp.asarray(target, jnp.float32),
                                   jnp.asarray(cands), w)
  tokens, score = np.asarray(tokens), np.asarray(score)
  for i in range(b):
    want, want_score, beams = python_beam_search(beam_model, BEAM_CFG, BEAM_K, target[i],
                                                 cands[i], w)
    np.testing.assert_array_equal(tokens[i], want, err_msg=f"document {i}")
    np.testing.assert_allclose(score[i], want_score, atol=1e-5)
  assert list(tokens[0, :2]) == [41, 12]   # ties went to the lower candidate rank
  assert tokens[1, 2] == 60
  # The two final beams of document 0 are exactly tied in float64 (twins at position 1).
  _, _, beams0 = python_beam_search(beam_model, BEAM_CFG, BEAM_K, target[0], cands[0], w)
  assert beams0[0][0] == beams0[1][0] and beams0[1][1][:2] == [41, 60]


def test_beam_search_width_above_candidates_and_validation(beam_model):
  rng = np.random.default_rng(8)
  truth = rng.integers(0, BEAM_CFG.vocab_size, (2, 4))
  target = np_client(beam_model, BEAM_CFG, truth, BEAM_K)
  cands = np.stack([(truth + 1) % 64, truth], -1).astype(np.int32)
  tokens, score = beam.search(beam_model, BEAM_CFG, BEAM_K, jnp.asarray(target, jnp.float32),
                                   jnp.asarray(cands), 5)  # W > C
  np.testing.assert_array_equal(np.asarray(tokens), truth)
  assert np.all(np.asarray(score) < 1e-6)
  with pytest.raises(ValueError, match="beam width"):
    beam.search(beam_model, BEAM_CFG, BEAM_K, jnp.asarray(target, jnp.float32),
                     jnp.asarray(cands), 0)
  with pytest.raises(ValueError, match="cut k=3"):
    beam.search(beam_model, BEAM_CFG, 3, jnp.asarray(target, jnp.float32),
                     jnp.asarray(cands), 2)
  with pytest.raises(ValueError, match="do not match"):
    beam.search(beam_model, BEAM_CFG, BEAM_K, jnp.asarray(target, jnp.float32),
                     jnp.asarray(cands[:, :3]), 2)
