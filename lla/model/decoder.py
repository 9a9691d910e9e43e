"""RoPE decoder families (llama, mistral, qwen2, qwen3, gemma, gemma3) in Flax linen.

One frozen `DecoderConfig` describes every family; one module `Decoder` implements them with
the same entry points as `lla.model.gpt2.GPT2` (`embed`, `blocks` over a layer range, `head`,
and the KV-cached one-token `blocks_step`), so `lla.model.split` dispatches on the config's
type and the callers of the split do not change. GPT-2 itself stays in `gpt2.py`, untouched
(its parameter tree and every existing checkpoint hash are unchanged); `GPT2Config` exposes
the same descriptive properties (`family`, `norm`, `mlp`, `positions`, `n_kv_head`, ...).

Semantics are those of transformers 5.x's eager attention (`LlamaForCausalLM` and its
relatives), formula by formula (../shared/notes/model-families.md, section 2):

* RMSNorm `w * (x * rsqrt(mean(x^2) + eps))` (Gemma: `(1 + w) * ...`), or LayerNorm.
* RoPE, half-split (`rotate_half`, GPT-NeoX) convention, `inv_freq` computed in float32
  numpy by HF's formula (default, `linear`, `llama3`), `cos/sin` from one shared function of
  the position ids in both the batched blocks and the one-token step.
* GQA: query head `h` reads KV head `h // (H / H_kv)`; scores `q k^T * head_dim^-0.5`,
  softmax in float32; Mistral/Qwen sliding window: key `j` visible to query `i` iff
  `i - W < j <= i`.
* Qwen2's q/k/v biases; Qwen3's (and Gemma-3's) q/k RMSNorm over head_dim, before RoPE.
* Gemma-3: "sandwich" norms (the attention and MLP outputs are normed before the residual
  add, the MLP input by `pre_feedforward_layernorm`); scores scaled by
  `query_pre_attn_scalar^-0.5`; windowed ("sliding_attention") layers rotate with their own
  default RoPE of base `local_rope_theta`, the others with the config's RoPE.
* MLP `down(act(gate(x)) * up(x))` with SiLU (swiglu) or tanh-GELU (geglu), or `down(gelu(up))`.
* Input embedding times `embed_scale` (Gemma sqrt(d)); head tied to the input table or a
  separate `lm_head` `[V, d]`.

Parameter names mirror the HF module tree (`embed_tokens`, `layers_{i}/self_attn/q_proj`,
`input_layernorm`, `post_attention_layernorm`, `mlp/gate_proj`, `norm`, `lm_head`), so the HF
conversion is a rename plus a transpose of every `nn.Linear` weight (HF `[out, in]`, Flax
`[in, out]`).

The KV cache of the step is `[k, 2, T_max, H_kv, D]` and holds keys *after* q/k-norm and RoPE.

Applied to the computation form of the parameters (`lla.model.layer_stack`: the layers
stacked once, outside the traced function), a range of layers is one scanned layer body;
what differs between layers is then scanned data, not Python branches: each layer's window
(`layer_windows`) and the row of the RoPE tables it rotates with (`rope_index`, Gemma-3's
local RoPE). Applied to the HF-named tree, the layers are unrolled, with the same formulas.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lla.model import layer_stack

NORMS = ("rmsnorm", "rmsnorm_1p", "layernorm")
MLPS = ("swiglu", "geglu", "gelu")
ROPE_TYPES = ("default", "linear", "llama3")
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma3")


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  """A RoPE decoder. Frozen and hashable: it is a static jit argument.

  Field names shared with `GPT2Config` (`vocab_size`, `n_positions`, `n_embd`, `n_layer`,
  `n_head`, `head_dim`, `dtype`) mean the same, so code reading them works for every family.
  """

  family: str = "llama"
  vocab_size: int = 32000
  n_positions: int = 2048          # max_position_embeddings (not a table: RoPE has none)
  n_embd: int = 4096               # d, the width of the boundary messages
  n_layer: int = 32
  n_head: int = 32                 # query heads H
  n_kv_head: int = 32              # key/value heads H_kv (GQA when < H)
  head_dim: int = 128              # D (explicit: Qwen3 and Gemma have H * D != d)
  d_ff: int = 11008                # MLP hidden width I
  norm: str = "rmsnorm"
  norm_eps: float = 1e-5
  mlp: str = "swiglu"
  positions: str = "rope"
  rope_type: str = "default"
  rope_theta: float = 10000.0
  rope_factor: float = 1.0         # linear and llama3
  rope_low_freq_factor: float = 1.0  # llama3
  rope_high_freq_factor: float = 4.0  # llama3
  rope_original_max_positions: int = 8192  # llama3
  qkv_bias: bool = False
  o_bias: bool = False
  mlp_bias: bool = False
  qk_norm: bool = False            # Qwen3, Gemma-3: RMSNorm over head_dim of q and k, before RoPE
  sandwich_norms: bool = False     # Gemma-3: attention and MLP outputs normed before the add
  query_pre_attn_scalar: float = 0.0  # Gemma-3: scores times s^-0.5; 0: s = head_dim
  local_rope_theta: float = 0.0    # Gemma-3: default RoPE of this base on windowed layers; 0: none
  sliding_window: int = 0          # 0: none; else key j visible to query i iff i - W < j <= i
  window_layers: tuple[bool, ...] = ()  # which layers use the window; () = all of them
  tie_embeddings: bool = True
  embed_scale: float = 1.0         # Gemma: sqrt(d); the head uses the unscaled table
  dtype: str = "float32"           # compute dtype of the matmuls; parameters stay float32

  def __post_init__(self):
    if isinstance(self.window_layers, list):
      object.__setattr__(self, "window_layers", tuple(bool(w) for w in self.window_layers))
    checks = [
        (self.family in FAMILIES, f"family {self.family!r} is not one of {FAMILIES}"),
        (self.norm in NORMS, f"norm {self.norm!r} is not one of {NORMS}"),
        (self.mlp in MLPS, f"mlp {self.mlp!r} is not one of {MLPS}"),
        (self.positions == "rope", f"positions {self.positions!r}: the decoder implements rope "
                                   "(learned positions are GPT-2's, lla.model.gpt2)"),
        (self.rope_type in ROPE_TYPES, f"rope_type {self.rope_type!r} is not one of {ROPE_TYPES}"),
        (self.n_head % self.n_kv_head == 0,
         f"n_head={self.n_head} is not a multiple of n_kv_head={self.n_kv_head}"),
        (self.head_dim % 2 == 0, f"head_dim={self.head_dim} must be even for RoPE"),
        (not self.window_layers or len(self.window_layers) == self.n_layer,
         f"window_layers has {len(self.window_layers)} entries for n_layer={self.n_layer}"),
        (self.sliding_window >= 0, f"sliding_window={self.sliding_window} < 0"),
        (self.query_pre_attn_scalar >= 0,
         f"query_pre_attn_scalar={self.query_pre_attn_scalar} < 0"),
        (not self.local_rope_theta or self.sliding_window,
         f"local_rope_theta={self.local_rope_theta} needs windowed layers (sliding_window > 0)"),
        (self.dtype in ("float32", "bfloat16"), f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}"),
    ]
    for ok, message in checks:
      if not ok:
        raise ValueError(message)

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def n_groups(self) -> int:
    return self.n_head // self.n_kv_head

  def window(self, layer: int) -> int:
    """The sliding window of `layer` (0 = full causal attention)."""
    if not self.sliding_window:
      return 0
    return self.sliding_window if (not self.window_layers or self.window_layers[layer]) else 0

  def rope_of(self, layer: int) -> "DecoderConfig":
    """The config whose RoPE fields `layer` rotates with: a windowed layer of a config with
    `local_rope_theta` has its own default RoPE (Gemma-3's local layers)."""
    if self.local_rope_theta and self.window(layer):
      return dataclasses.replace(self, rope_type="default", rope_theta=self.local_rope_theta,
                                 rope_factor=1.0, local_rope_theta=0.0)
    return self

  def replace(self, **changes) -> "DecoderConfig":
    return dataclasses.replace(self, **changes)


# --- RoPE ------------------------------------------------------------------------------


def inv_freq(cfg: DecoderConfig) -> np.ndarray:
  """HF's inverse frequencies `[D/2]` float32, for the config's rope type (numpy, static)."""
  dim = cfg.head_dim
  base = np.float32(cfg.rope_theta)
  inv = (np.float32(1.0) / (base ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))))
  inv = inv.astype(np.float32)
  if cfg.rope_type == "linear":
    inv = (inv / np.float32(cfg.rope_factor)).astype(np.float32)
  elif cfg.rope_type == "llama3":
    factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    orig = cfg.rope_original_max_positions
    low_wavelen, high_wavelen = orig / low, orig / high
    wavelen = (np.float32(2 * math.pi) / inv).astype(np.float32)
    llama = np.where(wavelen > low_wavelen, inv / np.float32(factor), inv).astype(np.float32)
    smooth = ((np.float32(orig) / wavelen - np.float32(low)) / np.float32(high - low)).astype(np.float32)
    smoothed = ((1 - smooth) * llama / np.float32(factor) + smooth * llama).astype(np.float32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    inv = np.where(medium, smoothed, llama).astype(np.float32)
  return inv


def rope_cos_sin(cfg: DecoderConfig, positions: jax.Array,
                 layer: int = 0) -> tuple[jax.Array, jax.Array]:
  """cos, sin `[..., D]` float32 for integer positions `[...]` at `layer` (the one formula
  used by both the batched blocks and the cached step)."""
  rope = cfg.rope_of(layer)
  freqs = jnp.asarray(positions).astype(jnp.float32)[..., None] * jnp.asarray(inv_freq(rope))
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb), jnp.sin(emb)


