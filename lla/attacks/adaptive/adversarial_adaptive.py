"""`adversarial_adaptive`: a fresh inverter of another architecture against adversarial
training (PROTOCOL section 5a).

Threat model: the victim's client was fine-tuned against a jointly trained regression MLP
inverter (lla.defenses.adversarial) at a public alpha; the attacker knows the mechanism and
alpha, holds the client layers its knowledge grants and public calibration text, never the
victim's inverter, data or randomness. A client tuned to defeat one inverter need not defeat
another (adaptive-attacks.md, learned bottlenecks and adversarial training), so the attack
trains its own after the client is fixed:
  * clients: its own (under public knowledge the victim's fine-tuned one) and a shadow
    fine-tuned by the attacker from its weights on its calibration text with the victim's
    objective at the same alpha (`adversarial_shadow_steps` AdamW steps, every parameter,
    its own inverter initialised from its attack key): the shadow for trained knowledge,
    as nopeek_adaptive's, and none under public knowledge (revision 2), where the
    attacker's client is the victim's, the best shadow there is;
  * through each, a fresh inverter of another architecture: a per-position classifier
    (one GELU hidden layer of `adversarial_inverter_hidden`, softmax over the vocabulary,
    cross-entropy on the tokens instead of regression onto embeddings), trained with Adam
    for `adversarial_inverter_steps` full-batch steps on the client's calibration rows;
  * its top tokens per position and the ridge decoder's (PROTOCOL section 4) of that client,
    alternately, `candidates` distinct ones, verified by the beam search through it; per document the search whose best beam explains the
    messages better.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lla.attacks.adaptive import common as adaptive
from lla.attacks import budget as budget_lib
from lla.attacks import candidates as cand_lib
from lla.attacks import registry
from lla.attacks.seed import beam
from lla.attacks.seed import beam_attacks
from lla.attacks.workspace import Workspace
from lla.defenses import adversarial
from lla.model import cost
from lla.model import split

budget_lib.declare("adversarial_shadow_steps", 32, int, low=0,
                   doc="adversarial_adaptive: AdamW steps of the shadow adversarial fine-tune",
                   source="lla (the victim's fine-tune length, configs/finetune.py)")
budget_lib.declare("adversarial_shadow_lr", 3e-4, float, low=0.0, strict_low=True,
                   doc="adversarial_adaptive: the shadow fine-tune's learning rate",
                   source="configs/finetune.py (the victim's)")
budget_lib.declare("adversarial_inverter_steps", 200, int, low=1,
                   doc="adversarial_adaptive: Adam steps of the fresh classifier inverter",
                   source="lla")
budget_lib.declare("adversarial_inverter_hidden", 256, int, low=1,
                   doc="adversarial_adaptive: the classifier inverter's hidden width",
                   source="lla (SIP's GRU width)")

_INVERTER_LR = 3e-3


def _shadow_loss(params, cfg, tokens, k: int, alpha: float):
  h = split.client(params, cfg, tokens, k)
  e = jax.lax.stop_gradient(split.input_table(params)[tokens])
  inverter = adversarial.inverter_loss(params[adversarial.PARAMS_KEY],
                                       adversarial.reverse_gradient(h, alpha), e)
  return split.server_loss(params, cfg, h, tokens, k)[0] + inverter


@functools.partial(jax.jit, static_argnames=("cfg", "k", "alpha", "lr"))
def shadow_step(params, opt_state, tokens, cfg, k: int, alpha: float, lr: float):
  """One AdamW step of the victim's objective (lla.defenses.adversarial) on tokens [N, T]."""
  loss, grads = jax.value_and_grad(_shadow_loss)(params, cfg, tokens, k, alpha)
  updates, opt_state = optax.adamw(lr).update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def _logits(weights, h):
  x = jax.nn.gelu(h.astype(jnp.float32) @ weights["in"]["kernel"] + weights["in"]["bias"])
  return x @ weights["out"]["kernel"] + weights["out"]["bias"]


