"""Adaptive attacks on keyless perturbations of h: noise, quantisation, top-k (PROTOCOL 5a).

Threat model: the attacker observes forward messages defended by Gaussian noise (optionally
after row clipping), per-row uniform quantisation, per-row top-k sparsification or DP-Forward
(per-sequence Frobenius clipping and analytic-Gaussian noise), and knows the mechanism and
its public parameters (sigma and the clip norm; the bit width; the kept fraction; epsilon,
delta and C, hence sigma); it holds the client layers its knowledge grants (and the model's later blocks,
its language prior), public calibration text, and never the noise draw.

The attack is the beam search of PROTOCOL section 4 with the mechanism's own likelihood
in place of the squared distance (adaptive-attacks.md sections 1-3, Balunovic et al.'s
Bayes-optimal adversary): at position t each (beam, candidate) row a = client(prefix + c)_t
is put through the deterministic part of the mechanism and scored

    cost = violation(y_t, a)^2 / (2 s^2) - prior_weight * log p(c | prefix)

  * Gaussian noise: violation = y_t - clip(a), s = sigma (the exact negative
    log-likelihood);
  * DP-Forward: violation = y_t - c a, s = sigma, where c = C / max(||X||_F, C) is the
    sequence's clip factor. The beam scores one position at a time and c depends on the
    whole sequence, so the attacker uses c of the median Frobenius norm of its own clean
    calibration sequences (norms at one length concentrate: on the tests' tiny model they
    spread by +-2%); with that c it is the exact Gaussian likelihood;
  * quantisation: the row's levels are its own [min, max] in 2^b - 1 steps, so the true
    row lies in the box y_t +- step / 2 coordinate-wise: violation = the distance of a to
    that box, s = `likelihood_rounding` * rms(y_t) (an exact mechanism up to float
    rounding);
  * top-k: the kept coordinates are exact and every dropped one is at most the smallest
    kept magnitude tau: violation = (a - y_t) on the support, max(|a| - tau, 0) off it,
    s as for quantisation;
and log p(c | prefix) is the next-token log-probability of the attacker's whole model
(its later blocks and head, run with their own KV cache on each beam's prefix). Candidates
are the nearest tokens to the ridge decoding of y_t: half from a ridge fitted on calibration
activations passed through the mechanism with the attacker's own randomness (stage
`ridge_<defense>`), the rest from the clean ridge (stage `ridge`). Each position is one
compiled step driven from Python.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from lla.attacks.adaptive import common as adaptive
from lla.attacks.seed import beam
from lla.attacks import budget as budget_lib
from lla.attacks import candidates as cand_lib
from lla.attacks import registry, ridge
from lla.attacks.workspace import Workspace
from lla.defenses import aware
from lla.defenses.activations import clip_rows
from lla.model import cost
from lla.model import split
from lla.model.gpt2 import GPT2Config

budget_lib.declare("likelihood_candidates", 32, int, low=1, high=budget_lib.VOCAB,
                   doc="likelihood beam: candidates per position", source="lla")
budget_lib.declare("likelihood_prior_weight", 1.0, float, low=0.0,
                   doc="likelihood beam: weight of the language prior (1 = Bayes)",
                   source="Balunovic et al. ICLR'22 (Bayes-optimal adversary)")
budget_lib.declare("likelihood_rounding", 1e-3, float, low=0.0, strict_low=True,
                   doc="likelihood beam: tolerance scale of exact mechanisms, relative to the "
                   "row's rms", source="lla")

MECHANISMS = ("gaussian", "quantize", "topk", "dp_forward")


@dataclasses.dataclass(frozen=True)
class Mechanism:
  """The deterministic part of a keyless defense and its noise scale (static)."""

  name: str
  sigma: float = 0.0
  clip_norm: float | None = None
  bits: int = 0
  kept: int = 0
  rounding: float = 1e-3
  scale: float = 1.0  # DP-Forward: the clip factor c applied to every row of a sequence

  def cost(self, rows: jax.Array, y: jax.Array) -> jax.Array:
    """violation^2 / (2 s^2) of candidate rows [..., d] against the observed row y [d]."""
    rms = jnp.sqrt(jnp.mean(y * y)) + 1e-30
    if self.name == "gaussian":
      clipped = rows if self.clip_norm is None else clip_rows(rows, self.clip_norm)
      return jnp.sum((clipped - y) ** 2, -1) / (2 * self.sigma**2)
    if self.name == "dp_forward":
      return jnp.sum((self.scale * rows - y) ** 2, -1) / (2 * self.sigma**2)
    if self.name == "quantize":
      half = (y.max() - y.min()) / (2**self.bits - 1) / 2
      violation = jnp.maximum(jnp.abs(rows - y) - half, 0.0)
    else:
      support = y != 0
      tau = jnp.min(jnp.where(support, jnp.abs(y), jnp.inf))
      violation = jnp.where(support, rows - y, jnp.maximum(jnp.abs(rows) - tau, 0.0))
    return jnp.sum(violation**2, -1) / (2 * (self.rounding * rms) ** 2)


def mechanism_of(ws: Workspace, budget) -> Mechanism:
  params, name = adaptive.public_params(ws), ws.defense["name"]
  rounding = float(budget.likelihood_rounding)
  if name == "gaussian":
    return Mechanism("gaussian", sigma=float(params["sigma"]),
                     clip_norm=None if params.get("clip_norm") is None
                     else float(params["clip_norm"]), rounding=rounding)
  if name == "quantize":
    return Mechanism("quantize", bits=int(params["bits"]), rounding=rounding)
  if name == "topk":
    d = ws.cfg.n_embd
    return Mechanism("topk", kept=d - int(np.floor(float(params["sparsity"]) * d)),
                     rounding=rounding)
  if name == "dp_forward":
    defense = aware.make_public(name, params)
    norm = float(np.median(np.linalg.norm(ws.calibration_activations(), axis=(1, 2))))
    return Mechanism("dp_forward", sigma=defense.sigma, clip_norm=defense.clip_norm,
                     scale=defense.clip_norm / max(norm, defense.clip_norm), rounding=rounding)
  raise ValueError(f"no likelihood for defense {name!r}")


def _server_logprobs(params, cfg: GPT2Config, k: int, server_cache, h_prev, t):
  """log p(. | prefix) [V] from the client row of position t - 1 and the server's cache;
  returns it with the server's new cache entry."""
  model = split.module(cfg)
  x, kv = model.apply({"params": params}, h_prev, server_cache, jnp.maximum(t - 1, 0), k,
                      cfg.n_layer, method="blocks_step")
  logits = model.apply({"params": params}, x[None], method="head")[0]
  return jax.nn.log_softmax(logits), kv


