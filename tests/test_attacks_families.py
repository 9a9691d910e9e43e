"""The family x attack matrix: every generic passive attack replayed on tiny random
checkpoints of GPT-2 (the reference row), Llama (untied head, GQA), Qwen3 (q/k-norm,
GQA, H * D != d), Mistral (a sliding window shorter than the documents, linear RoPE, MQA),
Qwen2 (q/k/v biases) and Gemma ((1 + w) norm, GeGLU, scaled embeddings).

Each family's checkpoint (V = 64, d = 32, 3 layers, norm weights and biases perturbed away
from their init) goes through `hf_io.save_hf_dir` / `load_hf_dir`, is captured in training
(h and g) at cut k = 2 for 4 documents of 6 uniformly random tokens, and every attack of
`MATRIX` is replayed through `lla.replay.driver.replay` with small budgets. Each cell is
one of:

* "recovers": the attack is exact on this setting (SipIt; activation and joint beam search
  with every token of the tiny vocabulary as a candidate) and must return the captured
  tokens (the independent fact: what `capture_target` was given), every position;
* "works": the replay records status "ok" and a prediction of the right shape;
* "refused": the replay refuses before running, with the one-line message
  "attack X does not support family Y yet" (lla.attacks.registry.check_family).

`test_matrix_covers_registry` keeps the matrix complete: an attack registered later is
refused on the RoPE families until it has a row here.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lla.attacks import registry
from lla.attacks.registry import relevant_budget as relevant
from lla.capture import capture
from lla.model import decoder, hf_io
from lla.model.decoder import DecoderConfig
from lla.model.gpt2 import GPT2Config
from lla.replay import driver as replay

from test_attacks_units import random_params as gpt2_random_params

V, K, B, T, N_CAL = 64, 2, 4, 6, 24
CONFIGS = {
    "gpt2": GPT2Config(vocab_size=V, n_positions=16, n_embd=32, n_head=4, n_layer=3),
    "llama": DecoderConfig(family="llama", vocab_size=V, n_positions=16, n_embd=32, n_layer=3,
                           n_head=4, n_kv_head=2, head_dim=8, d_ff=48, norm_eps=1e-5,
                           tie_embeddings=False),
    "qwen3": DecoderConfig(family="qwen3", vocab_size=V, n_positions=16, n_embd=32, n_layer=3,
                           n_head=4, n_kv_head=2, head_dim=16, d_ff=48, norm_eps=1e-6,
                           qk_norm=True, rope_theta=1e6, tie_embeddings=True),
    # A window shorter than the documents (W = 4 < T = 6): late positions see a truncated
    # prefix, which the KV-cached attacks must reproduce; linear RoPE, MQA, untied head.
    "mistral": DecoderConfig(family="mistral", vocab_size=V, n_positions=16, n_embd=32,
                             n_layer=3, n_head=4, n_kv_head=1, head_dim=8, d_ff=48,
                             norm_eps=1e-5, sliding_window=4, rope_type="linear",
                             rope_factor=2.0, tie_embeddings=False),
    "qwen2": DecoderConfig(family="qwen2", vocab_size=V, n_positions=16, n_embd=32, n_layer=3,
                           n_head=4, n_kv_head=2, head_dim=8, d_ff=48, norm_eps=1e-6,
                           qkv_bias=True, rope_theta=1e6, tie_embeddings=True),
    # Gemma: (1 + w) RMSNorm, GeGLU, the input table scaled by sqrt(d), head_dim * H != d.
    "gemma": DecoderConfig(family="gemma", vocab_size=V, n_positions=16, n_embd=32, n_layer=3,
                           n_head=2, n_kv_head=1, head_dim=32, d_ff=48, norm="rmsnorm_1p",
                           norm_eps=1e-6, mlp="geglu", embed_scale=32 ** 0.5,
                           tie_embeddings=True),
}
FAMILIES = list(CONFIGS)

# Generic passive attacks (no defense they adapt to, not defense-aware): every family.
RUNS = ["ridge", "activation", "activation_flop_matched", "joint", "random_candidates",
        "shuffled_gradients", "gradient_only", "gradient_only_t1", "sipit", "sip",
        "sip_linear", "bisr_f", "bisr_b", "bisr", "eia", "tag", "lamp"]
EXACT = ["activation", "joint", "sipit"]
# Attacks that only run on a capture defended by the mechanism they adapt to, the
# defense-aware baselines and the active decoder: not yet exercised on a RoPE family.
REFUSED_ON_ROPE = ["gaussian_adaptive", "mixup_adaptive", "nopeek_adaptive",
                   "projection_adaptive", "quantize_adaptive", "topk_adaptive",
                   "activation_defense_aware", "joint_defense_aware", "fsha_decode"]
MATRIX = {(a, f): ("recovers" if a in EXACT else "works") for a in RUNS for f in FAMILIES}
MATRIX.update({(a, f): "refused" for a in REFUSED_ON_ROPE for f in FAMILIES if f != "gpt2"})

# Small budgets: every candidate on the tiny vocabulary for the exact beams, a few steps of
# the optimisation attacks (they must run, not converge).
BUDGET = dict(candidates=V, c_a=V // 2, c_g=V // 2, beam_width=2, ridge_alpha=1e-3,
              shuffle_seed=17, sip_epochs=2, sip_hidden=16, sip_batch=4, bisr_f_steps=10,
              bisr_b_steps=4, eia_steps=10, eia_mapper=False, tag_steps=10, lamp_steps=10,
              lamp_freq=5, lamp_candidates=4)


def family_params(cfg, seed: int):
  if isinstance(cfg, GPT2Config):
    return gpt2_random_params(cfg, seed=seed, std=0.1, emb_std=0.5)
  params = decoder.random_params(cfg, seed, std=0.1)
  rng = np.random.default_rng(seed + 1)
  perturb = lambda leaf: leaf + 0.1 * rng.standard_normal(leaf.shape).astype(np.float32)
  return jax.tree_util.tree_map_with_path(
      lambda path, leaf: perturb(leaf) if path[-1].key in ("scale", "bias") else leaf, params)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
  """(family, run directory root, attacker, captured tokens) with a training capture."""
  name, cfg = request.param, CONFIGS[request.param]
  root = tmp_path_factory.mktemp(name)
  hf_io.save_hf_dir(family_params(cfg, seed=3), cfg, root / "hf")
  params, loaded = hf_io.load_hf_dir(root / "hf")
  assert loaded == cfg
  rng = np.random.default_rng(3)
  tokens = rng.integers(0, V, (B, T)).astype(np.int32)
  cal = rng.integers(0, V, (N_CAL, T)).astype(np.int32)
  capture.capture_target(str(root / "cap"), params, cfg, tokens, range(B), K, model_id=name,
                         training=True, batch_size=B)
  attacker = replay.Attacker(params, cfg, name, cal, "public", {"hf_dir": str(root / "hf")})
  return name, root, attacker, tokens


def test_matrix_covers_registry():
  """Every registered attack has a cell per family; the refusals are exactly the ones the
  registry declares."""
  # The built-in attacks only: other tests of the session may have registered plugins.
  builtin = [n for n in registry.names() if registry.source(n)["module"].startswith("lla.")]
  assert sorted(RUNS + REFUSED_ON_ROPE) == builtin
  for name in builtin:
    for f in FAMILIES:
      assert (name, f) in MATRIX or (f == "gpt2" and name in REFUSED_ON_ROPE)
      refused = name in REFUSED_ON_ROPE and f != "gpt2"
      assert registry.supports_family(name, f) != refused, (name, f)


def test_matrix_runs(family):
  name, root, attacker, tokens = family
  records = replay.replay(str(root / "run"), str(root / "cap"), attacker, RUNS,
                          relevant(BUDGET, RUNS), seed=0, mesh=None)
  status = {r.attack if hasattr(r, "attack") else r.prediction_file: r.status for r in records}
  assert [r.status for r in records] == ["ok"] * len(RUNS), status
  recovered = {}
  for attack in RUNS:
    pred = np.load(root / "run" / "predictions" / f"{attack}.npy")
    assert pred.shape == (B, T) and pred.dtype == np.int32
    recovered[attack] = float(np.mean(pred == tokens))
  print(f"\n{name}: " + ", ".join(f"{a}={r:.2f}" for a, r in recovered.items()))
  for attack in EXACT:
    assert recovered[attack] == 1.0, (name, attack, recovered[attack])


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "gpt2"], indirect=True)
@pytest.mark.parametrize("attack", REFUSED_ON_ROPE)
def test_matrix_refusals(family, attack):
  name, root, attacker, _ = family
  assert MATRIX[(attack, name)] == "refused"
  with pytest.raises(registry.IncompatibleCaptureError) as err:
    replay.replay(str(root / f"refused_{attack}"), str(root / "cap"), attacker, [attack],
                  relevant(BUDGET, [attack]), seed=0, mesh=None)
  assert str(err.value) == f"attack {attack} does not support family {name} yet"
  assert not (root / f"refused_{attack}").exists()
