"""MID: a variational information bottleneck at the cut, trained with the task.

Sources: T. Zou, Y. Liu, Y. Kang, W. Liu, Y. He, Z. Yi, Q. Yang, Y.-Q. Zhang, "Defending Batch-
Level Label Inference and Replacement Attacks in Vertical Federated Learning" (MID, IEEE
Trans. Big Data 2023), as VFLAIR-LLM (Gu et al., KDD 2025) applies it to a split LLM: its
`MIDModel_Linear` (src/models/mid_model_rapper.py) after the client's blocks. Per position
of h [B, T, d], with a bottleneck of width b:

  mu = h W_mu + c_mu,  logvar = h W_lv + c_lv                     [B, T, b]
  z = mu + exp(logvar / 2) * n,  n ~ N(0, I_b)   (reparameterised)  [B, T, b]
  h' = z W_dec + c_dec                                              [B, T, d]

The server sees h' (it runs its blocks on it and returns g = dL/dh'). The objective is

  L = CE(server(h')) + lambda * KL,
  KL = 1 / (B T b d) * sum_{B, T, b} 0.5 (mu^2 + exp(logvar) - 1 - logvar),

VFLAIR-LLM's normalisation of KL(N(mu, sigma^2) || N(0, I)): its code sums the elementwise KL
over positions, averages over documents and bottleneck coordinates and divides by T * d,
i.e. the elementwise mean divided by d.

Where lla departs from VFLAIR's linear model, and why: no ReLU after the encoder or the
decoder (a ReLU'd h' >= 0 cannot stand in for GPT-2's residual stream within a short
fine-tune; VFLAIR fine-tunes for epochs), the variance as logvar (the VIB parameterisation
of Alemi et al., ICLR 2017) rather than softplus(x - 0.5), and the initialisation: the
mean kernel W_mu is a Haar-random d x b matrix Q with orthonormal columns drawn from the
secret, the decoder W_dec = Q^T, the log-variance kernel 0 and its bias log(init_std^2),
so the mechanism starts as the orthogonal projection onto a secret b-dimensional subspace
plus noise of std init_std in it (VFLAIR's std at a zero pre-activation, softplus(-0.5) =
0.474, by default) and an undefended model's utility is where training starts.

The bottleneck's weights are the client's secret: drawn from the secret's persistent key
(`init_weights`), trained with the model in the fine-tuning loop (`lla.train.finetune`; at the
model's learning rate, or with an AdamW of their own at peak rate `weights_lr`, as VFLAIR-LLM
gives its MID model an `lr` of its own: 1e-3 over 50 epochs in its configs/2-slice/bi/
lambada_mid.json), then
stored by the defender beside the checkpoint, never in it (`save_weights`): in memory a
MID-defended model's params carry them under the top-level key `PARAMS_KEY`, which
`without_weights` removes from what an attacker is given. Capture and utility sample z, as
VFLAIR does at every forward, with the noise n from the secret's step keys (fresh per batch).

strength = lambda; lambda = 0 is the undefended target bit for bit (no bottleneck at all).
`objective` is the mechanism at any lambda >= 0 (the known-answer test at lambda = 0, b = d).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import math
import pathlib
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from lla.defenses.base import Defense, DefenseError, Secret, SecretKeys, register
from lla.model import split

PARAMS_KEY = "mid"
# softplus(0 - 0.5): VFLAIR-LLM's sigma where its std pre-activation is zero.
VFLAIR_INIT_STD = math.log1p(math.exp(-0.5))


def init_weights(key: jax.Array, d: int, b: int, init_std: float) -> dict:
  """The bottleneck at initialisation (see the module docstring): a dict of Dense-like
  {"kernel", "bias"} leaves, so that weight decay reaches the kernels only."""
  if not 1 <= b <= d:
    raise DefenseError(f"mid: bottleneck width {b} must lie in [1, d={d}]")
  # QR of a Gaussian with the signs of R's diagonal fixed: Haar-distributed orthonormal columns.
  q, r = jnp.linalg.qr(jax.random.normal(key, (d, b), jnp.float32))
  q = q * jnp.sign(jnp.diagonal(r))[None, :]
  return {"mu": {"kernel": q, "bias": jnp.zeros((b,), jnp.float32)},
          "logvar": {"kernel": jnp.zeros((d, b), jnp.float32),
                     "bias": jnp.full((b,), 2.0 * math.log(init_std), jnp.float32)},
          "decoder": {"kernel": q.T, "bias": jnp.zeros((d,), jnp.float32)}}


def encode(weights: dict, h: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(mu, logvar), each [B, T, b], of h [B, T, d]."""
  dense = lambda p, x: x @ p["kernel"] + p["bias"]
  h = h.astype(jnp.float32)
  return dense(weights["mu"], h), dense(weights["logvar"], h)