def _doc_step(params, cfg, k, mechanism, prior_weight, carry, t, candidates, target):
  client_cache, server_cache, tokens, scores, h_prev = carry
  width, num = scores.shape[0], candidates.shape[0]

  def prior(sc, hp):
    logp, kv = _server_logprobs(params, cfg, k, sc, hp, t)
    return logp[candidates], kv

  use_prior = prior_weight > 0
  if use_prior:
    logp, server_kv = jax.vmap(prior)(server_cache, h_prev)          # [W, C]
    logp = jnp.where(t > 0, logp, 0.0)
  else:
    logp = jnp.zeros((width, num))

  def expand(beam_cache):
    step = lambda token: split.client_step_kv(params, cfg, beam_cache, token, t)
    return jax.vmap(step)(candidates)

  rows, kv = jax.vmap(expand)(client_cache)                          # [W, C, d]
  cost = mechanism.cost(rows, target) - prior_weight * logp
  total = (scores[:, None] + cost).reshape(-1)
  neg_best, flat = jax.lax.top_k(-total, width)
  beam_idx, rank = flat // num, flat % num
  write = jax.vmap(split.write_cache, in_axes=(0, 0, None))
  new_client = write(client_cache[beam_idx], kv[beam_idx, rank], t)
  new_server = server_cache[beam_idx]
  if use_prior:
    # The server's cache gains position t - 1 of the surviving beams' parents.
    written = write(server_cache, server_kv, jnp.maximum(t - 1, 0))
    new_server = jnp.where(t > 0, written[beam_idx], new_server)
  new_tokens = tokens[beam_idx].at[:, t].set(candidates[rank])
  return (new_client, new_server, new_tokens, -neg_best, rows[beam_idx, rank])


