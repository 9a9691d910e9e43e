"""`mid_adaptive`: inversion of MID's bottleneck through a shadow MID (PROTOCOL section 5a).

Threat model: the victim's client sends h' = decode(mu(h) + exp(logvar(h) / 2) n) through a
bottleneck whose weights are its secret (lla.defenses.mid); the attacker knows the mechanism
and its public parameters (lambda, the width b, the initial noise std), holds the client
layers its knowledge grants and public calibration text, never the weights or the noise.

What the secret cannot hide: every message is decode(z) = z W_dec + c_dec, so the centred
messages span the b-dimensional row space of the secret decoder, which the capture reveals
(its top-b principal directions U [d, b]). The attack
  1. estimates U from the captured messages (a float64 eigendecomposition);
  2. builds a shadow MID from it, the victim's initialisation with U for the secret Q (the
     same mechanism up to a rotation inside the subspace, which the noise does not see), and
     fine-tunes it on its calibration text at the public lambda (`mid_shadow_steps` AdamW
     steps on the bottleneck, the model frozen: BiSR's shadow pattern, as nopeek_adaptive),
     at the bottleneck's public learning rate `weights_lr` where the defense declares one,
     else at `mid_shadow_lr`;
  3. trains noise-aware linear inverters on the shadow's sampled outputs for its calibration
     text (`mid_shadow_draws` noise draws with the attacker's own key): a ridge to the input
     embeddings (candidates) and a ridge to its clean client rows (denoised targets);
  4. runs the beam search of PROTOCOL section 4 through its own client on the denoised
     targets with those candidates.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lla.attacks.adaptive import common as adaptive
from lla.attacks.seed import beam
from lla.attacks import budget as budget_lib
from lla.attacks import candidates as cand_lib
from lla.attacks import registry, ridge
from lla.attacks.workspace import Workspace
from lla.defenses import mid
from lla.model import cost
from lla.model import split

budget_lib.declare("mid_shadow_steps", 32, int, low=0,
                   doc="mid_adaptive: AdamW steps of the shadow bottleneck's fine-tune",
                   source="lla (the victim's fine-tune length, configs/finetune.py)")
budget_lib.declare("mid_shadow_lr", 3e-4, float, low=0.0, strict_low=True,
                   doc="mid_adaptive: the shadow fine-tune's learning rate where the defense "
                   "declares no weights_lr",
                   source="configs/finetune.py (the victim's)")
budget_lib.declare("mid_shadow_draws", 4, int, low=1,
                   doc="mid_adaptive: noise draws per calibration document for the inverters",
                   source="lla")


def decoder_subspace(messages: np.ndarray, b: int) -> np.ndarray:
  """U [d, b]: the top-b principal directions of the centred messages [N, T, d]."""
  x = np.asarray(messages, np.float64).reshape(-1, messages.shape[-1])
  x = x - x.mean(axis=0)
  _, vectors = np.linalg.eigh(x.T @ x)
  return vectors[:, ::-1][:, :b]


def shadow_weights(u: np.ndarray, init_std: float) -> dict:
  """The victim's initialisation (lla.defenses.mid.init_weights) with U for its secret Q."""
  d, b = u.shape
  q = jnp.asarray(u, jnp.float32)
  return {"mu": {"kernel": q, "bias": jnp.zeros((b,), jnp.float32)},
          "logvar": {"kernel": jnp.zeros((d, b), jnp.float32),
                     "bias": jnp.full((b,), 2.0 * np.log(init_std), jnp.float32)},
          "decoder": {"kernel": q.T, "bias": jnp.zeros((d,), jnp.float32)}}


@functools.partial(jax.jit, static_argnames=("cfg", "k", "lam", "lr"))
def shadow_step(weights, opt_state, params, tokens, key, cfg, k: int, lam: float, lr: float):
  """One AdamW step of the MID objective on the bottleneck alone, tokens [N, T]."""
  loss_of = lambda w: mid.objective({**params, mid.PARAMS_KEY: w}, cfg, tokens, k, lam, key)
  loss, grads = jax.value_and_grad(loss_of)(weights)
  updates, opt_state = optax.adamw(lr).update(grads, opt_state, weights)
  return optax.apply_updates(weights, updates), opt_state, loss


@functools.partial(jax.jit, static_argnames=("cfg", "k", "draws"))
def shadow_samples(weights, params, tokens, key, cfg, k: int, draws: int):
  """(the shadow's sampled messages [draws * N, T, d], clean client rows [draws * N, T, d])."""
  h = split.client(params, cfg, tokens, k)
  noisy = jnp.concatenate([mid.sample(weights, h, jax.random.fold_in(key, i))
                           for i in range(draws)])
  return noisy, jnp.concatenate([h] * draws)


