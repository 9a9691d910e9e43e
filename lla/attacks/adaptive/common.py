"""Shared pieces of the adaptive attacks (PROTOCOL section 5a).

An adaptive attack knows the defense's mechanism and public parameters (the capture's
`ws.defense`), holds what its knowledge grants (the client layers, public calibration
text) and never a secret. Once it has undone or modelled the mechanism, most of them end
as the undefended attack of PROTOCOL section 4: ridge candidates and the KV-cached beam
search, on messages it reconstructed. These helpers run that last step on any target
array, metered like every compiled call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from lla.attacks.seed import beam
from lla.attacks.seed import beam_attacks
from lla.attacks import candidates as cand_lib
from lla.attacks import registry
from lla.attacks.workspace import Workspace
from lla.model import cost
from lla.model import split


def public_params(ws: Workspace) -> dict:
  """The capture's public defense parameters (what the attacker is told), or {}."""
  return dict((ws.defense or {}).get("params") or {})


def without_shadow(predictions: np.ndarray, flops: float,
                   alpha: float) -> registry.AttackResult:
  """The result of a shadow-client attack (nopeek_adaptive, adversarial_adaptive) under
  public knowledge: the attacker holds the victim's fine-tuned client, the best shadow
  there is, so it trains none and its search through that client is the attack."""
  return registry.AttackResult(predictions, flops, {
      "alpha": alpha, "shadow_steps": 0, "documents_through_shadow": 0,
      "shadow": "not trained: under public knowledge the attacker holds the victim's "
                "client"})


def ridge_candidates(ws: Workspace, targets: np.ndarray, num: int) -> np.ndarray:
  """[B, T, num] nearest tokens to the ridge decoding of targets [B, T, d] (the decoder of
  the attacker's clean calibration activations, stage `ridge`)."""
  decoder = ws.decoder
  return ws.map_call(cand_lib.decoded_nearest_tokens, (np.asarray(targets, np.float32),),
                     8.0 * ws.seq_len * ws.cfg.vocab_size,
                     consts=(decoder.weights, decoder.mu_h, decoder.mu_e, ws.wte), num=num)


def beam_on(ws: Workspace, targets: np.ndarray, candidates: np.ndarray,
            width: int) -> tuple[np.ndarray, np.ndarray]:
  """The activation-matching beam search of PROTOCOL section 4 on targets [B, T, d] instead
  of the observed messages: (predictions [B, T] int32, the best beam's summed squared
  distance to its target [B])."""
  search = lambda h, c: beam.search(ws.model_params, ws.cfg, ws.cut, h, c, width, scan=ws.scan,
                                    prefix=ws.known_prefix)
  predictions, scores = ws.map_documents(
      search, (np.asarray(targets, np.float32), np.asarray(candidates, np.int32)),
      beam_attacks.beam_bytes_per_doc(ws, width, candidates.shape[-1]))
  return predictions.astype(np.int32), np.asarray(scores, np.float64)


def undefended_search(ws: Workspace, targets: np.ndarray, num: int,
                      width: int) -> tuple[np.ndarray, np.ndarray, float]:
  """Ridge candidates then beam search on targets [B, T, d]: (predictions, the best beam's
  summed squared distance [B], analytic FLOPs of the search and the ranking)."""
  candidates = ridge_candidates(ws, targets, num)
  predictions, scores = beam_on(ws, targets, candidates, width)
  n = len(targets)
  flops = (beam.analytic_flops(ws.cfg, ws.cut, n, width, num, ws.seq_len,
                               len(ws.known_prefix))
           + cand_lib.candidate_flops(n * ws.seq_len, ws.cfg.vocab_size, ws.cfg.n_embd))
  return predictions, scores, flops


def undefended_attack(ws: Workspace, targets: np.ndarray, num: int,
                      width: int) -> tuple[np.ndarray, float]:
  """`undefended_search` without the distances: (predictions, analytic FLOPs)."""
  predictions, _, flops = undefended_search(ws, targets, num, width)
  return predictions, flops


@functools.partial(jax.jit, static_argnames=("cfg", "k"))
def client_of_tokens(params, tokens: jax.Array, cfg, k: int) -> jax.Array:
  """`split.client` with the tokens before the static arguments (for `map_call`)."""
  return split.client(params, cfg, tokens, k)


def client_rows(ws: Workspace, tokens: np.ndarray) -> np.ndarray:
  """[B, T, d] the attacker's client on tokens [B, T] (metered): the rows a decoded text
  would have produced."""
  return ws.map_call(client_of_tokens, (np.asarray(tokens, np.int32),),
                     64.0 * tokens.shape[1] * ws.cfg.n_embd, consts=(ws.model_params,), cfg=ws.cfg,
                     k=ws.cut)


def client_flops(ws: Workspace, num_rows: int) -> float:
  """Matmul FLOPs of the client on num_rows token positions (full forward), counted as
  lla.attacks.flops.calibration_activations counts it."""
  width = cost.attention_width(ws.cfg)
  return 2.0 * num_rows * ws.cut * (cost.block_weights(ws.cfg) + ws.seq_len * width)


def attack_through(ws: Workspace, params, num: int, width: int):
  """The undefended attack on the observed messages with another client (`params`, e.g. a
  shadow model): a ridge decoder fitted on that client's calibration activations, its
  candidates, the beam search through it. Returns (predictions [B, T], the best beam's
  summed squared distance [B], analytic FLOPs); everything metered in the current scope."""
  h_cal = np.asarray(ws.call(split.client, params, cfg=ws.cfg,
                             tokens=jnp.asarray(ws.calibration_tokens), k=ws.cut))
  d = ws.cfg.n_embd
  decoder = ws.fit_ridge(h_cal, split.wte(params))
  candidates = ws.map_call(cand_lib.decoded_nearest_tokens, (ws.activations,),
                           8.0 * ws.seq_len * ws.cfg.vocab_size,
                           consts=(decoder.weights, decoder.mu_h, decoder.mu_e,
                                   split.wte(params)), num=num)
  search = lambda h, c: beam.search(params, ws.cfg, ws.cut, h, c, width, scan=ws.scan,
                                    prefix=ws.known_prefix)
  predictions, scores = ws.map_documents(
      search, (ws.activations, candidates.astype(np.int32)),
      beam_attacks.beam_bytes_per_doc(ws, width, num))
  positions = ws.num_docs * ws.seq_len
  flops = (client_flops(ws, ws.calibration_tokens.size)
           + beam.analytic_flops(ws.cfg, ws.cut, ws.num_docs, width, num, ws.seq_len,
                                 len(ws.known_prefix))
           + cand_lib.candidate_flops(positions, ws.cfg.vocab_size, d))
  return predictions.astype(np.int32), scores, flops