def vocabulary_step(params, cfg: GPT2Config, k: int, prior_weight: float, carry, t,
                    mechanism_cost: jax.Array, forced: jax.Array):
  """Position t of one document's beam over the whole vocabulary, for mechanisms whose
  cost of a token does not depend on the beam's client rows (a token-level mechanism:
  d_chi noise on embeddings, SanText / CusText): every (beam, token) costs
  mechanism_cost [V] - prior_weight * log p(token | beam's prefix) and the best `width`
  are kept. `forced`: the public token at t (every other token costs inf), or -1.

  carry: `start`'s (client caches [W, ...], server caches [W, ...], tokens [W, T], scores
  [W], the client rows of position t - 1 [W, d]); returns the next carry.
  """
  client_cache, server_cache, tokens, scores, h_prev = carry
  width, vocab = scores.shape[0], mechanism_cost.shape[0]
  use_prior = prior_weight > 0
  if use_prior:
    prior = lambda sc, hp: _server_logprobs(params, cfg, k, sc, hp, t)
    logp, server_kv = jax.vmap(prior)(server_cache, h_prev)            # [W, V]
    logp = jnp.where(t > 0, logp, 0.0)
  else:
    logp = jnp.zeros((width, vocab))
  cost = mechanism_cost[None] - prior_weight * logp
  cost = jnp.where((forced >= 0) & (jnp.arange(vocab) != forced), jnp.inf, cost)
  neg_best, flat = jax.lax.top_k(-(scores[:, None] + cost).reshape(-1), width)
  beam_idx, token = flat // vocab, (flat % vocab).astype(jnp.int32)
  parents = client_cache[beam_idx]
  rows, kv = jax.vmap(lambda cache, tok: split.client_step_kv(params, cfg, cache, tok, t))(
      parents, token)
  write = jax.vmap(split.write_cache, in_axes=(0, 0, None))
  new_server = server_cache[beam_idx]
  if use_prior:
    # The server's cache gains position t - 1 of the surviving beams' parents.
    written = write(server_cache, server_kv, jnp.maximum(t - 1, 0))
    new_server = jnp.where(t > 0, written[beam_idx], new_server)
  new_tokens = tokens[beam_idx].at[:, t].set(token)
  return write(parents, kv, t), new_server, new_tokens, -neg_best, rows


@functools.partial(jax.jit, static_argnames=("cfg", "k", "width"))
def start(target, cfg: GPT2Config, k: int, width: int):
  """The empty state of every document of target [B, T, d]."""
  seq_len, d = target.shape[1], cfg.n_embd

  def one(_):
    client = jnp.zeros((width, k, 2, seq_len, cfg.n_kv_head, cfg.head_dim), jnp.float32)
    server = jnp.zeros((width, cfg.n_layer - k, 2, seq_len, cfg.n_kv_head, cfg.head_dim),
                       jnp.float32)
    tokens = jnp.zeros((width, seq_len), jnp.int32)
    scores = jnp.full((width,), jnp.inf, jnp.float32).at[0].set(0.0)
    return client, server, tokens, scores, jnp.zeros((width, d), jnp.float32)

  return jax.vmap(one)(target[:, 0, 0])


@functools.partial(jax.jit, static_argnames=("cfg", "k", "mechanism", "prior_weight"))
def step(params, state, t, candidates_t, target_t, cfg: GPT2Config, k: int,
         mechanism: Mechanism, prior_weight: float):
  """Position t of every document's likelihood beam (candidates_t [B, C], target_t [B, d])."""
  one = lambda carry, cand, target: _doc_step(params, cfg, k, mechanism, prior_weight, carry, t,
                                              cand, target)
  return jax.vmap(one)(state, candidates_t, target_t)