def decode(weights: dict, z: jax.Array) -> jax.Array:
  """h' [B, T, d] of z [B, T, b]."""
  return z @ weights["decoder"]["kernel"] + weights["decoder"]["bias"]


def sample(weights: dict, h: jax.Array, key: jax.Array) -> jax.Array:
  """h' = decode(mu + exp(logvar / 2) * n), n ~ N(0, I) from `key`: h [B, T, d] -> [B, T, d]."""
  mu, logvar = encode(weights, h)
  return decode(weights, mu + jnp.exp(0.5 * logvar) * jax.random.normal(key, mu.shape))


def kl_term(mu: jax.Array, logvar: jax.Array, d: int) -> jax.Array:
  """VFLAIR-LLM's KL(N(mu, exp(logvar)) || N(0, I)) for mu, logvar [B, T, b]: the elementwise
  KL's mean divided by d (module docstring)."""
  return 0.5 * jnp.mean(mu ** 2 + jnp.exp(logvar) - 1.0 - logvar) / d


def objective(params, cfg, tokens: jax.Array, k: int, lam: float,
              key: jax.Array) -> jax.Array:
  """CE(server(h')) + lam * KL for tokens [B, T], the bottleneck in params[PARAMS_KEY] and the
  step's noise key: the MID training loss at any lam >= 0 (lam = 0: no KL, mechanism on)."""
  weights = params[PARAMS_KEY]
  h = split.client(params, cfg, tokens, k)
  mu, logvar = encode(weights, h)
  wire = decode(weights, mu + jnp.exp(0.5 * logvar) * jax.random.normal(key, mu.shape))
  ce = split.server_loss(params, cfg, wire.astype(h.dtype), tokens, k)[0]
  return ce + lam * kl_term(mu, logvar, h.shape[-1])


def weights_of(params) -> dict:
  """The bottleneck in a defended model's params, or DefenseError (one line)."""
  if PARAMS_KEY not in params:
    raise DefenseError("mid: these params carry no bottleneck weights; fine-tune with the "
                       "defense in the loop (lla.train.finetune) or load them (load_weights)")
  return params[PARAMS_KEY]


def without_weights(params) -> dict:
  """params less the bottleneck: what an attacker holding the client layers gets."""
  return {name: value for name, value in params.items() if name != PARAMS_KEY}


def weights_sha256(weights: dict) -> str:
  """The defender's commitment to trained weights (recorded; the weights are not)."""
  digest = hashlib.sha256()
  for path, leaf in sorted(jax.tree_util.tree_flatten_with_path(weights)[0],
                           key=lambda item: jax.tree_util.keystr(item[0])):
    array = np.ascontiguousarray(np.asarray(leaf, np.float32))
    digest.update(f"{jax.tree_util.keystr(path)}\0{list(array.shape)}\0".encode())
    digest.update(array.tobytes())
  return digest.hexdigest()


