"""Adaptive attack on token sanitisation (`santext`, `custext`): recover, then refill.

Threat model: the client replaces each token x_t by y_t ~ P(. | x_t), the exponential
mechanism of SanText or CusText over distances in the input table (lla.defenses.sanitise),
and runs its k blocks on y; the server observes h = client(y). The attacker knows the
mechanism, epsilon (and K), holds the client layers its knowledge grants (its copy's input
table defines its kernel: the public pre-trained one) and the model's later blocks (its
language prior); never the sampling draw.

Two stages (adaptive-attacks.md: recover y exactly, then decode x from y under the kernel
and a language prior):

1. y-hat from h by the undefended attack of PROTOCOL section 4 (ridge candidates, the
   activation-matching beam): h is the client's exact output on the tokens y, so this is an
   undefended inversion.
2. Refill: a beam of `beam_width` over positions maximising

     sum_t [ prior_weight * log P_LM(x_t | x_<t) + log P_mech(y-hat_t | x_t) ]

   over the whole vocabulary at every position, P_LM the attacker's whole model on each
   beam's prefix (KV caches as `likelihood_beam`), and the mechanism's exact kernel:
     * santext: log P(y | x) = -epsilon d(x, y) / 2 - log Z(x), Z(x) = sum_v exp(-epsilon
       d(x, v) / 2) for every x (one O(V^2 d) pass, stage `kernel_santext`);
     * custext: log P(y | x) = the log-softmax of epsilon u(x, .) / 2 at y where y is among
       x's K nearest, -inf otherwise (every token's set and log-probabilities, stage
       `kernel_custext`).
   prior_weight = 1 is the Bayes posterior (Balunovic et al., ICLR 2022); 0 is the kernel's
   maximum likelihood alone.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from lla.attacks import registry
from lla.attacks.adaptive import common as adaptive
from lla.attacks.adaptive import likelihood_beam
from lla.attacks.workspace import Workspace, run_steps
from lla.defenses import sanitise
from lla.model import cost
from lla.model.gpt2 import GPT2Config

ADAPTS_TO = ("santext", "custext")


def mechanism_loglik(name: str, table: jax.Array, kernel, y: jax.Array,
                     epsilon: float) -> jax.Array:
  """log P_mech(y | x) [V] for every original x of one observed token y: `kernel` is
  santext's log Z [V] or custext's (S [V, K], log P [V, K])."""
  if name == "santext":
    sq = jnp.sum(table * table, -1)
    # d is symmetric: the distances from y are those to y.
    return sanitise.santext_logits(table, sq, y, epsilon) - kernel
  support, log_p = kernel
  return jnp.max(jnp.where(support == y, log_p, -jnp.inf), axis=-1)


def _doc_step(params, table, kernel, cfg, k, name, epsilon, prior_weight, carry, t, y_t,
              forced):
  """Position t of one document's refill beam (carry: `likelihood_beam.start`'s); y_t the
  recovered sanitised token, forced the public token at t or -1. The mechanism's cost of
  token x is -log P_mech(y_t | x)."""
  return likelihood_beam.vocabulary_step(
      params, cfg, k, prior_weight, carry, t,
      -mechanism_loglik(name, table, kernel, y_t, epsilon), forced)


@functools.partial(jax.jit, static_argnames=("cfg", "k", "name", "epsilon", "prior_weight"))
def step(params, table, kernel, state, t, y_t, forced_t, cfg: GPT2Config, k: int, name: str,
         epsilon: float, prior_weight: float):
  """Position t of every document's refill beam: y_t [B], forced_t [B] (-1: free)."""
  one = lambda carry, y, forced: _doc_step(params, table, kernel, cfg, k, name, epsilon,
                                           prior_weight, carry, t, y, forced)
  return jax.vmap(one)(state, y_t, forced_t)


def refill(params, cfg: GPT2Config, k: int, y: np.ndarray, table: jax.Array, kernel,
           name: str, epsilon: float, prior_weight: float, width: int,
           prefix: tuple[int, ...] = (), scan=None) -> jax.Array:
  """argmax_x sum_t [prior_weight log P_LM(x_t | x_<t) + log P_mech(y_t | x_t)] by a beam of
  `width`: y [B, T] sanitised tokens -> x [B, T] (the best beam), the first len(prefix)
  positions held at the public prefix. `scan`: `Workspace.scan` (metered) or None."""
  scan = scan or run_steps
  batch, seq_len = y.shape
  forced = np.full((batch, seq_len), -1, np.int32)
  forced[:, :len(prefix)] = np.asarray(prefix, np.int32)
  xs = (jnp.arange(seq_len, dtype=jnp.int32), jnp.swapaxes(jnp.asarray(y, jnp.int32), 0, 1),
        jnp.swapaxes(jnp.asarray(forced), 0, 1))
  state = likelihood_beam.start(jnp.zeros((batch, seq_len, cfg.n_embd), jnp.float32), cfg=cfg,
                                k=k, width=width)
  state = scan(step, (params, jnp.asarray(table, jnp.float32), kernel), state, xs, cfg=cfg,
               k=k, name=name, epsilon=float(epsilon), prior_weight=float(prior_weight))
  return state[2][:, 0]