@functools.partial(jax.jit, static_argnames=("steps",))
def train_classifier(weights, h, tokens, steps: int):
  """`steps` full-batch Adam steps of the classifier on rows h [N, T, d] -> tokens [N, T]."""
  tx = optax.adam(_INVERTER_LR)
  loss_of = lambda w: optax.softmax_cross_entropy_with_integer_labels(
      _logits(w, h), tokens).mean()

  def body(carry, _):
    w, state = carry
    loss, grads = jax.value_and_grad(loss_of)(w)
    updates, state = tx.update(grads, state, w)
    return (optax.apply_updates(w, updates), state), loss

  (weights, _), losses = jax.lax.scan(body, (weights, tx.init(weights)), None, length=steps)
  return weights, losses


@functools.partial(jax.jit, static_argnames=("num",))
def top_tokens(weights, h, num: int):
  """[B, T, num] the classifier's most probable tokens for h [B, T, d], best first."""
  return jax.lax.top_k(_logits(weights, h), num)[1].astype(jnp.int32)


def merge_candidates(first: np.ndarray, second: np.ndarray, num: int) -> np.ndarray:
  """[B, T, num]: per position the distinct tokens of `first` and `second` ([B, T, C] each)
  taken alternately, best first, the first `num` of them."""
  both = np.stack([first, second], axis=-1).reshape(-1, first.shape[-1] * 2)
  out = np.empty((both.shape[0], num), np.int32)
  for i, row in enumerate(both):
    _, index = np.unique(row, return_index=True)
    out[i] = row[np.sort(index)][:num]
  return out.reshape(*first.shape[:-1], num)