def save_weights(path: str | pathlib.Path, weights: dict) -> str:
  """Writes the trained bottleneck (the defender's file, mode 0600); returns its sha256."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  flat = {jax.tree_util.keystr(p): np.asarray(v, np.float32)
          for p, v in jax.tree_util.tree_flatten_with_path(weights)[0]}
  buffer = io.BytesIO()
  np.savez(buffer, **flat)
  tmp = path.with_suffix(".tmp")
  tmp.write_bytes(buffer.getvalue())
  tmp.chmod(0o600)
  tmp.replace(path)
  return weights_sha256(weights)


def load_weights(path: str | pathlib.Path, sha256: str) -> dict:
  """The bottleneck `save_weights` wrote, verified against its recorded sha256."""
  path = pathlib.Path(path)
  if not path.exists():
    raise DefenseError(f"mid: the defender's bottleneck weights {path} are missing")
  with np.load(path) as stored:
    flat = {name: jnp.asarray(stored[name]) for name in stored.files}
  weights = {}
  for name, value in flat.items():  # "['mu']['kernel']" -> weights["mu"]["kernel"]
    outer, inner = name[2:-2].split("']['")
    weights.setdefault(outer, {})[inner] = value
  if weights_sha256(weights) != sha256:
    raise DefenseError(f"mid: {path} does not hash to the recorded {sha256[:12]}...")
  return weights


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class Mid(Defense):
  """The MID bottleneck at the cut; strength = lam, the KL weight (module docstring)."""

  name = "mid"
  acts_on = "activations"
  has_secret = True
  # Where its trained weights sit in a defended model's params (lla.train.finetune).
  params_key: ClassVar[str] = PARAMS_KEY
  save_weights = staticmethod(save_weights)
  load_weights = staticmethod(load_weights)

  lam: float
  width: int | None = None  # b; None: the model's width d
  init_std: float = VFLAIR_INIT_STD
  # Peak learning rate of the bottleneck's own AdamW in the defended fine-tune (VFLAIR-LLM's
  # MID `lr`, 1e-3 in its configs); None: it trains with the model at the model's rate.
  weights_lr: float | None = None

  def __post_init__(self):
    if not self.lam >= 0:
      raise ValueError(f"lam={self.lam} must be >= 0")
    if self.width is not None and self.width < 1:
      raise ValueError(f"width={self.width} must be >= 1 (None: the model's width)")
    if not self.init_std > 0:
      raise ValueError(f"init_std={self.init_std} must be > 0")
    if self.weights_lr is not None and not self.weights_lr > 0:
      raise ValueError(f"weights_lr={self.weights_lr} must be > 0 (None: the model's rate)")

  @property
  def strength(self) -> float:
    return self.lam

  def bottleneck_width(self, d: int) -> int:
    return d if self.width is None else self.width

  def init_weights(self, cfg, secret: Secret) -> dict:
    """The bottleneck at the start of the defended fine-tune, from the secret."""
    return self._weights_at_init(secret.keys(self.name).persistent, cfg.n_embd)

  def _weights_at_init(self, persistent: jax.Array, d: int) -> dict:
    return init_weights(persistent, d, self.bottleneck_width(d), self.init_std)

  def wire(self, params, h: jax.Array, keys: SecretKeys) -> jax.Array:
    """h' [B, T, d] the server receives for h [B, T, d], the noise from the step key."""
    return sample(weights_of(params), h, keys.step).astype(h.dtype)

  def penalty(self, params, h: jax.Array) -> jax.Array:
    """lam * KL of the bottleneck's posterior at h [B, T, d] (the client's own term)."""
    return self.lam * kl_term(*encode(weights_of(params), h), h.shape[-1])

  def mimic(self, h: jax.Array, keys: SecretKeys) -> jax.Array:
    """h' [N, T, d] for h [N, T, d] through a bottleneck at its initialisation drawn from
    `keys` (the persistent key draws Q, the step key the noise): the mechanism as one who
    knows it and its public parameters but not the defender's trained, secret weights can
    run it. The defense-aware baselines' calibration mimic (lla.defenses.aware)."""
    return sample(self._weights_at_init(keys.persistent, h.shape[-1]), h,
                  keys.step).astype(h.dtype)

  def transform(self, x, keys):
    raise DefenseError("mid: its bottleneck weights live in the defended model's params; "
                       "use lla.defenses.training.forward_message or batched_messages")
