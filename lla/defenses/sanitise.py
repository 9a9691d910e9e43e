"""Token sanitisation before the embedding: SanText and CusText (exponential mechanisms).

Sources:
  * SanText: X. Yue, M. Du, T. Wang, Y. Li, H. Sun, S. S. M. Chow, "Differential Privacy for
    Text Analytics via Natural Text Sanitization", Findings of ACL 2021 (section 3.2): each
    token x is replaced by y drawn with

      P(y | x) = exp(-epsilon * d(x, y) / 2) / sum_{v in V} exp(-epsilon * d(x, v) / 2),

    d the Euclidean distance of the two tokens' embeddings (the exponential mechanism with
    utility -d; the mechanism is epsilon * d-private for every pair of inputs).
  * CusText: S. Chen, F. Mo, Y. Wang, C. Chen, J.-Y. Nie, C. Wang, J. Cui, "A Customized Text
    Sanitization Mechanism with Differential Privacy", Findings of ACL 2023 (section 3): x
    has a customised output set S_x, here its K nearest tokens by embedding distance (x
    itself included), and

      u(x, y) = 1 - (d(x, y) - min_{S_x} d(x, .)) / (max_{S_x} d(x, .) - min_{S_x} d(x, .)),
      P(y | x) = exp(epsilon * u(x, y) / 2) / sum_{v in S_x} exp(epsilon * u(x, v) / 2),

    the similarity normalised to [0, 1] on S_x (sensitivity 1), as the paper's scoring
    function. The paper groups tokens so that the members of a group share one output set
    (its DP guarantee is over inputs of a group); lla gives each token its own K nearest
    (per-token sets), so two tokens' outputs may differ in support: a looser guarantee than
    the paper's, and the same kernel for the defender and the adaptive attacker.
  SanText+ (keep non-sensitive words with probability p, word frequencies from a corpus) is
  not built.

What defines the distances: the input table of the weights the client runs
(`lla.model.split.input_table`, unscaled, HF's inputs_embeds), i.e. the model's own public
pre-trained table when the client is the pre-trained model (the published papers use a
public embedding: GloVe, BERT's); under fine-tuning with the defense in the loop it is the
client's current table, which moves away from the public one only as fine-tuning moves it.
Distances take no gradient.

In lla's split the client replaces each input token before its embedding and runs its k
blocks on the sanitised tokens: the server observes h = client(y), the h of the sanitised
text. Scoring is against the ORIGINAL tokens x (the capture's truth: the documents the
client was given; `lla.capture.runner` stores them, not y). The hook is the one of
`dx_privacy` ("embeddings": `noisy_inputs` returns table[y], what block 0 receives), so
capture, fine-tuning and utility run it unchanged; a "tokens" kind would carry the same data
through the same path under another name.

Sampling: the Gumbel-max trick, y = argmax_v (logit_v + G_v), G_v i.i.d. Gumbel(0, 1),
over the logits -epsilon d / 2 (SanText, all V) or epsilon u / 2 (CusText, the K of S_x),
one row of logits at a time (`lax.map` in blocks of ROWS_PER_BLOCK rows), so memory is O(V)
per row, never O(rows * V). Every position draws its own Gumbel vector from the step's key.

strength = 1 / epsilon; epsilon = None is the undefended client, bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from lla.defenses.base import Defense, DefenseError, SecretKeys, register

ROWS_PER_BLOCK = 64  # rows of logits materialised at once: memory ROWS_PER_BLOCK * V floats


def token_distances(table: jax.Array, sq_norms: jax.Array, x: jax.Array) -> jax.Array:
  """d(x, v) [V] for every row v of table [V, d] (sq_norms [V] = ||table_v||^2): the
  Euclidean distance from the expansion ||t_x||^2 + ||t_v||^2 - 2 t_x.t_v, exactly 0 at v = x
  (the expansion's rounding would leave ~1e-4 there)."""
  d2 = sq_norms + sq_norms[x] - 2.0 * (table @ table[x])
  distance = jnp.sqrt(jnp.maximum(d2, 0.0))
  return jnp.where(jnp.arange(table.shape[0]) == x, 0.0, distance)


def santext_logits(table: jax.Array, sq_norms: jax.Array, x: jax.Array,
                   epsilon: float) -> jax.Array:
  """-epsilon d(x, v) / 2 [V]: SanText's unnormalised log P(v | x)."""
  return -0.5 * epsilon * token_distances(table, sq_norms, x)


def custext_logits(table: jax.Array, sq_norms: jax.Array, x: jax.Array, epsilon: float,
                   top_k: int) -> tuple[jax.Array, jax.Array]:
  """(S_x [K] the K nearest tokens to x, nearest first; epsilon u(x, S_x) / 2 [K], CusText's
  unnormalised log P(y | x) over S_x)."""
  neg, support = jax.lax.top_k(-token_distances(table, sq_norms, x), top_k)
  distance = -neg
  low, spread = distance[0], distance[-1] - distance[0]
  # K = 1 or K tokens at one distance: every member equally similar (u = 1).
  u = jnp.where(spread > 0, 1.0 - (distance - low) / jnp.where(spread > 0, spread, 1.0), 1.0)
  return support.astype(jnp.int32), 0.5 * epsilon * u


def _rows(fn, *arrays):
  """fn(a_i, b_i, ...) for every row i of arrays [n, ...], ROWS_PER_BLOCK rows at a time."""
  return jax.lax.map(lambda row: fn(*row), arrays, batch_size=ROWS_PER_BLOCK)


@functools.partial(jax.jit, static_argnames=("epsilon",))
def santext_log_partition(table: jax.Array, epsilon: float) -> jax.Array:
  """log sum_v exp(-epsilon d(x, v) / 2) [V] for every token x: log P(y | x) =
  santext_logits(x)[y] - this[x]. O(V^2 d) work, O(V) memory per row."""
  table = jnp.asarray(table, jnp.float32)
  sq = jnp.sum(table * table, -1)
  ids = jnp.arange(table.shape[0], dtype=jnp.int32)
  return _rows(lambda x: jax.nn.logsumexp(santext_logits(table, sq, x, epsilon)), ids)


@functools.partial(jax.jit, static_argnames=("epsilon", "top_k"))
def custext_kernel(table: jax.Array, epsilon: float, top_k: int):
  """(S [V, K], log P(S[x, j] | x) [V, K]) for every token x: CusText's whole kernel."""
  table = jnp.asarray(table, jnp.float32)
  sq = jnp.sum(table * table, -1)
  ids = jnp.arange(table.shape[0], dtype=jnp.int32)

  def one(x):
    support, logits = custext_logits(table, sq, x, epsilon, top_k)
    return support, jax.nn.log_softmax(logits)

  return _rows(one, ids)


def _sample(key: jax.Array, tokens: jax.Array, draw) -> jax.Array:
  """tokens [B, T] -> [B, T], row i = draw(x_i, Gumbel key of row i) (Gumbel-max)."""
  flat = tokens.reshape(-1).astype(jnp.int32)
  rows = jnp.arange(flat.shape[0], dtype=jnp.int32)
  out = _rows(lambda i, x: draw(x, jax.random.fold_in(key, i)), rows, flat)
  return out.reshape(tokens.shape).astype(jnp.int32)


class _Sanitiser(Defense):
  """A token replacement before the embedding, keyed by the defender's step keys."""

  acts_on = "embeddings"
  has_secret = True  # the sampling randomness

  @property
  def strength(self) -> float:
    return 0.0 if self.epsilon is None else 1.0 / self.epsilon

  def _check_epsilon(self):
    if self.epsilon is not None and not self.epsilon > 0:
      raise ValueError(f"epsilon={self.epsilon} must be > 0 (None: no sanitisation)")

  def check_vocabulary(self, vocab_size: int) -> None:
    """Raises DefenseError if the mechanism cannot run on a vocabulary of this size."""

  def draw(self, table: jax.Array, sq_norms: jax.Array, x: jax.Array,
           key: jax.Array) -> jax.Array:
    """One sanitised token for token x."""
    raise NotImplementedError

  def sanitise(self, table: jax.Array, tokens: jax.Array, keys: SecretKeys) -> jax.Array:
    """The sanitised tokens y [B, T] of tokens [B, T], distances on table [V, d]."""
    self.check_vocabulary(table.shape[0])
    table = jax.lax.stop_gradient(jnp.asarray(table, jnp.float32))
    sq = jnp.sum(table * table, -1)
    return _sample(keys.step, tokens, lambda x, key: self.draw(table, sq, x, key))

  def noisy_inputs(self, table: jax.Array, tokens: jax.Array, keys: SecretKeys) -> jax.Array:
    """What the client's block 0 receives before positions: table[y] [B, T, d]."""
    return table[self.sanitise(table, tokens, keys)]


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class SanText(_Sanitiser):
  """y ~ exp(-epsilon d(x, y) / 2) over the vocabulary (Yue et al. 2021; module docstring)."""

  name = "santext"

  epsilon: float | None

  def __post_init__(self):
    self._check_epsilon()

  def draw(self, table, sq_norms, x, key):
    logits = santext_logits(table, sq_norms, x, self.epsilon)
    return jnp.argmax(logits + jax.random.gumbel(key, logits.shape))


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class CusText(_Sanitiser):
  """y ~ exp(epsilon u(x, y) / 2) over x's K nearest tokens (Chen et al. 2023; module
  docstring)."""

  name = "custext"

  epsilon: float | None
  top_k: int = 20  # K, the output set's size (the paper's default)

  def __post_init__(self):
    self._check_epsilon()
    if not self.top_k >= 1:
      raise ValueError(f"top_k={self.top_k} must be >= 1")

  def check_vocabulary(self, vocab_size: int) -> None:
    if self.top_k > vocab_size:
      raise DefenseError(f"custext top_k={self.top_k} exceeds the vocabulary ({vocab_size})")

  def draw(self, table, sq_norms, x, key):
    support, logits = custext_logits(table, sq_norms, x, self.epsilon, self.top_k)
    return support[jnp.argmax(logits + jax.random.gumbel(key, logits.shape))]
