"""GPT-2 in Flax linen, with exactly the semantics of HF `GPT2LMHeadModel`.

Learned positions, pre-LN blocks `x + attn(ln_1(x))` then `x + mlp(ln_2(x))` with
`gelu_new` (the tanh approximation), a final `ln_f` and a head tied to `wte`.

Parameter names follow the HF checkpoint (`wte`, `wpe`, `h_{i}/ln_1`, `h_{i}/attn/c_attn`,
...), so conversion is a rename plus LayerNorm `weight -> scale`. HF's `Conv1D` stores its
weight as `[in, out]`, the same layout as a Flax `Dense` kernel.

Every module has two entry points: `__call__` over a whole sequence `[B, T, d]`, and `step`
over one new position with an explicit key/value cache, used by the KV-cached client.
The cache is a plain array argument (not a mutable Flax collection) so that it vmaps
cleanly over documents, beams and candidates.

Applied to the computation form of the parameters (`lla.model.layer_stack`), a range of
blocks is one scanned block body; applied to the HF-named tree, the blocks are unrolled.

Shapes: B batch, T positions, d = n_embd, H heads, D = d / H head size, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lla.model import layer_stack


@dataclasses.dataclass(frozen=True)
class GPT2Config:
  """Hyper-parameters of a GPT-2. Frozen and hashable: it is a static jit argument."""

  vocab_size: int = 50257
  n_positions: int = 1024
  n_embd: int = 768
  n_layer: int = 12
  n_head: int = 12
  layer_norm_epsilon: float = 1e-5
  # Compute dtype of matmuls ("float32" or "bfloat16"); parameters stay float32.
  dtype: str = "float32"

  def __post_init__(self):
    if self.n_embd % self.n_head:
      raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
    if self.dtype not in ("float32", "bfloat16"):
      raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")

  @property
  def head_dim(self) -> int:
    return self.n_embd // self.n_head

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  # The family vocabulary of `lla.model.decoder.DecoderConfig`, read-only: GPT-2 is the
  # "gpt2" family (learned positions, LayerNorm, gelu MLP 4d, all biases, tied head). They are
  # properties, not fields, so config.json files and checkpoint hashes are unchanged.
  family = property(lambda self: "gpt2")
  n_kv_head = property(lambda self: self.n_head)
  d_ff = property(lambda self: 4 * self.n_embd)
  norm = property(lambda self: "layernorm")
  norm_eps = property(lambda self: self.layer_norm_epsilon)
  mlp = property(lambda self: "gelu")
  positions = property(lambda self: "learned")
  tie_embeddings = property(lambda self: True)
  embed_scale = property(lambda self: 1.0)

  def replace(self, **changes) -> "GPT2Config":
    return dataclasses.replace(self, **changes)

  @classmethod
  def gpt2_124m(cls) -> "GPT2Config":
    return cls()


def gelu_new(x: jax.Array) -> jax.Array:
  """HF's `gelu_new`: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
  return 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def _dense(features: int, cfg: GPT2Config, name: str) -> nn.Dense:
  return nn.Dense(features, dtype=cfg.compute_dtype, param_dtype=jnp.float32,
                  kernel_init=nn.initializers.normal(0.02), name=name)


def _layer_norm(cfg: GPT2Config, name: str) -> nn.LayerNorm:
  # use_fast_variance=False: E[x^2]-E[x]^2 loses digits on the residual stream's
  # outlier dimensions, and parity with PyTorch is checked to 1e-4.
  return nn.LayerNorm(epsilon=cfg.layer_norm_epsilon, dtype=jnp.float32,
                      param_dtype=jnp.float32, use_fast_variance=False, name=name)