def rope_index(cfg: DecoderConfig) -> np.ndarray:
  """[L] int32: per layer, 0 if it rotates with the config's RoPE, 1 with its windowed
  layers' own (`rope_of`; Gemma-3's local layers)."""
  return np.array([int(cfg.rope_of(i) is not cfg) for i in range(cfg.n_layer)], np.int32)


def rope_tables(cfg: DecoderConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
  """cos, sin `[R, ..., D]`: `rope_cos_sin` of a layer of each `rope_index` value present
  (R = 1 or 2), for a scanned layer to pick its row."""
  layers = [int(np.argmax(rope_index(cfg) == r)) for r in range(rope_index(cfg).max() + 1)]
  tables = [rope_cos_sin(cfg, positions, layer) for layer in layers]
  return jnp.stack([c for c, _ in tables]), jnp.stack([s for _, s in tables])


def layer_windows(cfg: DecoderConfig) -> np.ndarray:
  """[L] int32: each layer's sliding window (0 = full causal attention)."""
  return np.array([cfg.window(i) for i in range(cfg.n_layer)], np.int32)


def _windowed(visible: jax.Array, query, key, window: int | jax.Array) -> jax.Array:
  """`visible` and key > query - window where window > 0. `window` is a layer's own (an
  int: no mask for 0) or a scanned layer's (a traced int32 scalar)."""
  if isinstance(window, int):
    return visible & (key > query - window) if window else visible
  return visible & ((window == 0) | (key > query - window))


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """`x * cos + rotate_half(x) * sin` with rotate_half(x) = [-x2, x1] (half split)."""
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return (x * cos + rotated * sin).astype(x.dtype)


# --- layers ----------------------------------------------------------------------------


class RMSNorm(nn.Module):
  eps: float
  one_plus: bool = False  # Gemma: (1 + w), weight initialised to 0

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    init = nn.initializers.zeros if self.one_plus else nn.initializers.ones
    scale = self.param("scale", init, (x.shape[-1],), jnp.float32)
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
    return y * (1.0 + scale) if self.one_plus else scale * y


def _norm(cfg: DecoderConfig, name: str) -> nn.Module:
  if cfg.norm == "layernorm":
    return nn.LayerNorm(epsilon=cfg.norm_eps, dtype=jnp.float32, param_dtype=jnp.float32,
                        use_fast_variance=False, name=name)
  return RMSNorm(cfg.norm_eps, one_plus=cfg.norm == "rmsnorm_1p", name=name)


def _dense(features: int, cfg: DecoderConfig, bias: bool, name: str) -> nn.Dense:
  return nn.Dense(features, use_bias=bias, dtype=cfg.compute_dtype, param_dtype=jnp.float32,
                  kernel_init=nn.initializers.normal(0.02), name=name)


def gelu_tanh(x: jax.Array) -> jax.Array:
  return 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


class Attention(nn.Module):
  """What differs between layers arrives as arguments, so that one traced body serves every
  layer of a scan: the layer's RoPE `cos, sin` and its `window` (see `_windowed`)."""

  cfg: DecoderConfig

  def setup(self):
    cfg = self.cfg
    self.q_proj = _dense(cfg.n_head * cfg.head_dim, cfg, cfg.qkv_bias, "q_proj")
    self.k_proj = _dense(cfg.n_kv_head * cfg.head_dim, cfg, cfg.qkv_bias, "k_proj")
    self.v_proj = _dense(cfg.n_kv_head * cfg.head_dim, cfg, cfg.qkv_bias, "v_proj")
    self.o_proj = _dense(cfg.n_embd, cfg, cfg.o_bias, "o_proj")
    if cfg.qk_norm:
      one_plus = cfg.norm == "rmsnorm_1p"
      self.q_norm = RMSNorm(cfg.norm_eps, one_plus=one_plus, name="q_norm")
      self.k_norm = RMSNorm(cfg.norm_eps, one_plus=one_plus, name="k_norm")

  @property
  def scale(self) -> float:
    return (self.cfg.query_pre_attn_scalar or self.cfg.head_dim) ** -0.5

  def _qkv(self, x: jax.Array, cos: jax.Array, sin: jax.Array):
    """x [..., d] -> q [..., H, D], k, v [..., H_kv, D]; q and k normed (Qwen3) and rotated.

    cos, sin broadcast against [..., 1, D]."""
    cfg = self.cfg
    q = self.q_proj(x).reshape(x.shape[:-1] + (cfg.n_head, cfg.head_dim))
    k = self.k_proj(x).reshape(x.shape[:-1] + (cfg.n_kv_head, cfg.head_dim))
    v = self.v_proj(x).reshape(x.shape[:-1] + (cfg.n_kv_head, cfg.head_dim))
    if cfg.qk_norm:
      q, k = self.q_norm(q).astype(q.dtype), self.k_norm(k).astype(k.dtype)
    cos, sin = cos[..., None, :], sin[..., None, :]
    return rotate(q, cos, sin), rotate(k, cos, sin), v

  def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array,
               window: int | jax.Array) -> jax.Array:
    """x [B, T, d], cos, sin [T, D] (`rope_cos_sin` of the positions) -> [B, T, d]."""
    cfg = self.cfg
    b, t = x.shape[0], x.shape[-2]
    q, k, v = self._qkv(x, cos, sin)
    q = q.reshape(b, t, cfg.n_kv_head, cfg.n_groups, cfg.head_dim)
    logits = jnp.einsum("bqkgd,bskd->bkgqs", q, k).astype(jnp.float32) * self.scale
    i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    visible = _windowed(j <= i, i, j, window)
    logits = jnp.where(visible, logits, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", weights, v)
    return self.o_proj(out.reshape(b, t, cfg.n_head * cfg.head_dim))

  def step(self, x_t: jax.Array, cache_k: jax.Array, cache_v: jax.Array, t: jax.Array,
           cos: jax.Array, sin: jax.Array, window: int | jax.Array):
    """One new position against a cached prefix (read, never copied) and itself.

    Args:
      x_t: [d] the normed input at position t.
      cache_k, cache_v: [T_max, H_kv, D]; rows < t hold the prefix (keys rotated).
      t: scalar int position.
      cos, sin: [D] `rope_cos_sin` of t; window: as in `__call__`.

    Returns:
      (y_t [d], k_t [H_kv, D] rotated, v_t [H_kv, D]).
    """
    cfg = self.cfg
    q_t, k_t, v_t = self._qkv(x_t, cos, sin)
    qg = q_t.reshape(cfg.n_kv_head, cfg.n_groups, cfg.head_dim)
    prefix = jnp.einsum("kgd,skd->kgs", qg, cache_k.astype(qg.dtype)).astype(jnp.float32) * self.scale
    rows = jnp.arange(cache_k.shape[0])
    visible = _windowed(rows < t, t, rows, window)
    prefix = jnp.where(visible, prefix, jnp.finfo(jnp.float32).min)
    self_logit = jnp.einsum("kgd,kd->kg", qg, k_t).astype(jnp.float32)[..., None] * self.scale
    weights = jax.nn.softmax(jnp.concatenate([prefix, self_logit], axis=-1), axis=-1)
    weights = weights.astype(v_t.dtype)
    out = (jnp.einsum("kgs,skd->kgd", weights[..., :-1], cache_v.astype(v_t.dtype))
           + weights[..., -1:] * v_t[:, None, :])
    return self.o_proj(out.reshape(cfg.n_head * cfg.head_dim)), k_t, v_t


class MLP(nn.Module):
  cfg: DecoderConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.cfg
    up = _dense(cfg.d_ff, cfg, cfg.mlp_bias, "up_proj")(x)
    if cfg.mlp == "gelu":
      hidden = gelu_tanh(up)
    else:
      gate = _dense(cfg.d_ff, cfg, cfg.mlp_bias, "gate_proj")(x)
      act = jax.nn.silu(gate) if cfg.mlp == "swiglu" else gelu_tanh(gate)
      hidden = act * up
    return _dense(cfg.n_embd, cfg, cfg.mlp_bias, "down_proj")(hidden)


class Layer(nn.Module):
  """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); with `sandwich_norms`
  (Gemma-3) x + norm(attn(norm(x))), then x + norm(mlp(norm(x))).

  What differs between layers (RoPE tables, window: see `Attention`) is an argument."""

  cfg: DecoderConfig

  def setup(self):
    self.input_layernorm = _norm(self.cfg, "input_layernorm")
    self.self_attn = Attention(self.cfg, name="self_attn")
    # HF's name in both layouts: the MLP's input norm, or (sandwich) the attention output's.
    self.post_attention_layernorm = _norm(self.cfg, "post_attention_layernorm")
    if self.cfg.sandwich_norms:
      self.pre_feedforward_layernorm = _norm(self.cfg, "pre_feedforward_layernorm")
      self.post_feedforward_layernorm = _norm(self.cfg, "post_feedforward_layernorm")
    self.mlp = MLP(self.cfg, name="mlp")

  def _attention_out(self, out: jax.Array) -> jax.Array:
    return self.post_attention_layernorm(out) if self.cfg.sandwich_norms else out

  def _mlp_branch(self, x: jax.Array) -> jax.Array:
    if self.cfg.sandwich_norms:
      hidden = self.mlp(self.pre_feedforward_layernorm(x).astype(x.dtype))
      return self.post_feedforward_layernorm(hidden).astype(x.dtype)
    return self.mlp(self.post_attention_layernorm(x).astype(x.dtype)).astype(x.dtype)

  def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array,
               window: int | jax.Array) -> jax.Array:
    out = self.self_attn(self.input_layernorm(x).astype(x.dtype), cos, sin, window)
    x = x + self._attention_out(out).astype(x.dtype)
    return x + self._mlp_branch(x)

  def step(self, x_t, cache_k, cache_v, t, cos, sin, window):
    out, k_t, v_t = self.self_attn.step(self.input_layernorm(x_t).astype(x_t.dtype),
                                        cache_k, cache_v, t, cos, sin, window)
    x_t = x_t + self._attention_out(out).astype(x_t.dtype)
    return x_t + self._mlp_branch(x_t), k_t, v_t