class MidAdaptive:
  """The registered attack (see the module docstring)."""

  spec = registry.AttackSpec(
      "mid_adaptive", "beam_inversion", ("activations",),
      budget_fields=("candidates", "beam_width", "ridge_alpha", "mid_shadow_steps",
                     "mid_shadow_lr", "mid_shadow_draws"),
      adapts_to=("mid",), reference_attack="activation",
      description="the secret decoder's range from the capture, a shadow MID there fine-tuned "
      "at the public lambda, noise-aware ridge inverters on its samples, beam search on the "
      "denoised messages",
      reference="../shared/notes/adaptive-attacks.md (learned bottlenecks); BiSR (Chen et al. "
      "CCS'24) shadow pattern; VFLAIR-LLM MID",
      threat_model="knows MID's lambda, width and initial noise; holds the client layers its "
      "knowledge grants and public calibration text; never the bottleneck's weights or noise",
      capabilities=("the decoder's range recovered exactly from the messages (rank b)",
                    "the map inside the range assumed near the initialisation's (short "
                    "fine-tunes); a bottleneck trained far from it is unqualified"),
      checks=(("adaptation", "tests/test_defenses_mid.py::test_mid_adaptive",
               "the subspace equals the secret decoder's row space; recovery above the "
               "activation attack's on the same MID capture"),))

  def __call__(self, ws: Workspace, budget, key: jax.Array) -> registry.AttackResult:
    public = adaptive.public_params(ws)
    d = ws.cfg.n_embd
    b = int(public.get("width") or d)
    lam = float(public.get("lam", 0.0))
    init_std = float(public.get("init_std", mid.VFLAIR_INIT_STD))
    steps, draws = int(budget.mid_shadow_steps), int(budget.mid_shadow_draws)
    # The defender's bottleneck rate is public (E's defense parameters): the shadow mirrors it.
    shadow_lr = float(public.get("weights_lr") or budget.mid_shadow_lr)
    num, width = int(budget.candidates), int(budget.beam_width)
    u = decoder_subspace(ws.activations, b)
    ws.count_host(2.0 * ws.activations[..., 0].size * d * d + 10.0 * d ** 3)
    train_key, noise_key = jax.random.split(key)
    weights, losses = self._fine_tune(ws, shadow_weights(u, init_std), lam, steps, shadow_lr,
                                      train_key)
    noisy, clean = (np.asarray(a) for a in ws.call(
        shadow_samples, weights, ws.params, jnp.asarray(ws.calibration_tokens), noise_key,
        cfg=ws.cfg, k=ws.cut, draws=draws))
    wte = split.wte(ws.params)
    tokens = np.concatenate([ws.calibration_tokens] * draws)
    to_tokens = ridge.fit_ridge(noisy, np.asarray(wte)[tokens], float(budget.ridge_alpha))
    to_clean = ridge.fit_ridge(noisy, clean, float(budget.ridge_alpha))
    ws.count_host(2 * ridge.ridge_flops(noisy[..., 0].size, d, d))
    candidates = ws.map_call(cand_lib.decoded_nearest_tokens, (ws.activations,),
                             8.0 * ws.seq_len * ws.cfg.vocab_size,
                             consts=(to_tokens.weights, to_tokens.mu_h, to_tokens.mu_e, wte),
                             num=num)
    targets = np.asarray(ridge.decode(to_clean.weights, to_clean.mu_h, to_clean.mu_e,
                                      jnp.asarray(ws.activations)), np.float32)
    ws.count_host(2.0 * ws.activations[..., 0].size * d * d)
    predictions, _ = adaptive.beam_on(ws, targets, np.asarray(candidates, np.int32), width)
    n = ws.num_docs
    flops = (steps * 3.0 * 2.0 * ws.calibration_tokens.size * ws.cfg.n_layer
             * cost.block_weights(ws.cfg)
             + beam.analytic_flops(ws.cfg, ws.cut, n, width, num, ws.seq_len,
                                   len(ws.known_prefix))
             + cand_lib.candidate_flops(n * ws.seq_len, ws.cfg.vocab_size, d))
    return registry.AttackResult(predictions, flops, {
        "lam": lam, "width": b, "shadow_steps": steps, "shadow_lr": shadow_lr,
        "shadow_draws": draws,
        "shadow_loss_first_last": [losses[0], losses[-1]] if losses else []})

  def _fine_tune(self, ws: Workspace, weights, lam: float, steps: int, lr: float, key):
    opt_state = optax.adamw(lr).init(weights)
    tokens = jnp.asarray(ws.calibration_tokens)
    losses = []
    for i in range(steps):
      weights, opt_state, loss = ws.call(shadow_step, weights, opt_state, ws.params, tokens,
                                         jax.random.fold_in(key, i), cfg=ws.cfg, k=ws.cut,
                                         lam=lam, lr=lr)
      if not np.isfinite(float(loss)):
        raise FloatingPointError(f"mid_adaptive: shadow loss {float(loss)} at step {i}")
      losses.append(float(loss))
    return weights, losses


registry.register(MidAdaptive())