class Attention(nn.Module):
  """Causal multi-head self-attention (`c_attn` -> split q, k, v -> `c_proj`)."""

  cfg: GPT2Config

  def setup(self):
    self.c_attn = _dense(3 * self.cfg.n_embd, self.cfg, "c_attn")
    self.c_proj = _dense(self.cfg.n_embd, self.cfg, "c_proj")

  def _qkv(self, x: jax.Array):
    """[..., d] -> three [..., H, D]."""
    qkv = self.c_attn(x)
    q, k, v = jnp.split(qkv, 3, axis=-1)
    heads = lambda a: a.reshape(a.shape[:-1] + (self.cfg.n_head, self.cfg.head_dim))
    return heads(q), heads(k), heads(v)

  def __call__(self, x: jax.Array) -> jax.Array:
    """x: [B, T, d] -> [B, T, d]."""
    q, k, v = self._qkv(x)
    t = x.shape[-2]
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
    logits = logits / math.sqrt(self.cfg.head_dim)
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    logits = jnp.where(causal, logits, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
    return self.c_proj(out.reshape(x.shape[:-1] + (self.cfg.n_embd,)))

  def step(self, x_t: jax.Array, cache_k: jax.Array, cache_v: jax.Array, t: jax.Array):
    """One new position attending to a cached prefix and to itself.

    The cache is read, never copied: beam search evaluates thousands of candidates
    against one prefix, and writing k_t into a per-candidate copy would cost a cache each.

    Args:
      x_t: [d] the (normalised) input at position t.
      cache_k, cache_v: [T_max, H, D]; rows < t hold the prefix, the rest is ignored.
      t: scalar int position of x_t.

    Returns:
      (y_t [d], k_t [H, D], v_t [H, D]); the caller writes k_t, v_t at row t.
    """
    q_t, k_t, v_t = self._qkv(x_t)
    scale = 1.0 / math.sqrt(self.cfg.head_dim)
    prefix_logits = jnp.einsum("hd,khd->hk", q_t, cache_k).astype(jnp.float32) * scale
    prefix_logits = jnp.where(jnp.arange(cache_k.shape[0]) < t, prefix_logits,
                              jnp.finfo(jnp.float32).min)
    self_logit = jnp.einsum("hd,hd->h", q_t, k_t).astype(jnp.float32)[:, None] * scale
    weights = jax.nn.softmax(jnp.concatenate([prefix_logits, self_logit], axis=-1), axis=-1)
    weights = weights.astype(v_t.dtype)
    out = (jnp.einsum("hk,khd->hd", weights[:, :-1], cache_v.astype(v_t.dtype))
           + weights[:, -1:] * v_t)
    return self.c_proj(out.reshape(self.cfg.n_embd)), k_t, v_t


class MLP(nn.Module):
  cfg: GPT2Config

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    hidden = gelu_new(_dense(4 * self.cfg.n_embd, self.cfg, "c_fc")(x))
    return _dense(self.cfg.n_embd, self.cfg, "c_proj")(hidden)


class Block(nn.Module):
  """Pre-LN transformer block."""

  cfg: GPT2Config

  def setup(self):
    self.ln_1 = _layer_norm(self.cfg, "ln_1")
    self.attn = Attention(self.cfg, name="attn")
    self.ln_2 = _layer_norm(self.cfg, "ln_2")
    self.mlp = MLP(self.cfg, name="mlp")

  def __call__(self, x: jax.Array) -> jax.Array:
    """x: [B, T, d] residual stream -> [B, T, d]."""
    x = x + self.attn(self.ln_1(x)).astype(x.dtype)
    return x + self.mlp(self.ln_2(x)).astype(x.dtype)

  def step(self, x_t: jax.Array, cache_k: jax.Array, cache_v: jax.Array, t: jax.Array):
    """x_t: [d]; caches [T_max, H, D] -> (x_t' [d], k_t [H, D], v_t [H, D])."""
    attn_out, k_t, v_t = self.attn.step(self.ln_1(x_t), cache_k, cache_v, t)
    x_t = x_t + attn_out.astype(x_t.dtype)
    return x_t + self.mlp(self.ln_2(x_t)).astype(x_t.dtype), k_t, v_t


class GPT2(nn.Module):
  """GPT-2 whose pieces (embedding, a range of blocks, head) are callable separately.

  The split's client is `embed` + `blocks(0, k)`, its server `blocks(k, L)` + `head`.
  """

  cfg: GPT2Config

  def setup(self):
    cfg = self.cfg
    self.wte = nn.Embed(cfg.vocab_size, cfg.n_embd, embedding_init=nn.initializers.normal(0.02),
                        param_dtype=jnp.float32, name="wte")
    self.wpe = nn.Embed(cfg.n_positions, cfg.n_embd, embedding_init=nn.initializers.normal(0.01),
                        param_dtype=jnp.float32, name="wpe")
    self.h = [Block(cfg, name=f"h_{i}") for i in range(cfg.n_layer)]
    self.ln_f = _layer_norm(cfg, "ln_f")

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """tokens [B, T] int -> logits [B, T, V] (float32)."""
    return self.head(self.blocks(self.embed(tokens), 0, self.cfg.n_layer))

  def embed(self, tokens: jax.Array, offset: int | jax.Array = 0) -> jax.Array:
    """tokens [..., T] -> wte[tokens] + wpe[offset + 0..T-1], [..., T, d] float32."""
    positions = offset + jnp.arange(tokens.shape[-1])
    return self.wte(tokens) + self.wpe(positions)

  def blocks(self, x: jax.Array, start: int, stop: int) -> jax.Array:
    """Blocks start..stop-1 over a residual stream [B, T, d]."""
    if not layer_stack.is_stacked(self):
      for block in self.h[start:stop]:
        x = block(x)
      return x
    block = lambda m, x, i, _: (m(x), None)
    return layer_stack.scan(self, Block(self.cfg, parent=None), block, x, start, stop)[0]

  def head(self, x: jax.Array) -> jax.Array:
    """ln_f then the head tied to wte: [B, T, d] -> logits [B, T, V] float32."""
    return self.wte.attend(self.ln_f(x).astype(jnp.float32))

  def blocks_step(self, x_t: jax.Array, cache: jax.Array, t: jax.Array, start: int, stop: int):
    """One position through blocks start..stop-1 with a KV cache.

    Args:
      x_t: [d] residual input at position t.
      cache: [stop - start, 2, T_max, H, D] keys and values of the prefix.
      t: scalar int position.

    Returns:
      (h_t [d], kv_t [stop - start, 2, H, D]) the output and the new keys/values.
    """
    if not layer_stack.is_stacked(self):
      new_kv = []
      for i, block in enumerate(self.h[start:stop]):
        x_t, k_t, v_t = block.step(x_t, cache[i, 0], cache[i, 1], t)
        new_kv.append(jnp.stack([k_t, v_t]))
      return x_t, jnp.stack(new_kv)

    def block(m, x_t, i, cache_i):
      x_t, k_t, v_t = m.step(x_t, cache_i[0], cache_i[1], t)
      return x_t, jnp.stack([k_t, v_t])

    return layer_stack.scan(self, Block(self.cfg, parent=None), block, x_t, start, stop, cache,
                            first_apart=True)


def init_params(cfg: GPT2Config, key: jax.Array) -> dict:
  """Random GPT-2 parameters (normal(0.02) weights, as HF initialises them)."""
  return GPT2(cfg).init(key, jnp.zeros((1, 2), jnp.int32))["params"]


def random_params(cfg: GPT2Config, seed: int) -> dict:
  """`init_params`' tree and distribution (normal 0.02, wpe 0.01, LayerNorm 1/0) drawn
  with numpy from `seed`: no eager Flax init, so GPT-2 124M's benchmarks start in seconds."""
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    name = path[-1].key
    if name in ("scale", "bias"):
      return jnp.full(leaf.shape, 1.0 if name == "scale" else 0.0, jnp.float32)
    std = 0.01 if path[0].key == "wpe" else 0.02
    return jnp.asarray(std * rng.standard_normal(leaf.shape, dtype=np.float32))

  return jax.tree_util.tree_map_with_path(
      draw, jax.eval_shape(lambda key: init_params(cfg, key), jax.random.key(0)))


def param_count(params) -> int:
  return sum(x.size for x in jax.tree_util.tree_leaves(params))
