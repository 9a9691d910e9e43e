"""Attacks on a decoy-row capture, the leak injection that calibrates them, and the gate.

Structural attack: a row is real iff its returned-gradient row is not all zero.

Norm attack: the R rows of each frame with the largest returned-gradient norm are real (R,
the real rows per frame, is public). It adapts the structural attack to the mitigation:
clipping every row to C_g and adding the same noise to all of them leaves a real row's
clipped gradient inside its norm, so real rows stay longer on average than decoy rows,
whose gradient is noise alone. Without the mitigation it equals the structural attack.

Content attack: a known-plaintext probe. The attacker holds labelled rows (token of each
real row) for half of the frames, trains a classifier (linear or a small MLP, JAX +
optax), and predicts the tokens of the real rows of the other half. Every arm uses the
oracle real partition (the strongest position: without mitigation the structural attack
recovers it exactly anyway). Arms are (features, classifier) pairs; features are
  gradient: the returned-gradient rows;
  forward:  the forward rows;
  joined:   [forward, gradient * median||forward|| / median||gradient||].
The baseline predicts the training half's most frequent token. Each arm is reported as a
paired per-frame advantage over the baseline with a frame-cluster bootstrap interval, and
judged by the gate G = max_arm 100 (U_arm - p_baseline) with U the one-sided Wilson bound
at alpha / n_arms (Bonferroni over every (features, classifier) pair).

Shapes: S frames, M rows per frame, R real rows per frame, D wire width, F features.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from scipy import stats

from lla.scoring.metrics import wilson_upper

FEATURES = ("gradient", "forward", "joined")


def structural(gradient: np.ndarray, real_mask: np.ndarray) -> dict:
  """The structural attack's scores (`row_mask_scores`) on [S, M, D] returned gradients."""
  return row_mask_scores(structural_prediction(gradient), real_mask)


def row_mask_scores(pred: np.ndarray, real_mask: np.ndarray) -> dict:
  """A [S, M] real-row prediction against the truth [S, M]: frames_exact (count), frames,
  row_agreement, base_rate (R / M)."""
  pred, truth = pred.astype(bool), real_mask.astype(bool)
  return {"frames_exact": int(np.all(pred == truth, axis=1).sum()), "frames": int(len(pred)),
          "row_agreement": float(np.mean(pred == truth)), "base_rate": float(truth.mean())}


def structural_prediction(gradient: np.ndarray) -> np.ndarray:
  """[S, M] int32: 1 where the returned-gradient row [S, M, D] is not all zero (real)."""
  return np.any(gradient != 0, axis=-1).astype(np.int32)


def top_rows(scores: np.ndarray, n_real: int) -> np.ndarray:
  """[S, M] bool: the n_real highest-scoring rows of each frame (ties: lower row index)."""
  order = np.argsort(-scores, axis=1, kind="stable")[:, :n_real]
  pred = np.zeros(scores.shape, bool)
  np.put_along_axis(pred, order, True, axis=1)
  return pred


def norm_prediction(gradient: np.ndarray, n_real: int) -> np.ndarray:
  """[S, M] int32: 1 on the n_real rows of largest returned-gradient norm ([S, M, D])."""
  norms = np.linalg.norm(gradient.astype(np.float64), axis=-1)
  return top_rows(norms, n_real).astype(np.int32)


def real_rows(messages: dict, truth: dict, label: str):
  """Oracle real partition in wire order: (forward [S, R, D], gradient [S, R, D], labels [S, R])."""
  mask = truth["real_mask"].astype(bool)
  s, r = mask.shape[0], int(mask[0].sum())
  take = lambda a: a[mask].reshape((s, r) + a.shape[2:])
  return take(messages["forward"]), take(messages["gradient"]), take(truth[f"{label}_tokens"])


