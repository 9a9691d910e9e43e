"""The split's incremental and reduced-precision paths against the full-sequence client.

`client` itself is checked against transformers in test_model_parity; here the KV-cached
`client_step` (the beam search's workhorse), its vmapped forms, the bf16 switch and the
cut validation are checked against it.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lla.model import gpt2, split
from lla.model.gpt2 import GPT2Config, init_params

CFG = GPT2Config(vocab_size=83, n_positions=20, n_embd=48, n_head=4, n_layer=4)
K = 3
B, T = 3, 12


def assert_close(actual, reference, rtol, what=""):
  """max |actual - reference| <= rtol * max |reference|."""
  actual, reference = np.asarray(actual, np.float64), np.asarray(reference, np.float64)
  assert actual.shape == reference.shape, (what, actual.shape, reference.shape)
  err, scale = np.max(np.abs(actual - reference)), np.max(np.abs(reference))
  assert err <= rtol * scale, f"{what}: max error {err:.3g} > {rtol:g} * {scale:.3g}"


def random_params(cfg: GPT2Config, seed: int) -> dict:
  """Random parameters with every LayerNorm and bias away from Flax's (1, 0) and 0.

  Drawn with numpy into `init_params`'s structure (eval_shape, no compile): eager Flax
  init costs seconds even for a tiny model.
  """
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    noise = rng.standard_normal(leaf.shape).astype(np.float32)
    name = path[-1].key
    return jnp.asarray({"scale": 1 + 0.1 * noise, "bias": 0.1 * noise}.get(name, 0.02 * noise))

  shapes = jax.eval_shape(lambda key: init_params(cfg, key), jax.random.key(0))
  return jax.tree_util.tree_map_with_path(draw, shapes)


@pytest.fixture(scope="module", params=["named", "stacked"])
def params(request):
  """Either form: the HF-named tree (blocks unrolled) or its computation form (scanned)."""
  named = random_params(CFG, seed=0)
  return named if request.param == "named" else split.computation_form(named, CFG)


@pytest.fixture(scope="module")
def tokens():
  return jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (B, T)), jnp.int32)


step = jax.jit(split.client_step, static_argnums=1)


def prefix_cache(params, tokens_1d, t):
  """The cache of one sequence after positions 0..t-1."""
  cache = split.init_cache(CFG, K, T)
  for i in range(t):
    _, cache = step(params, CFG, cache, tokens_1d[i], i)
  return cache


def test_client_step_every_position(params, tokens):
  want = split.client(params, CFG, tokens, K)
  cache = split.init_cache(CFG, K, T)
  for t in range(T):
    h_t, cache = step(params, CFG, cache, tokens[0, t], t)
    assert_close(h_t, want[0, t], 1e-5, f"position {t}")


def test_client_step_vmapped_over_documents(params, tokens):
  want = split.client(params, CFG, tokens, K)
  batched = jax.jit(jax.vmap(split.client_step, in_axes=(None, None, 0, 0, None)),
                    static_argnums=1)
  cache = jnp.stack([split.init_cache(CFG, K, T)] * B)
  for t in range(T):
    h_t, cache = batched(params, CFG, cache, tokens[:, t], t)
    assert_close(h_t, want[:, t], 1e-5, f"position {t}")


def test_client_step_vmapped_over_candidates(params, tokens):
  """One shared prefix cache, many candidate tokens at position t (the beam search step)."""
  t, candidates = 5, jnp.arange(0, CFG.vocab_size, 7)
  cache = prefix_cache(params, tokens[0], t)
  sequences = jnp.concatenate(
      [jnp.broadcast_to(tokens[0, :t], (len(candidates), t)), candidates[:, None]], axis=1)
  want = split.client(params, CFG, sequences, K)[:, t]

  over_candidates = functools.partial(jax.vmap, in_axes=(None, None, None, 0, None))
  h_kv, kv = jax.jit(over_candidates(split.client_step_kv), static_argnums=1)(
      params, CFG, cache, candidates, t)
  assert_close(h_kv, want, 1e-5, "client_step_kv")
  h, caches = jax.jit(over_candidates(split.client_step), static_argnums=1)(
      params, CFG, cache, candidates, t)
  assert_close(h, want, 1e-5, "client_step")
  # Committing a survivor's row must give the cache that stepping it in directly gives (whose
  # use at later positions test_client_step_vmapped_over_documents checks).
  committed = jax.vmap(split.write_cache, in_axes=(None, 0, None))(cache, kv, t)
  np.testing.assert_array_equal(committed, caches)


def test_client_step_beams_times_candidates(params, tokens):
  """Nested vmap: documents' caches (axis 0) x candidate tokens, as in batched beam search."""
  t, candidates = 4, jnp.array([1, 10, 40, 82])
  caches = jnp.stack([prefix_cache(params, tokens[b], t) for b in range(B)])
  fn = jax.vmap(jax.vmap(split.client_step_kv, in_axes=(None, None, None, 0, None)),
                in_axes=(None, None, 0, None, None))
  h, _ = jax.jit(fn, static_argnums=1)(params, CFG, caches, candidates, t)
  assert h.shape == (B, len(candidates), CFG.n_embd)
  for b in range(B):
    sequences = jnp.concatenate(
        [jnp.broadcast_to(tokens[b, :t], (len(candidates), t)), candidates[:, None]], axis=1)
    assert_close(h[b], split.client(params, CFG, sequences, K)[:, t], 1e-5, f"document {b}")


