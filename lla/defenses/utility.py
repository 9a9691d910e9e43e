"""Utility cost of a defense: held-out cross-entropy and perplexity, with bootstrap intervals.

Inference applies only forward ("activations", "embeddings") defenses; a "gradients" or "training"
defense costs utility through the weights it was fine-tuned with, so compare its
fine-tuned checkpoint (`params`) with the undefended one (`reference_params`).
A document's CE is the mean over its T - 1 next-token positions of CE(logits[b, t],
x[b, t+1]) against **its own** tokens: for mixup, what the client gets back for its own
document from the mixed message (the mixed-label loss is the training objective, not
what the client wants predicted).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lla.defenses.base import Defense, Secret, SecretKeys
from lla.defenses.training import defended_client, forward_message
from lla.model import split
from lla.model.gpt2 import GPT2Config


@functools.partial(jax.jit, static_argnames=("cfg", "k", "defense"))
def document_cross_entropy(params, cfg: GPT2Config, tokens: jax.Array, k: int,
                           defense: Defense | None, keys: SecretKeys | None) -> jax.Array:
  """Per-document mean next-token CE [B] of the split model, tokens [B, T]."""
  h = defended_client(params, cfg, tokens, k, defense, keys)
  if defense is not None and defense.acts_on == "activations":
    h = forward_message(params, h, defense, keys)
  _, logits = split.server_loss(params, cfg, h, tokens, k)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:])
  return ce.mean(axis=1)


def corpus_cross_entropy(params, cfg: GPT2Config, tokens, k: int, defense: Defense | None,
                         secret: Secret | None, batch_size: int = 32,
                         first_step: int = 0) -> np.ndarray:
  """Per-document CE [N] over tokens [N, T] in batches; batch i uses the secret's keys of
  step first_step + i.

  Mixup mixes within a batch, so every batch needs at least m documents.
  """
  tokens = np.asarray(tokens)
  if defense is not None and defense.acts_on not in ("activations", "embeddings"):
    # It leaves this computation alone: run it as the undefended one, whose executable it
    # then shares (one compilation fewer per such defense and batch shape).
    defense = secret = None
  keyed = defense is not None and defense.has_secret
  out = [document_cross_entropy(
      params, cfg, jnp.asarray(tokens[i:i + batch_size]), k, defense,
      secret.keys(defense.name, first_step + i // batch_size) if keyed else None)
         for i in range(0, len(tokens), batch_size)]
  return np.concatenate([np.asarray(x, np.float64) for x in out])


def _summary(samples: np.ndarray, point: float, level: float) -> dict:
  tail = 100 * (1 - level) / 2
  lo, hi = np.percentile(samples, [tail, 100 - tail])
  return {"value": float(point), "ci": [float(lo), float(hi)]}


def heldout_utility(params, cfg: GPT2Config, tokens, k: int, defense: Defense,
                    secret: Secret | None, *, reference_params=None, batch_size: int = 32,
                    n_boot: int = 10_000, seed: int = 0, level: float = 0.95,
                    first_step: int = 1 << 20, client_tokens=None) -> dict:
  """Held-out CE and perplexity under `defense` against the undefended model.

  Args:
    params: the defended target's weights.
    tokens: [N, T] held-out documents.
    secret: the defender's secret (noise, mixup and projection draws), or None for a
      defense without one.
    first_step: the secret's step of the first held-out batch; far from the steps of
      training and capture, so that utility draws fresh randomness.
    reference_params: the undefended model's weights; None means the same `params` with
      the defense removed (the pure inference-time cost of a forward defense).
    client_tokens: [M, T] the client's own documents, on which a defense with a client
      stage after the server (`Defense.client_cross_entropy`: SnD's denoiser) trains it
      before the held-out documents are scored; such a defense refuses None.
    n_boot, seed, level: percentile bootstrap over documents (numpy PCG64 seeded with
      `seed`); the defended and reference CE are resampled together (paired), so the
      interval of their difference reflects document-level variability only.

  Returns:
    a JSON-ready dict: per-arm mean CE and perplexity (exp of mean CE) with intervals,
    the CE increase in nats and the perplexity ratio with intervals, the bootstrap
    settings and the defense's public record.
  """
  reference_params = params if reference_params is None else reference_params
  defended = defense.client_cross_entropy(params, cfg, tokens, k, secret,
                                          client_tokens=client_tokens, batch_size=batch_size,
                                          first_step=first_step)
  if defended is None:
    defended = corpus_cross_entropy(params, cfg, tokens, k, defense, secret, batch_size,
                                    first_step)
  reference = corpus_cross_entropy(reference_params, cfg, tokens, k, None, None, batch_size)
  n_docs = len(defended)
  resample = np.random.Generator(np.random.PCG64(seed)).integers(0, n_docs, (n_boot, n_docs))
  boot_defended = defended[resample].mean(axis=1)
  boot_reference = reference[resample].mean(axis=1)

  def arm(ce, boot):
    return {"cross_entropy": _summary(boot, ce.mean(), level),
            "perplexity": _summary(np.exp(boot), np.exp(ce.mean()), level)}

  delta = defended.mean() - reference.mean()
  return {
      "n_documents": n_docs,
      "defense": defense.to_record(secret),
      "defended": arm(defended, boot_defended),
      "undefended": arm(reference, boot_reference),
      "cross_entropy_increase": _summary(boot_defended - boot_reference, delta, level),
      "perplexity_ratio": _summary(np.exp(boot_defended - boot_reference), np.exp(delta), level),
      "bootstrap": {"n_boot": n_boot, "seed": seed, "level": level, "unit": "document",
                    "paired": True},
  }