def inject(rows: np.ndarray, labels: np.ndarray, rho: float, amp: float, seed: int) -> np.ndarray:
  """Leak injection: a fraction rho of rows gets token t's codeword c_t at power amp^2.

  x' = ||x|| normalise(sqrt(1 - amp^2) x / ||x|| + amp c_t), c_t uniform on the sphere;
  the row norm is kept, so norm-based statistics (and the joined arm's rescaling) are
  unchanged and only the direction carries the injected signal.

  Args:
    rows: [S, R, D] real rows; labels: [S, R] tokens; rho: fraction of rows (an exact
      count, chosen uniformly); amp: a in [0, 1]; seed: codebook and row choice.
  """
  rng = np.random.default_rng(seed)
  flat, lab = rows.reshape(-1, rows.shape[-1]).astype(np.float64), labels.reshape(-1)
  code = rng.standard_normal((int(lab.max()) + 1, flat.shape[1]))
  code /= np.linalg.norm(code, axis=1, keepdims=True)
  chosen = rng.choice(len(flat), size=int(round(rho * len(flat))), replace=False)
  x = flat[chosen]
  norm = np.linalg.norm(x, axis=1, keepdims=True)
  unit = x / np.where(norm > 0, norm, 1.0)
  mixed = np.sqrt(1.0 - amp**2) * unit + amp * code[lab[chosen]]
  out = flat.copy()
  out[chosen] = norm * mixed / np.linalg.norm(mixed, axis=1, keepdims=True)
  return out.reshape(rows.shape).astype(np.float32)


def arm_features(forward: np.ndarray, gradient: np.ndarray, train: np.ndarray) -> dict:
  """The three feature sets, each scaled so its median training row norm is 1.

  Args:
    forward, gradient: [S, R, D]; train: frame indices of the training half (the scales
      are estimated there only, as an attacker would).

  Returns:
    {name: [S, R, F]}.
  """
  med = lambda a: float(np.median(np.linalg.norm(a[train], axis=-1))) or 1.0
  joined = np.concatenate([forward, gradient * (med(forward) / med(gradient))], axis=-1)
  return {name: (a / med(a)).astype(np.float32)
          for name, a in (("gradient", gradient), ("forward", forward), ("joined", joined))}


def _logits(kind: str, params: dict, x: jax.Array) -> jax.Array:
  if kind == "linear":
    return x @ params["w"] + params["b"]
  return jax.nn.gelu(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]


def _init(kind: str, key: jax.Array, n_in: int, n_out: int, hidden: int) -> dict:
  if kind == "linear":
    return {"w": jnp.zeros((n_in, n_out)), "b": jnp.zeros(n_out)}
  k1, k2 = jax.random.split(key)
  return {"w1": jax.random.normal(k1, (n_in, hidden)) / np.sqrt(n_in), "b1": jnp.zeros(hidden),
          "w2": jax.random.normal(k2, (hidden, n_out)) / np.sqrt(hidden), "b2": jnp.zeros(n_out)}


@functools.partial(jax.jit, static_argnames=("kind", "n_out", "hidden", "steps", "batch"))
def _fit(kind, x, y, key, lr, weight_decay, *, n_out, hidden, steps, batch):
  """AdamW (cosine decay) on softmax CE: x [N, F], y [N] in [0, n_out) -> params.

  A fixed number of steps on random minibatches rather than epochs, so that a small
  training half is not under-fitted: an under-trained probe would make the gate blind.
  """
  k_init, k_steps = jax.random.split(key)
  params = _init(kind, k_init, x.shape[1], n_out, hidden)
  tx = optax.adamw(optax.cosine_decay_schedule(lr, steps), weight_decay=weight_decay)

  def minibatch(carry, k):
    params, opt = carry
    idx = jax.random.randint(k, (batch,), 0, x.shape[0])
    loss = lambda p: optax.softmax_cross_entropy_with_integer_labels(
        _logits(kind, p, x[idx]), y[idx]).mean()
    upd, opt = tx.update(jax.grad(loss)(params), opt, params)
    return (optax.apply_updates(params, upd), opt), None

  carry = (params, tx.init(params))
  return jax.lax.scan(minibatch, carry, jax.random.split(k_steps, steps))[0][0]


@functools.partial(jax.jit, static_argnames=("kind", "n_classes"))
def _predict(kind, params, x, *, n_classes):
  # The last output is "any other token": never a useful guess, so never predicted.
  return jnp.argmax(_logits(kind, params, x)[:, :n_classes], axis=-1)


def probe(kind: str, x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray,
          cfg, seed: int) -> np.ndarray:
  """Trains a classifier on (x_train [N, F], y_train [N] tokens) and predicts x_test [N', F].

  The label space is the cfg.max_classes most frequent training tokens plus one "other"
  class, which keeps the head small on a 50k vocabulary.

  Returns:
    [N'] predicted token ids.
  """
  tokens, counts = np.unique(y_train, return_counts=True)
  classes = tokens[np.argsort(-counts, kind="stable")[:cfg.max_classes]]
  lookup = {int(t): i for i, t in enumerate(classes)}
  y = np.array([lookup.get(int(t), len(classes)) for t in y_train], np.int32)
  params = _fit(kind, jnp.asarray(x_train), jnp.asarray(y), jax.random.PRNGKey(seed),
                cfg.lr, cfg.weight_decay, n_out=len(classes) + 1, hidden=cfg.mlp_hidden,
                steps=cfg.steps, batch=cfg.batch)
  return classes[np.asarray(_predict(kind, params, jnp.asarray(x_test), n_classes=len(classes)))]