class Decoder(nn.Module):
  """A RoPE decoder whose pieces are callable separately, with `GPT2`'s entry points.

  The split's client is `embed` + `blocks(0, k)`, its server `blocks(k, L)` + `head`. Position
  ids enter inside attention: `embed`'s `offset` is accepted for signature compatibility and
  ignored; `blocks` takes the position offset instead, `blocks_step` the position t.
  """

  cfg: DecoderConfig

  def setup(self):
    cfg = self.cfg
    self.embed_tokens = nn.Embed(cfg.vocab_size, cfg.n_embd,
                                 embedding_init=nn.initializers.normal(0.02),
                                 param_dtype=jnp.float32, name="embed_tokens")
    self.layers = [Layer(cfg, name=f"layers_{i}") for i in range(cfg.n_layer)]
    self.norm = _norm(cfg, "norm")
    if not cfg.tie_embeddings and self.is_initializing():
      # Declared at init only and read where it is used (`head`): a party's share of the
      # parameters without the head (the client's) must apply too.
      self.param("lm_head", nn.initializers.normal(0.02), (cfg.vocab_size, cfg.n_embd),
                 jnp.float32)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """tokens [B, T] int -> logits [B, T, V] float32."""
    return self.head(self.blocks(self.embed(tokens), 0, self.cfg.n_layer))

  def embed(self, tokens: jax.Array, offset: int | jax.Array = 0) -> jax.Array:
    """tokens [..., T] -> embed_tokens[tokens] * embed_scale, [..., T, d] float32."""
    del offset  # RoPE: positions enter in the blocks.
    x = self.embed_tokens(tokens)
    return x * jnp.float32(self.cfg.embed_scale) if self.cfg.embed_scale != 1.0 else x

  def blocks(self, x: jax.Array, start: int, stop: int, offset: int | jax.Array = 0) -> jax.Array:
    """Blocks start..stop-1 over a residual stream [B, T, d] at positions offset + 0..T-1."""
    cfg = self.cfg
    positions = offset + jnp.arange(x.shape[-2])
    if not layer_stack.is_stacked(self):
      for i in range(start, stop):
        x = self.layers[i](x, *rope_cos_sin(cfg, positions, i), cfg.window(i))
      return x
    cos, sin = rope_tables(cfg, positions)
    rope, window = self._per_layer()

    def layer(m, x, i, _):
      return m(x, cos[rope[i]], sin[rope[i]], window(i)), None

    return layer_stack.scan(self, Layer(cfg, parent=None), layer, x, start, stop)[0]

  def _per_layer(self):
    """The scanned layers' data: rope_index [L] int32, and i -> layer i's window (0, the
    Python int, where the config has no window at all)."""
    windows = jnp.asarray(layer_windows(self.cfg))
    return (jnp.asarray(rope_index(self.cfg)),
            (lambda i: windows[i]) if self.cfg.sliding_window else (lambda i: 0))

  def ln_f(self, x: jax.Array) -> jax.Array:
    """The final norm (named as GPT-2's so that callers of `m.ln_f` work for every family)."""
    return self.norm(x)

  def head(self, x: jax.Array) -> jax.Array:
    """Final norm, then the output table: [B, T, d] -> logits [B, T, V] float32."""
    x = self.norm(x).astype(jnp.float32)
    if self.cfg.tie_embeddings:
      return self.embed_tokens.attend(x)
    return jnp.einsum("...d,vd->...v", x, self.variables["params"]["lm_head"])

  def blocks_step(self, x_t: jax.Array, cache: jax.Array, t: jax.Array, start: int, stop: int):
    """One position through blocks start..stop-1 with a KV cache.

    Args:
      x_t: [d] residual input at position t.
      cache: [stop - start, 2, T_max, H_kv, D] keys (rotated) and values of the prefix.
      t: scalar int position.

    Returns:
      (h_t [d], kv_t [stop - start, 2, H_kv, D]).
    """
    cfg = self.cfg
    if not layer_stack.is_stacked(self):
      new_kv = []
      for i in range(start, stop):
        x_t, k_t, v_t = self.layers[i].step(x_t, cache[i - start, 0], cache[i - start, 1], t,
                                            *rope_cos_sin(cfg, t, i), cfg.window(i))
        new_kv.append(jnp.stack([k_t, v_t.astype(k_t.dtype)]))
      return x_t, jnp.stack(new_kv)
    cos, sin = rope_tables(cfg, t)
    rope, window = self._per_layer()

    def layer(m, x_t, i, cache_i):
      x_t, k_t, v_t = m.step(x_t, cache_i[0], cache_i[1], t, cos[rope[i]], sin[rope[i]],
                             window(i))
      return x_t, jnp.stack([k_t, v_t.astype(k_t.dtype)])

    return layer_stack.scan(self, Layer(cfg, parent=None), layer, x_t, start, stop, cache,
                            first_apart=True)


def init_params(cfg: DecoderConfig, key: jax.Array) -> dict:
  return Decoder(cfg).init(key, jnp.zeros((1, 2), jnp.int32))["params"]


def random_params(cfg: DecoderConfig, seed: int, std: float = 0.02) -> dict:
  """`init_params`' tree drawn with numpy from `seed` (norm weights 1 or 0, biases 0)."""
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    name = path[-1].key
    if name in ("scale", "bias"):
      one = name == "scale" and cfg.norm != "rmsnorm_1p"
      return jnp.full(leaf.shape, 1.0 if one else 0.0, jnp.float32)
    return jnp.asarray(std * rng.standard_normal(leaf.shape, dtype=np.float32))

  return jax.tree_util.tree_map_with_path(
      draw, jax.eval_shape(lambda key: init_params(cfg, key), jax.random.key(0)))