def kernel_of(name: str, table: jax.Array, epsilon: float, top_k: int, call=None):
  """santext: log Z [V]; custext: (S [V, K], log P [V, K]). `call`: `Workspace.call`."""
  call = call or (lambda f, *a, **kw: f(*a, **kw))
  if name == "santext":
    return call(sanitise.santext_log_partition, table, epsilon=epsilon)
  return tuple(call(sanitise.custext_kernel, table, epsilon=epsilon, top_k=top_k))


def refill_flops(cfg: GPT2Config, k: int, num_docs: int, seq_len: int, width: int,
                 prior: bool, name: str, top_k: int) -> float:
  """Matmul FLOPs of the refill beam: per position and beam the client's one-token step
  (k blocks) and, with the prior, the later blocks' step and the head (2 V d); per position
  the kernel's row (santext: the distances, 2 V d; custext: V K comparisons)."""
  per_token = cost.token_block_flops(cfg, seq_len)
  per_beam = k * per_token
  if prior:
    per_beam += (cfg.n_layer - k) * per_token + 2.0 * cfg.vocab_size * cfg.n_embd
  row = 2.0 * cfg.vocab_size * (cfg.n_embd if name == "santext" else top_k)
  return float(num_docs) * seq_len * (width * per_beam + row)


class SanitiseAdaptive:
  """Recover the sanitised tokens from h, then refill the original (module docstring)."""

  spec = registry.AttackSpec(
      "sanitise_adaptive", "beam_inversion", ("activations",),
      budget_fields=("beam_width", "candidates", "ridge_alpha", "likelihood_prior_weight"),
      adapts_to=ADAPTS_TO, reference_attack="activation",
      description="sanitised tokens recovered from h by the undefended beam, then a beam over "
      "the original text under the SanText / CusText kernel plus the language prior",
      reference="../shared/notes/adaptive-attacks.md (token replacement); Yue et al. ACL "
      "Findings'21 (SanText); Chen et al. ACL Findings'23 (CusText); Balunovic et al. ICLR'22",
      threat_model="knows the mechanism, epsilon and K, holds the client layers its knowledge "
      "grants (its copy's input table defines the kernel) and the model's later blocks "
      "(language prior); never the sampling draw",
      capabilities=("the exact SanText / CusText kernel", "language prior of the attacker's "
                    "model"),
      checks=(("adaptation", "tests/test_sanitise_adaptive.py::test_refill_beats_the_plain_"
               "search_where_the_prior_knows_the_text", "recovery on a santext-defended "
               "capture of a model with a known language"),
              ("reference_consistency", "tests/test_sanitise_adaptive.py::test_refill_is_the_"
               "exhaustive_argmax", "argmax over every sequence by numpy")))

  def __call__(self, ws: Workspace, budget, key: jax.Array) -> registry.AttackResult:
    del key  # deterministic
    params, name = adaptive.public_params(ws), ws.defense["name"]
    if params.get("epsilon") is None:
      raise ValueError("sanitise_adaptive needs the capture's public epsilon (the defense is "
                       "off: run the undefended attacks)")
    epsilon, top_k = float(params["epsilon"]), int(params.get("top_k") or 0)
    width, prior_weight = int(budget.beam_width), float(budget.likelihood_prior_weight)
    y, analytic = adaptive.undefended_attack(ws, ws.activations, int(budget.candidates), width)
    table = jnp.asarray(ws.wte, jnp.float32)
    vocab, d = table.shape
    kernel = ws.stage(f"kernel_{name}", lambda: kernel_of(name, table, epsilon, top_k, ws.call),
                      analytic=2.0 * vocab * vocab * d)
    search = lambda y_chunk: refill(ws.params, ws.cfg, ws.cut, y_chunk, table, kernel, name,
                                    epsilon, prior_weight, width, ws.known_prefix, ws.scan)
    state_bytes = 4.0 * width * ws.cfg.n_layer * 2 * ws.seq_len * d
    predictions = ws.map_documents(search, (y,), state_bytes + 12.0 * vocab * width)
    analytic += refill_flops(ws.cfg, ws.cut, ws.num_docs, ws.seq_len, width,
                             prior_weight > 0, name, top_k)
    return registry.AttackResult(np.asarray(predictions, np.int32), analytic, {
        "mechanism": name, "epsilon": epsilon, "top_k": top_k, "prior_weight": prior_weight,
        "refill_changed": float(np.mean(np.asarray(predictions) != y))})


registry.register(SanitiseAdaptive())