def test_bfloat16_is_close_to_float32(params, tokens):
  # bf16 keeps 8 bits of mantissa: a few parts in 1e3 per matmul, compounded over layers.
  h16, g16 = split.boundary_messages(params, CFG.replace(dtype="bfloat16"), tokens, K)
  h32, g32 = split.boundary_messages(params, CFG, tokens, K)
  assert h16.dtype == g16.dtype == jnp.float32
  assert_close(h16, h32, 5e-2, "bf16 h")
  assert_close(g16, g32, 5e-2, "bf16 g")
  assert not np.allclose(h16, h32, rtol=0, atol=1e-7), "dtype switch had no effect"


@pytest.mark.parametrize("k", [0, CFG.n_layer])
def test_invalid_cut_raises(params, tokens, k):
  with pytest.raises(ValueError, match=f"cut k={k}"):
    split.client(params, CFG, tokens, k)
  with pytest.raises(ValueError, match=f"cut k={k}"):
    split.boundary_messages(params, CFG, tokens, k)
  with pytest.raises(ValueError, match=f"cut k={k}"):
    split.server_loss(params, CFG, jnp.zeros((B, T, CFG.n_embd)), tokens, k)


def test_random_params_draws_init_params_tree_and_scales():
  """The numpy draw the benchmarks use: init_params' tree, shapes and dtypes; LayerNorm
  1/0; per-tensor standard deviations at GPT-2's 0.02 (0.01 for wpe); seeded."""
  cfg = GPT2Config(vocab_size=500, n_positions=64, n_embd=64, n_head=4, n_layer=2)
  drawn = gpt2.random_params(cfg, seed=4)
  flax_init = init_params(cfg, jax.random.key(0))
  assert jax.tree_util.tree_structure(drawn) == jax.tree_util.tree_structure(flax_init)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(drawn),
                          jax.tree_util.tree_leaves(flax_init)):
    assert (a.shape, a.dtype) == (b.shape, b.dtype), path
    name, a = path[-1].key, np.asarray(a)
    if name in ("scale", "bias"):
      np.testing.assert_array_equal(a, 1.0 if name == "scale" else 0.0, err_msg=str(path))
    elif a.size >= 4096:
      want = 0.01 if path[0].key == "wpe" else 0.02
      assert abs(a.std() / want - 1) < 0.05 and abs(a.mean()) < 0.1 * want, (path, a.std())
  again = gpt2.random_params(cfg, seed=4)
  other = gpt2.random_params(cfg, seed=5)
  np.testing.assert_array_equal(drawn["wte"]["embedding"], again["wte"]["embedding"])
  assert not np.array_equal(drawn["wte"]["embedding"], other["wte"]["embedding"])


def test_computation_form_equals_named_tree(tokens):
  """The scanned blocks (computation form) against the unrolled ones (HF-named tree), a
  second implementation of the same layers: h, g, logits and the one-token step within
  1e-6 relative."""
  named = random_params(CFG, seed=1)
  form = split.computation_form(named, CFG)
  assert "layer_stack" in form and not any(key.startswith("h_") for key in form)
  for k in (1, K):
    for a, b, what in zip(split.boundary_messages(form, CFG, tokens, k),
                          split.boundary_messages(named, CFG, tokens, k), "hg"):
      assert_close(a, b, 1e-6, f"{what} at k={k}")
  assert_close(split.logits(form, CFG, tokens), split.logits(named, CFG, tokens), 1e-6, "logits")
  cache = split.init_cache(CFG, K, T)
  for a, b in zip(step(form, CFG, cache, tokens[0, 0], 0), step(named, CFG, cache, tokens[0, 0], 0)):
    assert_close(a, b, 1e-6, "step")


def test_scanned_program_does_not_grow_with_depth():
  """The compiled client of the computation form has as many matmuls at 2 blocks as at 6
  (one scanned block body); unrolled, 3x as many."""
  dots = {}
  for n_layer in (3, 7):
    cfg = CFG.replace(n_layer=n_layer)
    named = gpt2.random_params(cfg, 0)
    for form, p in (("named", named), ("stacked", split.computation_form(named, cfg))):
      text = split.client.lower(p, cfg, jnp.zeros((1, 4), jnp.int32), n_layer - 1).as_text()
      dots[form, n_layer] = text.count("dot_general")
  assert dots["stacked", 3] == dots["stacked", 7]
  assert dots["named", 7] == 3 * dots["named", 3]


def test_captures_run_the_stacked_layers(tokens, monkeypatch):
  """A capture computes its messages with the computation form (one scanned layer body per
  cut), equal to the named tree's per training batch within 1e-6 relative."""
  from lla.capture import capture
  named = random_params(CFG, seed=2)
  seen, original = [], split.boundary_messages
  monkeypatch.setattr(split, "boundary_messages",
                      lambda p, *args: seen.append(set(p)) or original(p, *args))
  h, g = capture.boundary_messages_batched(named, CFG, np.asarray(tokens), K, 2, True)
  assert len(seen) == 2 and all("layer_stack" in keys and "h_0" not in keys for keys in seen)
  for start in (0, 2):  # the loss, hence g, is the mean over each training batch
    ref_h, ref_g = original(named, CFG, tokens[start:start + 2], K)
    assert_close(h[start:start + 2], ref_h, 1e-6, "h")
    assert_close(g[start:start + 2], ref_g, 1e-6, "g")
