"""Adaptive attack on d_chi-privacy of the input embeddings (`dx_privacy`, `snd`).

Threat model: the client adds z_t, p(z) proportional to exp(-epsilon ||z||), to each input
embedding e_t = table[x_t] (optionally replacing e_t + z_t by its nearest table row) and
runs its k blocks on the result; the server observes h = blocks(e'). The attacker knows
epsilon and `project` (public parameters of the capture's defense), holds the client
layers its knowledge grants and the model's later blocks (its language prior); never the
noise draw. Split-and-Denoise (`snd`) sends the same h (its denoiser acts on the client's
side after the server's answer), so this attack fits it unchanged.

Two stages (adaptive-attacks.md: decode under the mechanism's likelihood with the prior):

1. Recover e' [B, T, d] from h.
   * project=False: e' is continuous. The client map is injective on these inputs, so
     e' = argmin_e sum_t ||client(e)_t - h_t||^2, optimised by Adam (cosine-decayed learning
     rate, `dx_recover_steps` steps) from the ridge decoding of h: BiSR(f)'s forward
     matching (Chen et al., CCS 2024) with the squared error, since the scale of h carries
     the noise's norm, and without snapping to tokens.
   * project=True: e' = table[y], y a token sequence, and h = client(y) exactly: y is what
     the undefended attack (ridge candidates, activation-matching beam search) recovers.
2. Posterior decoding: a beam over positions maximising

     sum_t [ prior_weight * log P_LM(x_t | x_<t) - epsilon * ||e'_t - table[x_t]|| ],

   over the whole vocabulary at every position (the likelihood costs one distance per
   token, so no candidate list is needed), P_LM the attacker's whole model on each beam's
   prefix (the client's KV cache for the prefix's rows, the later blocks' own cache for the
   prior, as `likelihood_beam` does). -epsilon ||e' - table[x]|| is log p_mech(e' | x) up to
   a constant in x: the exact likelihood of the continuous mechanism.
   With projection the exact likelihood is P(y | x) = P(nearest(table[x] + z) = y), the
   mass of y's Voronoi cell under the noise centred at table[x]. This attack uses the
   d_chi density at table[y] as its surrogate: P(y | x) ~ vol(cell_y) * exp(-epsilon
   ||table[y] - table[x]||) when the density varies little across a cell, and vol(cell_y)
   does not depend on x, so it drops out of the argmax over x at that position; when the
   noise is small against the cells both put their mass on x = y. A Monte Carlo estimate
   would need S * V distances per (candidate, position) and is noisy where it matters (the
   rare non-identity transitions); the surrogate is exact in both limits and costs V.

prior_weight = 1 is the Bayes posterior (Balunovic et al., ICLR 2022); 0 is the mechanism's
maximum likelihood alone, i.e. the nearest row to e'.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lla.attacks import budget as budget_lib
from lla.attacks import optimise, registry
from lla.attacks.adaptive import common as adaptive
from lla.attacks.adaptive import likelihood_beam
from lla.attacks.published import bisr_f
from lla.attacks.workspace import Workspace, run_steps
from lla.defenses.activations import clip_rows
from lla.model import cost
from lla.model.gpt2 import GPT2Config

budget_lib.declare("dx_recover_steps", 400, int, low=0,
                   doc="dx_privacy_adaptive: Adam steps recovering the noisy input embeddings "
                   "from h", source="lla")
budget_lib.declare("dx_recover_lr", 0.01, float, low=0.0, strict_low=True,
                   doc="dx_privacy_adaptive: peak Adam learning rate (cosine-decayed to 0)",
                   source="lla")

ADAPTS_TO = ("dx_privacy", "snd")


def _optimizer(lr: float, steps: int) -> optax.GradientTransformation:
  return optax.adam(optax.cosine_decay_schedule(lr, max(steps, 1)))


def _losses(params, cfg: GPT2Config, k: int, e: jax.Array, target: jax.Array) -> jax.Array:
  """Per-document mean squared error [b] of the client on e [b, T, d] against target."""
  out = optimise.embedded_client(params, cfg, e, 0, k)
  return jnp.mean((out - target) ** 2, axis=(1, 2))


@functools.partial(jax.jit, static_argnames=("lr", "steps"))
def _start(e: jax.Array, *, lr: float, steps: int):
  return e, _optimizer(lr, steps).init(e)


@functools.partial(jax.jit, static_argnames=("cfg", "k", "lr", "total"))
def _recover_step(params, target, carry, *, cfg, k, lr, total):
  """One Adam step of every document (of `total`, the schedule's length): ((e, state),
  losses [b] before the update)."""
  e, state = carry
  losses, grad = optimise.losses_and_grad(lambda e_: _losses(params, cfg, k, e_, target), e)
  updates, state = _optimizer(lr, total).update(grad, state, e)
  return (optax.apply_updates(e, updates), state), losses


@functools.partial(jax.jit, static_argnames=("cfg", "k"))
def _final_losses(params, target, e, *, cfg, k):
  return _losses(params, cfg, k, e, target)


def recover_embeddings(ws: Workspace, budget) -> tuple[np.ndarray, dict, float]:
  """e' [B, T, d] whose client output matches the observed h (project=False): Adam on the
  squared error from the ridge decoding. Returns (e', loss summary, analytic FLOPs)."""
  steps, lr = int(budget.dx_recover_steps), float(budget.dx_recover_lr)

  def per_chunk(h, e0, index):
    target = jnp.asarray(h, jnp.float32)
    carry = ws.call(_start, jnp.asarray(e0, jnp.float32), lr=lr, steps=steps)
    carry, losses = optimise.drive(ws.call, _recover_step, carry, steps=steps,
                                   attack="dx_privacy_adaptive", doc_index=index,
                                   consts=(ws.params, target), cfg=ws.cfg, k=ws.cut, lr=lr,
                                   total=steps)
    final = np.asarray(ws.call(_final_losses, ws.params, target, carry[0], cfg=ws.cfg,
                               k=ws.cut))
    optimise.check_finite(final[None], "dx_privacy_adaptive", steps, index)
    return np.asarray(carry[0]), losses.T, final

  e, losses, final = ws.map_documents(
      per_chunk, (ws.activations, ws.decoded_embeddings(), ws.doc_index),
      bisr_f.bytes_per_doc(ws))
  analytic = bisr_f.refine_flops(ws.cfg, ws.cut, ws.num_docs, ws.seq_len, steps)
  return np.asarray(e, np.float32), optimise.loss_summary(losses, final), analytic


def _doc_step(params, table, cfg, k, epsilon, prior_weight, carry, t, e_t, forced):
  """Position t of one document's beam (carry: `likelihood_beam.start`'s); e_t [d] the
  recovered embedding; forced: the known token at t, or -1. The mechanism's cost of token
  x is epsilon ||e_t - wte[x]||, the d_chi density's negative log up to a constant."""
  distance = jnp.sqrt(jnp.maximum(jnp.sum((table - e_t) ** 2, -1), 0.0))   # [V]
  return likelihood_beam.vocabulary_step(params, cfg, k, prior_weight, carry, t,
                                         epsilon * distance, forced)


@functools.partial(jax.jit, static_argnames=("cfg", "k", "epsilon", "prior_weight"))
def step(params, table, state, t, e_t, forced_t, cfg: GPT2Config, k: int, epsilon: float,
         prior_weight: float):
  """Position t of every document's posterior beam: e_t [B, d], forced_t [B] (-1: free)."""
  one = lambda carry, e, forced: _doc_step(params, table, cfg, k, epsilon, prior_weight,
                                           carry, t, e, forced)
  return jax.vmap(one)(state, e_t, forced_t)


def posterior_decode(params, cfg: GPT2Config, k: int, e: jax.Array, table: jax.Array,
                     epsilon: float, prior_weight: float, width: int,
                     prefix: tuple[int, ...] = (), scan=None) -> jax.Array:
  """argmax_x sum_t [prior_weight log P(x_t | x_<t) - epsilon ||e_t - table[x_t]||] by a beam
  of `width` over positions: e [B, T, d] -> tokens [B, T] (the best beam), the first
  len(prefix) positions held at the public prefix. table [V, d]: the rows the noise was
  added to (the input table, clipped where the mechanism clips). `scan`: `Workspace.scan`
  (metered) or None (`workspace.run_steps`)."""
  scan = scan or run_steps
  batch, seq_len = e.shape[:2]
  forced = np.full((batch, seq_len), -1, np.int32)
  forced[:, :len(prefix)] = np.asarray(prefix, np.int32)
  xs = (jnp.arange(seq_len, dtype=jnp.int32), jnp.swapaxes(jnp.asarray(e, jnp.float32), 0, 1),
        jnp.swapaxes(jnp.asarray(forced), 0, 1))
  state = likelihood_beam.start(jnp.asarray(e, jnp.float32), cfg=cfg, k=k, width=width)
  state = scan(step, (params, jnp.asarray(table, jnp.float32)), state, xs, cfg=cfg, k=k,
               epsilon=float(epsilon), prior_weight=float(prior_weight))
  return state[2][:, 0]


def decode_flops(cfg: GPT2Config, k: int, num_docs: int, seq_len: int, width: int,
                 prior: bool) -> float:
  """Matmul FLOPs of the posterior beam: per position and beam the client's one-token step
  (k blocks), the distances to every row (3 V d per position) and, with the prior, the
  later blocks' step and the head (2 V d)."""
  per_token = cost.token_block_flops(cfg, seq_len)
  per_beam = k * per_token
  if prior:
    per_beam += (cfg.n_layer - k) * per_token + 2.0 * cfg.vocab_size * cfg.n_embd
  return float(num_docs) * seq_len * (width * per_beam + 3.0 * cfg.vocab_size * cfg.n_embd)


class DxPrivacyAdaptive:
  """Recover e' from h, then the posterior beam under the d_chi mechanism (module doc)."""

  spec = registry.AttackSpec(
      "dx_privacy_adaptive", "beam_inversion", ("activations",),
      budget_fields=("beam_width", "candidates", "ridge_alpha", "likelihood_prior_weight",
                     "dx_recover_steps", "dx_recover_lr"),
      adapts_to=ADAPTS_TO, reference_attack="activation",
      description="noisy input embeddings recovered from h (forward matching; the undefended "
      "beam where projected), then a beam under the d_chi likelihood -epsilon ||e' - table[x]|| "
      "plus the language prior",
      reference="../shared/notes/adaptive-attacks.md; Feyisetan et al. WSDM'20 (d_chi); "
      "Chen et al. CCS'24 (BiSR(f)); Balunovic et al. ICLR'22 (Bayes-optimal adversary)",
      threat_model="knows epsilon and whether the noise is projected to the nearest token, "
      "holds the client layers its knowledge grants and the model's later blocks (language "
      "prior); never the noise draw",
      capabilities=("the d_chi mechanism's likelihood (exact; the density at the projected "
                    "row as the nearest-neighbour kernel's surrogate)",
                    "language prior of the attacker's model"),
      checks=(("adaptation", "tests/test_dx_privacy_adaptive.py::test_adaptive_beats_the_plain_"
               "search_on_a_defended_capture", "recovery on a dx_privacy-defended tiny model"),
              ("reference_consistency", "tests/test_dx_privacy_adaptive.py::test_uniform_prior_"
               "picks_the_nearest_row", "argmax of -eps ||e' - t_x|| by numpy")))

  def __call__(self, ws: Workspace, budget, key: jax.Array) -> registry.AttackResult:
    del key  # deterministic: the recovery starts from the ridge decoding
    params = adaptive.public_params(ws)
    if params.get("epsilon") is None:
      raise ValueError("dx_privacy_adaptive needs the capture's public epsilon (the defense "
                       "is off: run the undefended attacks)")
    epsilon, project = float(params["epsilon"]), bool(params.get("project", False))
    # SnD clips the rows before the noise: the likelihood is centred on the clipped rows.
    clip = params.get("clip_norm")
    table = ws.wte if clip is None else clip_rows(ws.wte, float(clip))
    width, prior_weight = int(budget.beam_width), float(budget.likelihood_prior_weight)
    if project:
      tokens, analytic = adaptive.undefended_attack(ws, ws.activations, int(budget.candidates),
                                                    width)
      e, details = np.asarray(ws.wte)[tokens], {"recovered": "undefended beam (projected rows)"}
    else:
      e, summary, analytic = recover_embeddings(ws, budget)
      details = {"recovered": "forward matching", "recovery_loss": summary}
    search = lambda e_chunk: posterior_decode(ws.params, ws.cfg, ws.cut, e_chunk, table,
                                              epsilon, prior_weight, width, ws.known_prefix,
                                              ws.scan)
    state_bytes = 4.0 * width * ws.cfg.n_layer * 2 * ws.seq_len * ws.cfg.n_embd
    predictions = ws.map_documents(search, (e,), state_bytes + 8.0 * ws.cfg.vocab_size * width)
    analytic += decode_flops(ws.cfg, ws.cut, ws.num_docs, ws.seq_len, width, prior_weight > 0)
    details.update(epsilon=epsilon, project=project, prior_weight=prior_weight,
                   likelihood="exact d_chi density" if not project
                   else "d_chi density at the projected row (surrogate of the NN kernel)")
    return registry.AttackResult(np.asarray(predictions, np.int32), analytic, details)


registry.register(DxPrivacyAdaptive())