class LikelihoodBeam:
  """One registered attack per mechanism (see the module docstring)."""

  def __init__(self, mechanism: str):
    self.spec = registry.AttackSpec(
        f"{mechanism}_adaptive", "beam_inversion", ("activations",),
        budget_fields=("beam_width", "ridge_alpha", "likelihood_candidates",
                       "likelihood_prior_weight", "likelihood_rounding"),
        adapts_to=(mechanism,), reference_attack="activation",
        description=f"beam search under the {mechanism} mechanism's likelihood plus the "
        "language prior, candidates from a ridge fitted through the mechanism",
        reference="../shared/notes/adaptive-attacks.md sections 1-3; Balunovic et al. "
        "ICLR'22 (2111.04706); BeamClean (2505.13758)",
        threat_model=f"knows the {mechanism} mechanism and its public parameters, holds the "
        "client layers its knowledge grants, the model's later blocks (language prior) and "
        "public calibration text; never the noise draw",
        capabilities=("the mechanism's exact likelihood", "language prior of the attacker's "
                      "model"),
        checks=(("adaptation", "tests/test_attacks_adaptive.py::test_likelihood_beam_breaks"
                 f"[{mechanism}]", f"recovery on a {mechanism}-defended tiny model"),))
    self.mechanism = mechanism

  def __call__(self, ws: Workspace, budget, key: jax.Array) -> registry.AttackResult:
    mechanism = mechanism_of(ws, budget)
    width, num = int(budget.beam_width), int(budget.likelihood_candidates)
    prior_weight = float(budget.likelihood_prior_weight)
    # The attacker's own randomness for its calibration through the mechanism.
    attacker_seed = int(jax.random.randint(key, (), 0, 2**31 - 1))
    decoder = ws.stage(f"ridge_{ws.defense['name']}",
                       lambda: self._fit(ws, budget, attacker_seed),
                       analytic=adaptive.client_flops(ws, ws.calibration_tokens.size))
    ranked = ws.map_call(cand_lib.decoded_nearest_tokens, (ws.activations,),
                         8.0 * ws.seq_len * ws.cfg.vocab_size,
                         consts=(decoder.weights, decoder.mu_h, decoder.mu_e, ws.wte), num=num)
    # Half from the ridge through the mechanism, the rest from the clean one (which proposes
    # better where the mechanism is mild), without duplicates.
    clean = ws.activation_ranked(num)
    through = (num + 1) // 2
    candidates = np.asarray(ws.call(cand_lib.joint_candidates, ranked, clean, c_a=through,
                                    c_g=num - through)) if num > 1 else ranked

    run = functools.partial(ws.scan, step, (ws.model_params,), cfg=ws.cfg, k=ws.cut,
                            mechanism=mechanism, prior_weight=prior_weight)

    def search(target, cands):
      state = start(target, cfg=ws.cfg, k=ws.cut, width=width)
      return beam.run_after_prefix(run, state, target, cands, ws.known_prefix)[2][:, 0]

    d, cfg = ws.cfg.n_embd, ws.cfg
    per_doc = 4.0 * (width * (3 * cfg.n_layer * 2 * ws.seq_len * d + cfg.vocab_size)
                     + width * num * (2 * ws.cut * d + 8 * d))
    predictions = ws.map_documents(search, (ws.activations, candidates), per_doc)
    analytic = (beam.analytic_flops(cfg, ws.cut, ws.num_docs, width, num, ws.seq_len,
                                    len(ws.known_prefix))
                + cand_lib.candidate_flops(ws.activations.size // d, cfg.vocab_size, d))
    if prior_weight > 0:
      analytic += ws.num_docs * ws.seq_len * width * (
          (cfg.n_layer - ws.cut) * cost.token_block_flops(cfg, ws.seq_len)
          + 2.0 * cfg.vocab_size * d)
    return registry.AttackResult(predictions.astype(np.int32), analytic, {
        "mechanism": dataclasses.asdict(mechanism), "attacker_seed": attacker_seed,
        "candidates_per_position": num})

  def _fit(self, ws: Workspace, budget, attacker_seed: int) -> ridge.RidgeDecoder:
    h_cal = ws.calibration_activations()
    transform = aware.calibration_transform(ws.defense["name"], adaptive.public_params(ws),
                                            attacker_seed)
    return ws.fit_ridge(np.asarray(transform(h_cal), np.float32), ws.wte,
                        float(budget.ridge_alpha))


for _mechanism in MECHANISMS:
  registry.register(LikelihoodBeam(_mechanism))