class AdversarialAdaptive:
  """The registered attack (see the module docstring)."""

  spec = registry.AttackSpec(
      "adversarial_adaptive", "beam_inversion", ("activations",),
      budget_fields=("candidates", "beam_width", "ridge_alpha", "adversarial_shadow_steps",
                     "adversarial_shadow_lr", "adversarial_inverter_steps",
                     "adversarial_inverter_hidden"),
      adapts_to=("adversarial",), reference_attack="activation", revision=2,
      description="a fresh per-position classifier inverter (not the victim's regression "
      "MLP) trained after the client is fixed, through the attacker's client and a shadow "
      "adversarial fine-tune at the declared alpha; its candidates verified by beam search",
      reference="../shared/notes/adaptive-attacks.md (learned bottlenecks and adversarial "
      "training); VFLAIR-LLM AdversarialTraining; BiSR shadow pattern",
      threat_model="knows the adversarial defense's alpha; holds the client layers its "
      "knowledge grants and public calibration text; never the victim's inverter, data or "
      "randomness",
      capabilities=("the victim's client itself (public knowledge)",
                    "shadow fine-tune from pre-trained weights (trained knowledge): "
                    "unqualified"),
      checks=(("adaptation",
               "tests/test_defenses_adversarial.py::test_adversarial_adaptive",
               "a fresh classifier recovers what the victim's own trained inverter does not, "
               "above the activation attack on the same capture"),))

  def __call__(self, ws: Workspace, budget, key: jax.Array) -> registry.AttackResult:
    public = adaptive.public_params(ws)
    alpha = float(public.get("alpha", 0.0))
    victim_hidden = int(public.get("hidden", adversarial.Adversarial.hidden))
    hidden = int(budget.adversarial_inverter_hidden)
    steps = int(budget.adversarial_shadow_steps)
    num, width = int(budget.candidates), int(budget.beam_width)
    shadow_key, own_key, shade_key = jax.random.split(key, 3)
    own, own_score = self._through(ws, ws.params, own_key, hidden, num, width, budget)
    if ws.knowledge == "public":
      return adaptive.without_shadow(
          own, self._flops(ws, 0, hidden, num, width, budget, shadow=False), alpha)
    shadow, _ = ws.stage(f"adversarial_shadow_{alpha:g}_{steps}",
                         lambda: self._fine_tune(ws, alpha, victim_hidden, steps,
                                                 float(budget.adversarial_shadow_lr),
                                                 shadow_key))
    shade, shade_score = self._through(ws, shadow, shade_key, hidden, num, width, budget)
    use_shadow = shade_score < own_score
    predictions = np.where(use_shadow[:, None], shade, own)
    return registry.AttackResult(predictions, self._flops(ws, steps, hidden, num, width,
                                                          budget), {
        "alpha": alpha, "shadow_steps": steps,
        "documents_through_shadow": int(use_shadow.sum())})

  def _fine_tune(self, ws: Workspace, alpha: float, hidden: int, steps: int, lr: float,
                 key):
    params = {**ws.params,
              adversarial.PARAMS_KEY: adversarial.init_weights(key, ws.cfg.n_embd, hidden)}
    opt_state = optax.adamw(lr).init(params)
    tokens = jnp.asarray(ws.calibration_tokens)
    losses = []
    for i in range(steps):
      params, opt_state, loss = ws.call(shadow_step, params, opt_state, tokens, cfg=ws.cfg,
                                        k=ws.cut, alpha=alpha, lr=lr)
      if not np.isfinite(float(loss)):
        raise FloatingPointError(f"adversarial_adaptive: shadow loss {float(loss)} at step {i}")
      losses.append(float(loss))
    return {n: v for n, v in params.items() if n != adversarial.PARAMS_KEY}, losses

  def _through(self, ws: Workspace, params, key, hidden: int, num: int, width: int, budget):
    """(predictions [B, T], best-beam cost [B]) of the fresh classifier through `params`."""
    d, vocab = ws.cfg.n_embd, ws.cfg.vocab_size
    h_cal = ws.call(split.client, params, cfg=ws.cfg,
                    tokens=jnp.asarray(ws.calibration_tokens), k=ws.cut)
    k1, k2 = jax.random.split(key)
    weights = {"in": {"kernel": jax.random.normal(k1, (d, hidden)) / np.sqrt(d),
                      "bias": jnp.zeros((hidden,))},
               "out": {"kernel": jax.random.normal(k2, (hidden, vocab)) / np.sqrt(hidden),
                       "bias": jnp.zeros((vocab,))}}
    weights, _ = ws.call(train_classifier, weights, h_cal,
                         jnp.asarray(ws.calibration_tokens),
                         steps=int(budget.adversarial_inverter_steps))
    learned = ws.map_call(top_tokens, (ws.activations,), 4.0 * ws.seq_len * vocab,
                          consts=(weights,), num=num)
    # The classifier's candidates and the ridge decoder's of the same client (the
    # undefended attack's) alternately, `num` distinct tokens per position.
    decoder = ws.fit_ridge(np.asarray(h_cal), split.wte(params))
    linear = ws.map_call(cand_lib.decoded_nearest_tokens, (ws.activations,),
                         8.0 * ws.seq_len * vocab,
                         consts=(decoder.weights, decoder.mu_h, decoder.mu_e, split.wte(params)),
                         num=num)
    candidates = merge_candidates(np.asarray(learned), np.asarray(linear), num)
    search = lambda h, c: beam.search(params, ws.cfg, ws.cut, h, c, width, scan=ws.scan,
                                      prefix=ws.known_prefix)
    predictions, scores = ws.map_documents(
        search, (ws.activations, np.asarray(candidates, np.int32)),
        beam_attacks.beam_bytes_per_doc(ws, width, num))
    return np.asarray(predictions, np.int32), np.asarray(scores, np.float64)

  def _flops(self, ws: Workspace, steps: int, hidden: int, num: int, width: int, budget,
             shadow: bool = True):
    """Analytic FLOPs: the shadow's `steps` training steps, and per client (the own, and
    the shadow where there is one) its calibration rows, the classifier and the search."""
    cfg, rows = ws.cfg, ws.calibration_tokens.size
    forward = 2.0 * rows * (cfg.n_layer * cost.block_weights(cfg) + cfg.vocab_size * cfg.n_embd)
    classifier = 6.0 * rows * hidden * (cfg.n_embd + cfg.vocab_size)
    search = beam.analytic_flops(cfg, ws.cut, ws.num_docs, width, num, ws.seq_len,
                                 len(ws.known_prefix))
    return (steps * 3.0 * forward
            + (2 if shadow else 1) * (adaptive.client_flops(ws, rows)
                   + int(budget.adversarial_inverter_steps) * classifier + search))


registry.register(AdversarialAdaptive())
