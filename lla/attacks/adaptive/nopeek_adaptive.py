"""`nopeek_adaptive`: inversion through a shadow NoPeek client (PROTOCOL section 5a).

Threat model: the victim's client was fine-tuned with the NoPeek penalty alpha * dCor(wte[x],
h) at a public alpha; the attacker knows alpha and holds what its knowledge grants. Under
`trained` knowledge it has the pre-trained weights only, so it fine-tunes a shadow NoPeek
model itself (BiSR's "shadow NoPeek", adaptive-attacks.md section 8): from its weights, on its
public calibration text, the language-modelling loss plus the same penalty at the same
alpha, AdamW, `nopeek_shadow_steps` steps, every parameter trainable (as the victim's
fine-tune). Then the attack of PROTOCOL section 4 twice, through its own client and through
the shadow (a ridge decoder fitted on that client's calibration activations proposes
candidates, the beam search verifies them through it), and per document the search whose
best beam explains the messages better. Under `public` knowledge the attacker's own client
is the victim's fine-tuned one, the best shadow there is: no shadow is trained and the
attack is the search through it (revision 2; revision 1 also trained the shadow there,
and at 847003a's `cpu` job it explained none of the 144 documents better, at 25 s a
capture). NoPeek has no secret: the attacker lacks only the victim's training data and
randomness.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lla.attacks.adaptive import common as adaptive
from lla.attacks import budget as budget_lib
from lla.attacks import registry
from lla.attacks.workspace import Workspace
from lla.defenses.nopeek import distance_correlation
from lla.model import cost
from lla.model import split
from lla.model.gpt2 import GPT2Config

budget_lib.declare("nopeek_shadow_steps", 32, int, low=0,
                   doc="nopeek_adaptive: AdamW steps of the shadow NoPeek fine-tune (trained "
                   "knowledge)", source="lla (BiSR: 560 LoRA steps at gpt2-large)")
budget_lib.declare("nopeek_shadow_lr", 3e-4, float, low=0.0, strict_low=True,
                   doc="nopeek_adaptive: the shadow fine-tune's learning rate",
                   source="configs/finetune.py (the victim's)")

_OPTIMIZER = optax.adamw


def _shadow_loss(params, cfg: GPT2Config, tokens, k: int, alpha: float):
  h = split.client(params, cfg, tokens, k)
  e = jax.lax.stop_gradient(split.wte(params)[tokens])
  penalty = distance_correlation(e.reshape(-1, e.shape[-1]), h.reshape(-1, h.shape[-1]))
  return split.lm_loss(params, cfg, tokens) + alpha * penalty


@functools.partial(jax.jit, static_argnames=("cfg", "k", "alpha", "lr"))
def shadow_step(params, opt_state, tokens, cfg: GPT2Config, k: int, alpha: float, lr: float):
  """One AdamW step of the shadow NoPeek objective on tokens [N, T]."""
  loss, grads = jax.value_and_grad(_shadow_loss)(params, cfg, tokens, k, alpha)
  updates, opt_state = _OPTIMIZER(lr).update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


class NoPeekAdaptive:
  """The registered attack (see the module docstring)."""

  spec = registry.AttackSpec(
      "nopeek_adaptive", "beam_inversion", ("activations",),
      budget_fields=("candidates", "beam_width", "ridge_alpha", "nopeek_shadow_steps",
                     "nopeek_shadow_lr"),
      adapts_to=("nopeek",), reference_attack="activation", revision=2,
      description="shadow NoPeek client fine-tuned at the declared alpha (trained knowledge), "
      "ridge on its calibration activations, beam search through it",
      reference="../shared/notes/adaptive-attacks.md section 8; BiSR (Chen et al. CCS'24, "
      "arXiv 2409.00960) pre_no_peek",
      threat_model="knows NoPeek's alpha; holds the pre-trained weights (trained knowledge: "
      "fine-tunes its own shadow on public calibration text) or the victim's fine-tuned "
      "client (public knowledge); never the victim's training data or randomness",
      capabilities=("the victim's client itself (public knowledge)",
                    "shadow fine-tune from pre-trained weights (trained knowledge): did not "
                    "reproduce the victim's drift on a random tiny model; unqualified"),
      checks=(("adaptation", "tests/test_attacks_adaptive.py::test_nopeek_adaptive",
               "the shadow after its fine-tune equals a hand-written AdamW loop on the "
               "NoPeek objective; each document's choice between the shadow and the "
               "activation search is the lower cost, recomputed in numpy; under public "
               "knowledge the predictions are the activation attack's"),))

  def __call__(self, ws: Workspace, budget, key: jax.Array) -> registry.AttackResult:
    del key  # deterministic
    alpha = float(adaptive.public_params(ws).get("alpha", 0.0))
    steps = int(budget.nopeek_shadow_steps)
    num, width = int(budget.candidates), int(budget.beam_width)
    own, own_score, own_flops = adaptive.attack_through(ws, ws.params, num, width)
    if ws.knowledge == "public":
      return adaptive.without_shadow(own, own_flops, alpha)
    shadow, losses = ws.stage(
        f"nopeek_shadow_{alpha:g}_{steps}",
        lambda: self._fine_tune(ws, alpha, steps, float(budget.nopeek_shadow_lr)),
        analytic=self._train_flops(ws, steps))
    # The attacker's own client and the shadow: per document, the one whose search
    # explains the messages better.
    shade, shade_score, shade_flops = adaptive.attack_through(ws, shadow, num, width)
    use_shadow = shade_score < own_score
    predictions = np.where(use_shadow[:, None], shade, own)
    return registry.AttackResult(predictions, own_flops + shade_flops, {
        "alpha": alpha, "shadow_steps": steps, "documents_through_shadow": int(use_shadow.sum()),
        "shadow_loss_first_last": [losses[0], losses[-1]] if losses else []})

  def _fine_tune(self, ws: Workspace, alpha: float, steps: int, lr: float):
    params = ws.params
    opt_state = _OPTIMIZER(lr).init(params)
    tokens = jnp.asarray(ws.calibration_tokens)
    losses = []
    for _ in range(steps):
      params, opt_state, loss = ws.call(shadow_step, params, opt_state, tokens, cfg=ws.cfg,
                                        k=ws.cut, alpha=alpha, lr=lr)
      if not np.isfinite(float(loss)):
        raise FloatingPointError(f"nopeek_adaptive: shadow loss {float(loss)} at step "
                                 f"{len(losses)}")
      losses.append(float(loss))
    return params, losses

  def _train_flops(self, ws: Workspace, steps: int) -> float:
    d, cfg = ws.cfg.n_embd, ws.cfg
    tokens = ws.calibration_tokens.size
    # The whole model's forward (every block as flops.calibration_activations counts one,
    # then the head); training is three times that.
    block = cost.block_weights(cfg) + ws.seq_len * cost.attention_width(cfg)
    forward = 2.0 * tokens * (cfg.n_layer * block + cfg.vocab_size * d)
    return steps * 3.0 * forward


registry.register(NoPeekAdaptive())
