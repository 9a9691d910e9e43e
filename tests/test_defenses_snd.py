"""Split-and-Denoise (`snd`): the server's view is dx_privacy's, off is undefended bit for
bit, and the client's denoiser lowers the error of what comes back."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lla import defenses as D
from lla.defenses import dx_privacy, snd, training, utility
from lla.model import split
from lla.model.gpt2 import GPT2Config

from test_attacks_units import random_params

CFG = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=3, n_head=2)
K = 1
SECRET = D.Secret.explicit(20250602)


@pytest.fixture(scope="module")
def model():
  params = random_params(CFG, seed=0, std=0.2, emb_std=0.5)
  tokens = np.random.default_rng(1).integers(0, CFG.vocab_size, (96, 8)).astype(np.int32)
  return params, tokens


def test_off_is_the_undefended_forward_bit_for_bit(model):
  params, tokens = model
  off = D.make("snd", epsilon=None, clip_norm=1.0)
  assert off.off and off.strength == 0
  batch = jnp.asarray(tokens[:6])
  np.testing.assert_array_equal(
      np.asarray(training.defended_client(params, CFG, batch, K, off, None)),
      np.asarray(split.client(params, CFG, batch, K)))
  np.testing.assert_array_equal(
      np.asarray(snd.document_cross_entropy(params, CFG, batch, K, off, None, None)),
      np.asarray(utility.document_cross_entropy(params, CFG, batch, K, None, None)))


def test_the_server_sees_dx_privacy_noise_on_clipped_rows(model):
  params, tokens = model
  table, batch = split.input_table(params), jnp.asarray(tokens[:4])
  keys = SECRET.keys("snd", 3)
  # Without clipping: dx_privacy's mechanism exactly, given the same keys.
  np.testing.assert_array_equal(
      np.asarray(D.make("snd", epsilon=5.0).noisy_inputs(table, batch, keys)),
      np.asarray(D.make("dx_privacy", epsilon=5.0).noisy_inputs(table, batch, keys)))
  # With clipping: rows scaled to norm <= C in numpy, then the same draw.
  rows = np.asarray(table, np.float64)[np.asarray(batch)]
  norms = np.linalg.norm(rows, axis=-1, keepdims=True)
  assert (norms > 1.5).any() and (norms < 1.5).any()
  clipped = rows * np.minimum(1.0, 1.5 / norms)
  z = np.asarray(dx_privacy.dx_noise(keys.step, rows.shape, 5.0), np.float64)
  defense = D.make("snd", epsilon=5.0, clip_norm=1.5)
  np.testing.assert_allclose(np.asarray(defense.noisy_inputs(table, batch, keys)), clipped + z,
                             rtol=1e-5, atol=1e-6)
  # h is the client's blocks on them, and `apply` leaves h to the hook.
  h = training.defended_client(params, CFG, batch, K, defense, keys)
  np.testing.assert_allclose(
      np.asarray(h), np.asarray(split.client_from_embeddings(params, CFG, clipped + z, K)),
      rtol=1e-4, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(D.apply(defense, h, keys)), np.asarray(h))
  assert defense.to_record(SECRET)["params"] == {
      "clip_norm": 1.5, "epsilon": 5.0, "denoiser_width": 64, "denoiser_steps": 150,
      "denoiser_lr": 3e-3, "denoiser_seed": 0}
  with pytest.raises(D.DefenseError, match="clip_norm"):
    D.make("snd", epsilon=1.0, clip_norm=0.0)


def test_the_denoiser_starts_as_the_identity_and_learns(model):
  params, tokens = model
  o = jnp.asarray(np.random.default_rng(2).normal(size=(2, 5, 16)), jnp.float32)
  start = snd.init_denoiser(jax.random.key(0), 16, 32)
  np.testing.assert_array_equal(np.asarray(snd.denoise(start, o, o)), np.asarray(o))
  # E||z|| = d / epsilon = 0.8 against rows of norm ~2: noisy but not destroyed.
  defense = D.make("snd", epsilon=20.0)
  train, heldout = tokens[:64], jnp.asarray(tokens[64:])
  denoiser, losses = snd.train_denoiser(params, CFG, train, K, defense, SECRET, width=64,
                                        steps=150, lr=3e-3, batch_size=16, seed=0)
  assert losses[-10:].mean() < 0.7 * losses[:10].mean()
  # On held-out documents with fresh noise: squared error to the clean output, numpy.
  noisy, z, clean = snd._noisy_and_clean(params, CFG, heldout, K, defense,  # pylint: disable=protected-access
                                         SECRET.keys("snd", 99))
  raw = np.mean(np.sum((np.asarray(noisy) - np.asarray(clean)) ** 2, -1))
  fixed = np.mean(np.sum((np.asarray(snd.denoise(denoiser, noisy, z)) - np.asarray(clean)) ** 2,
                         -1))
  print(f"snd denoiser: held-out squared error {raw:.4f} -> {fixed:.4f}")
  assert fixed < 0.8 * raw
  # And the utility path uses it: per-document CE with the denoiser differs from without.
  with_d = snd.corpus_cross_entropy(params, CFG, tokens[64:], K, defense, SECRET, denoiser)
  without = snd.corpus_cross_entropy(params, CFG, tokens[64:], K, defense, SECRET, None)
  assert with_d.shape == (32,) and not np.allclose(with_d, without)


def test_heldout_utility_trains_the_denoiser_on_the_clients_documents(model):
  """The utility the main job records for snd is the denoised client's: its defended arm
  is the CE of the head on D(o~, z), D trained on client_tokens at the defense's public
  settings; without the client's documents it refuses; off, it is the undefended CE."""
  params, tokens = model
  defense = D.make("snd", epsilon=20.0, denoiser_width=32, denoiser_steps=40)
  cost = utility.heldout_utility(params, CFG, tokens[64:], K, defense, SECRET,
                                 client_tokens=tokens[:64], batch_size=16, n_boot=100)
  denoiser, losses = snd.train_denoiser(params, CFG, tokens[:64], K, defense, SECRET,
                                        width=32, steps=40, lr=3e-3, batch_size=16, seed=0)
  assert len(losses) == 40
  denoised = snd.corpus_cross_entropy(params, CFG, tokens[64:], K, defense, SECRET, denoiser,
                                      batch_size=16)
  raw = snd.corpus_cross_entropy(params, CFG, tokens[64:], K, defense, SECRET, None,
                                 batch_size=16)
  assert not np.isclose(denoised.mean(), raw.mean())
  np.testing.assert_allclose(cost["defended"]["cross_entropy"]["value"], denoised.mean(),
                             rtol=1e-6)
  with pytest.raises(ValueError, match="client_tokens"):
    utility.heldout_utility(params, CFG, tokens[64:], K, defense, SECRET, batch_size=16,
                            n_boot=10)
  off = utility.heldout_utility(params, CFG, tokens[64:], K, D.make("snd", epsilon=None),
                                None, batch_size=16, n_boot=10)
  assert off["defended"]["cross_entropy"]["value"] == off["undefended"]["cross_entropy"]["value"]