def bootstrap_interval(per_frame: np.ndarray, replicates: int, seed: int,
                       confidence: float = 0.95) -> tuple[float, float]:
  """Percentile interval of the mean of per_frame [F] over frames resampled with replacement."""
  rng = np.random.default_rng(seed)
  means = []
  for start in range(0, replicates, 1000):
    idx = rng.integers(0, len(per_frame), size=(min(1000, replicates - start), len(per_frame)))
    means.append(per_frame[idx].mean(axis=1))
  lo, hi = np.percentile(np.concatenate(means), [50 * (1 - confidence), 50 * (1 + confidence)])
  return float(lo), float(hi)


def split_frames(n_frames: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
  """A seeded random half of the frames (train) and the rest (test)."""
  order = np.random.default_rng(seed).permutation(n_frames)
  return np.sort(order[: n_frames // 2]), np.sort(order[n_frames // 2:])


def content(features: dict, labels: np.ndarray, train: np.ndarray, test: np.ndarray, cfg,
            n_arms: int, policy: dict, seed: int, controls: bool = True,
            predictions: dict | None = None) -> dict:
  """Runs every (features, classifier) arm and its shuffled-label control.

  Args:
    features: {name: [S, R, F]}; labels: [S, R] tokens; train, test: frame indices.
    cfg: probe settings (classifiers, max_classes, steps, batch, lr, weight_decay,
      mlp_hidden); n_arms: the Bonferroni divisor (fixed by the caller so that a subset
      of arms is judged like the full set); policy: the gate policy dict.
    predictions: if given, filled with {"<features>/<classifier>": [S_test, R] predicted
      tokens} (what the study's records store).

  Returns:
    {baseline: {...}, arms: {"<features>/<classifier>": {...}}, G_pp, gate}.
  """
  y_train, y_test = labels[train].reshape(-1), labels[test]
  base_token = int(np.bincount(y_train).argmax())
  base_hits = (y_test == base_token)
  n = int(y_test.size)
  z = float(stats.norm.ppf(1 - policy["alpha"] / n_arms))
  boot = policy["bootstrap"]
  out = {"baseline": {"token": base_token, "accuracy": float(base_hits.mean()),
                      "floor_pp": 100 * (wilson_upper(int(base_hits.sum()), n, z)
                                         - base_hits.mean())},
         "n_rows": n, "n_frames": int(len(test)), "n_arms": n_arms, "z": z, "arms": {}}
  shuffled = np.random.default_rng(seed + 1).permutation(y_train)

  def score(pred):
    hits = pred.reshape(y_test.shape) == y_test
    per_frame = hits.mean(axis=1) - base_hits.mean(axis=1)
    lo, hi = bootstrap_interval(per_frame, boot["replicates"], boot["seed"], boot["confidence"])
    acc = float(hits.mean())
    return {"accuracy": acc, "advantage_pp": 100 * float(per_frame.mean()),
            "ci_pp": [100 * lo, 100 * hi],
            "gate_pp": 100 * (wilson_upper(int(hits.sum()), n, z) - float(base_hits.mean()))}

  for name, x in features.items():
    x_train, x_test = x[train].reshape(-1, x.shape[-1]), x[test].reshape(-1, x.shape[-1])
    for kind in cfg.classifiers:
      predicted = probe(kind, x_train, y_train, x_test, cfg, seed)
      if predictions is not None:
        predictions[f"{name}/{kind}"] = predicted.reshape(y_test.shape).astype(np.int32)
      arm = score(predicted)
      if controls:
        arm["shuffled"] = score(probe(kind, x_train, shuffled, x_test, cfg, seed))
      out["arms"][f"{name}/{kind}"] = arm
  out["G_pp"] = max(a["gate_pp"] for a in out["arms"].values())
  out["gate"] = "FAIL" if out["G_pp"] > policy["threshold_pp"] else "PASS"
  return out
