"""The family x attack matrix: every generic passive attack replayed on tiny random
checkpoints of GPT-2 (the reference row), Llama (untied head, GQA), Qwen3 (q/k-norm,
GQA, H * D != d), Mistral (a sliding window shorter than the documents, linear RoPE, MQA),
Qwen2 (q/k/v biases) and Gemma ((1 + w) norm, GeGLU, scaled embeddings).

Each family's checkpoint (V = 64, d = 32, 3 layers, norm weights and biases perturbed away
from their init) goes through `hf_io.save_hf_dir` / `load_hf_dir`, is captured in training
(h and g) at cut k = 2 for 4 documents of 6 uniformly random tokens, and every attack of
`MATRIX` is replayed through `lla.replay.driver.replay` with small budgets. Each cell is
one of:

* "recovers": the attack is exact on this setting (SipIt; every beam search whose
  candidates include the true token: activation, joint and their controls with every
  token of the tiny vocabulary as a candidate, the activation slots ranked on noiseless h)
  and must return the captured tokens (the independent fact: what `capture_target` was
  given), every position;
* "works": the replay records status "ok" and a prediction of the right shape, and the
  prediction recovers more of the captured tokens than the frequency baseline (the
  calibration's most common token, counted here with numpy): the gradient heuristic every
  position t >= 1, where g[t - 1] carries the token as its label, and the baseline token at
  t = 0; the learned and optimised inverters (calibrated on 256 documents, with the steps
  and learning rate to fit them) at least one token more than the baseline.

An attack without a cell (a plugin's, or one registered later) is refused on the RoPE
families before it runs, with the one-line message "attack X does not support family Y
yet" (lla.attacks.registry.check_family).

The adaptive attacks and the defense-aware baselines run on defended captures of the same
checkpoints (`test_defended_matrix`): per defense, a training capture whose h (and g) went
through the mechanism with an explicit secret (`defenses.training.batched_messages`, as the
main job's defense sweep makes them), replayed with its adaptive attack (the recovered
tokens must be the captured ones where the mechanism loses nothing the tiny vocabulary
needs; mixup's rows must all be unmixed), and one of them with both defense-aware beams.

`test_matrix_covers_registry` keeps the matrix complete: an attack registered later is
refused on the RoPE families until it has a row here.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lla import defenses
from lla.attacks import registry
from lla.attacks.registry import relevant_budget as relevant
from lla.capture import capture
from lla.model import decoder, hf_io
from lla.model.decoder import DecoderConfig
from lla.model.gpt2 import GPT2Config
from lla.defenses import training as defended
from lla.replay import driver as replay
from lla.study import defense_sweep

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
    # Gemma-3: Gemma's (1 + w) RMSNorm, GeGLU, input table scaled by sqrt(d) and
    # head_dim * H != d, plus q/k-norm, sandwich norms, a score scale other than head_dim,
    # and windowed layers (W = 4 < T = 6, their own RoPE base) around a full one. Gemma-1
    # adds nothing the attacks see beyond these; its parity is tests/test_model_families.py.
    "gemma3": DecoderConfig(family="gemma3", vocab_size=V, n_positions=16, n_embd=32,
                            n_layer=3, n_head=2, n_kv_head=1, head_dim=32, d_ff=48,
                            norm="rmsnorm_1p", norm_eps=1e-6, mlp="geglu",
                            embed_scale=32 ** 0.5, qk_norm=True, sandwich_norms=True,
                            query_pre_attn_scalar=24.0, rope_theta=1e6,
                            local_rope_theta=1e4, sliding_window=4,
                            window_layers=(True, False, True), tie_embeddings=True),
}
FAMILIES = list(CONFIGS)

# Generic passive attacks (no defense they adapt to, not defense-aware): every family.
RUNS = ["ridge", "activation", "activation_flop_matched", "joint", "random_candidates",
        "shuffled_gradients", "gradient_only", "gradient_only_t1", "sipit", "sip",
        "sip_linear", "bisr_f", "bisr_b", "bisr", "eia", "tag", "lamp"]
# Every token of the tiny vocabulary a candidate (candidates = c_a + c_g = V), and the
# noiseless activation ranking puts the true token first among the activation slots: the
# search's objective is zero there and only there.
EXACT = ["activation", "joint", "sipit", "activation_flop_matched", "random_candidates",
         "shuffled_gradients"]
GRADIENT_HEURISTIC = ["gradient_only", "gradient_only_t1"]
# Per message defense (public parameters, what its capture is fine-tuned with): the
# attacks replayed on its defended capture. The mechanisms that lose nothing the tiny
# vocabulary needs (4-bit quantisation, top-k, a Haar projection, NoPeek with the
# victim's own client) must be inverted exactly by their adaptive attack. A defense with
# weights of its own (mid's bottleneck, the adversarial inverter): the client holds them at
# their secret initialisation (no fine-tune: the adversarial client's h is its fixed
# client's, as after training), the attacker never does.
DEFENDED = {
    "quantize": ({"bits": 4}, False), "topk": ({"sparsity": 0.75}, False),
    "projection": ({"kind": "haar"}, False), "gaussian": ({"sigma": 0.05}, False),
    "mixup": ({"m": 2}, False), "nopeek": ({"alpha": 0.5}, True),
    "dp_forward": ({"epsilon": 3e4, "delta": 1e-5, "clip_norm": 2.0}, False),
    "dx_privacy": ({"epsilon": 300.0}, False),
    "santext": ({"epsilon": 5.0}, False), "custext": ({"epsilon": 2.0, "top_k": 4}, False),
    "mid": ({"lam": 1.0, "width": 24, "init_std": 0.02}, False),
    "adversarial": ({"alpha": 1.0, "hidden": 16}, True)}
# The adaptive attack of each defended capture: `<defense>_adaptive` unless named here.
ADAPTIVE_OF = {"santext": "sanitise_adaptive", "custext": "sanitise_adaptive"}


def adaptive_of(defense: str) -> str:
  return ADAPTIVE_OF.get(defense, f"{defense}_adaptive")


DEFENSE_AWARE = ["activation_defense_aware", "joint_defense_aware"]
# The baselines read the mechanism only through their calibration mimic (lla.defenses.aware):
# one defended capture per family exercises them (the gaussian one: a draw of noise).
AWARE_ON = "gaussian"
ADAPTIVE_EXACT = ["quantize", "topk", "projection", "nopeek"]
# The active tier's decoder: it replays what a hijacking server wrote during split training
# of each family, tests/test_active_families.py.
ACTIVE = ["fsha_decode"]
MATRIX = {(a, f): ("recovers" if a in EXACT else "works") for a in RUNS for f in FAMILIES}
MATRIX.update({(adaptive_of(d), f): ("recovers" if d in ADAPTIVE_EXACT else "works")
               for d in DEFENDED for f in FAMILIES if f != "gpt2"})
MATRIX.update({(a, f): "works" for a in DEFENSE_AWARE for f in FAMILIES if f != "gpt2"})
MATRIX.update({(a, f): "works" for a in ACTIVE for f in FAMILIES if f != "gpt2"})

# Small budgets: every candidate on the tiny vocabulary for the exact beams, a few steps of
# the optimisation attacks (they must run, not converge).
BUDGET = dict(candidates=V, c_a=V // 2, c_g=V // 2, beam_width=2, ridge_alpha=1e-3,
              shuffle_seed=17, sip_epochs=2, sip_hidden=16, sip_batch=4, bisr_f_steps=10,
              bisr_b_steps=4, eia_steps=10, eia_mapper=False, tag_steps=10, lamp_steps=10,
              lamp_freq=5, lamp_candidates=4, likelihood_candidates=V, nopeek_shadow_steps=2,
              dx_recover_steps=10, mid_shadow_steps=2, mid_shadow_draws=2,
              adversarial_shadow_steps=2, adversarial_inverter_steps=5,
              adversarial_inverter_hidden=16)


# The learned and optimised inverters of the matrix: enough calibration documents to fit an
# inverter of 64 tokens and the steps to converge on 24 positions (tens of seconds each).
N_FIT = 256
FIT_BUDGET = dict(BUDGET, sip_epochs=30, sip_lr=1e-2, bisr_f_steps=100, bisr_b_steps=20)


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
  """Every built-in attack has a cell per family and the registry lets it run there (an
  attack not checked here is refused: test_an_unverified_attack_is_refused)."""
  # The built-in attacks only: other tests of the session may have registered plugins.
  builtin = [n for n in registry.names() if registry.source(n)["module"].startswith("lla.")]
  adaptive = sorted({adaptive_of(d) for d in DEFENDED})
  assert sorted(RUNS + adaptive + DEFENSE_AWARE + ACTIVE) == builtin
  for name in builtin:
    for f in FAMILIES:
      # GPT-2 runs every attack; its defended row is tests/test_attacks_adaptive.py.
      assert (name, f) in MATRIX or f == "gpt2", (name, f)
      assert registry.supports_family(name, f), (name, f)


@pytest.mark.slow
def test_matrix_runs(family):
  name, root, attacker, tokens = family
  calibration = np.random.default_rng(4).integers(0, V, (N_FIT, T)).astype(np.int32)
  attacker = replay.Attacker(attacker.params, attacker.cfg, name, calibration, "public",
                             attacker.source)
  records = replay.replay(str(root / "run"), str(root / "cap"), attacker, RUNS,
                          relevant(FIT_BUDGET, RUNS), seed=0, mesh=None)
  status = {r.attack if hasattr(r, "attack") else r.prediction_file: r.status for r in records}
  assert [r.status for r in records] == ["ok"] * len(RUNS), status
  # The frequency baseline, independently: the calibration's most common token (the
  # smallest id among ties) and how many captured tokens it matches.
  baseline = int(np.argmax(np.bincount(calibration.ravel(), minlength=V)))
  assert {r.baseline_token for r in records} == {baseline}
  baseline_hits = int(np.sum(tokens == baseline))
  hits = {}
  for attack in RUNS:
    pred = np.load(root / "run" / "predictions" / f"{attack}.npy")
    assert pred.shape == (B, T) and pred.dtype == np.int32
    hits[attack] = pred == tokens
  print(f"\n{name}: baseline {baseline_hits}/{tokens.size}, " + ", ".join(
      f"{a}={h.mean():.2f}" for a, h in hits.items()))
  for attack in EXACT:
    assert hits[attack].all(), (name, attack, hits[attack].mean())
  for attack in GRADIENT_HEURISTIC:
    pred = np.load(root / "run" / "predictions" / f"{attack}.npy")
    assert hits[attack][:, 1:].all(), (name, attack, hits[attack].mean())
    assert (pred[:, 0] == baseline).all(), (name, attack)
  for attack in sorted(set(RUNS) - set(EXACT) - set(GRADIENT_HEURISTIC)):
    assert hits[attack].sum() > baseline_hits, (name, attack, hits[attack].sum(), baseline_hits)


# GPT-2's row is tests/test_attacks_adaptive.py (a larger vocabulary, each attack's own
# invariants); here the families that differ from it.
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "gpt2"], indirect=True)
@pytest.mark.slow
def test_defended_matrix(family):
  name, root, attacker, tokens = family
  params, cfg = attacker.params, attacker.cfg
  for defense_name, (public, fine_tuned) in DEFENDED.items():
    defense = defenses.make(defense_name, **public)
    secret = defenses.Secret.explicit(7) if defense.has_secret else None
    cap = root / f"cap_{defense_name}"
    key = getattr(defense, "params_key", None)
    client = params if key is None else {**params, key: defense.init_weights(cfg, secret)}
    capture.capture_target(
        str(cap), client, cfg, tokens, range(B), K, model_id=name, training=True,
        batch_size=B, messages=defended.batched_messages(
            client, cfg, tokens, K, defense, secret, B, training=True, fine_tuned=fine_tuned),
        defense=defense_name, defense_seed_sha256=secret.sha256 if secret else "",
        defense_params=defense_sweep.public_params(defense, secret, "test", fine_tuned))
    attacks = [adaptive_of(defense_name)]
    run = root / f"run_{defense_name}"
    records = replay.replay(str(run), str(cap), attacker, attacks, relevant(BUDGET, attacks),
                            seed=0, mesh=None)
    if defense_name == AWARE_ON:
      # The baselines mimic the mechanism on their calibration text with their own draw.
      mimic = {"name": defense_name, "params": defense.to_record(secret)["params"],
               "attacker_seed": 0}
      records += replay.replay(str(run) + "_aware", str(cap), attacker, DEFENSE_AWARE,
                               relevant(BUDGET, DEFENSE_AWARE), seed=0, mesh=None,
                               calibration_defense=mimic)
    assert all(r.status == "ok" for r in records), [(r.attack, r.status, r.error)
                                                      for r in records]
    assert len(records) == 1 + (len(DEFENSE_AWARE) if defense_name == AWARE_ON else 0)
    adaptive = np.load(run / "predictions" / f"{adaptive_of(defense_name)}.npy")
    assert adaptive.shape == (B, T) and adaptive.dtype == np.int32
    if defense_name in ADAPTIVE_EXACT:
      assert MATRIX[(adaptive_of(defense_name), name)] == "recovers"
      np.testing.assert_array_equal(adaptive, tokens, err_msg=f"{name} {defense_name}")
    if defense_name == "mixup":  # every row's documents linked and unmixed
      details = next(r.details for r in records if r.attack == "mixup_adaptive")
      assert details["rows_unmixed"] == B and details["first_row_residual_median"] < 1e-5


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "gpt2"], indirect=True)
def test_an_unverified_attack_is_refused(family):
  """An attack not yet checked here (a plugin's, or a new built-in one) is refused on the
  RoPE families before it runs, with one line naming it and the family."""
  name, _, attacker, _ = family
  unverified = registry.AttackSpec("unverified_plugin", "test", ("activations",))
  assert not registry.supports_family(unverified.name, name)
  with pytest.raises(registry.IncompatibleCaptureError) as err:
    registry.check_family(unverified, attacker.cfg)
  assert str(err.value) == f"attack unverified_plugin does not support family {name} yet"
