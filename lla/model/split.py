"""The cut-point split of PROTOCOL section 1, as pure jit-compiled functions.

The client holds tokens `x [B, T]` and sends the forward message
`h = blocks[0..k-1](wte[x] + wpe[0..T-1])`, `[B, T, d]` (no `ln_f`). The server runs
`blocks[k..L-1]`, `ln_f` and the tied head; in training it returns the backward message
`g = dL/dh` for the mean next-token cross-entropy over all `B * (T - 1)` positions.

`cfg` (hashable) and the cut `k` are static arguments: each (model, cut) compiles once.
`cfg` is a `GPT2Config` or, for the RoPE families (llama, mistral, qwen2, qwen3, gemma), a
`lla.model.decoder.DecoderConfig`: there the client is `blocks[0..k-1](embed_tokens[x] *
embed_scale)` with positions applied inside attention, and the head may be untied
(`output_table`).

Every function here takes either form of the parameters: the HF-named tree (the layers
unrolled) or its computation form (`computation_form`: the layers stacked once, a range of
them one scanned layer body, so a program's size does not grow with k or the depth).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from lla.model import decoder
from lla.model import gpt2
from lla.model import layer_stack
from lla.model.decoder import Decoder, DecoderConfig
from lla.model.gpt2 import GPT2, GPT2Config

ModelConfig = GPT2Config | DecoderConfig


def module(cfg: ModelConfig):
  """The Flax module of a config: `GPT2` for `GPT2Config`, `Decoder` for the RoPE families.

  Both have the entry points `embed`, `blocks(x, start, stop)`, `ln_f`, `head`, `blocks_step`.
  """
  if isinstance(cfg, DecoderConfig):
    return Decoder(cfg)
  return GPT2(cfg)


def init_params(cfg: ModelConfig, key: jax.Array) -> dict:
  """A random initialisation of the model of `cfg` (either family's own init)."""
  if isinstance(cfg, DecoderConfig):
    return decoder.init_params(cfg, key)
  return gpt2.init_params(cfg, key)


def computation_form(params: dict, cfg: ModelConfig) -> dict:
  """The parameters with their layers stacked along a leading axis, made once per tree
  (`lla.model.layer_stack.computation_form`); a share without every layer is returned as
  it is. Pass this to the functions here, or to a jitted function that calls them, rather
  than the HF-named tree, to compile one layer body whatever the depth."""
  return layer_stack.computation_form(params, cfg.n_layer)


def _check_cut(cfg: ModelConfig, k: int) -> None:
  if not 1 <= k < cfg.n_layer:
    raise ValueError(f"cut k={k} must satisfy 1 <= k < n_layer={cfg.n_layer}")


def input_table(params) -> jax.Array:
  """The input token embedding table `[V, d]` (GPT-2's `wte`, the RoPE families'
  `embed_tokens`), unscaled: Gemma multiplies it by `cfg.embed_scale` on input.

  Ridge targets, nearest-row decoding and relaxed one-hot inputs read this table."""
  if "wte" in params:
    return params["wte"]["embedding"]
  return params["embed_tokens"]["embedding"]


def output_table(params) -> jax.Array:
  """The output head `[V, d]`: logits = final_norm(x) @ output_table^T. Equal to
  `input_table` when the head is tied (GPT-2, most small models), `lm_head` otherwise.

  Gradient-ranked candidates and the downstream linearisation read this table."""
  if "lm_head" in params:
    return params["lm_head"]
  return input_table(params)


def client_layer_names(params, k: int) -> tuple[str, ...]:
  """Top-level parameter groups the client of cut k computes with: GPT-2's wte, wpe and
  h_0..h_{k-1}; the RoPE families' embed_tokens and layers_0..layers_{k-1}."""
  if "wte" in params:
    return ("wte", "wpe", *(f"h_{i}" for i in range(k)))
  return ("embed_tokens", *(f"layers_{i}" for i in range(k)))


def server_layer_names(params, cfg: ModelConfig, k: int) -> tuple[str, ...]:
  """The groups the server of cut k computes with: blocks k..L-1, the final norm and the
  output head (GPT-2's and a tied family's head is the input table, `lm_head` otherwise)."""
  if "wte" in params:
    return (*(f"h_{i}" for i in range(k, cfg.n_layer)), "ln_f", "wte")
  head = "lm_head" if "lm_head" in params else "embed_tokens"
  return (*(f"layers_{i}" for i in range(k, cfg.n_layer)), "norm", head)


def server_logits(params, cfg: ModelConfig, h: jax.Array, k: int) -> jax.Array:
  """The server's forward: h [B, T, d] -> logits [B, T, V] (blocks k.., final norm, head).
  `params` needs only the `server_layer_names` groups."""
  model = module(cfg)
  x = model.apply({"params": params}, h, k, cfg.n_layer, method="blocks")
  return model.apply({"params": params}, x, method="head")


def wte(params) -> jax.Array:
  """The token embedding matrix `[V, d]`; for GPT-2 also the tied output head.
  Kept for existing callers: it is `input_table`."""
  return input_table(params)


@functools.partial(jax.jit, static_argnames=("cfg", "k"))
def client(params, cfg: ModelConfig, tokens: jax.Array, k: int) -> jax.Array:
  """Forward message: tokens [B, T] int -> h [B, T, d] float32."""
  _check_cut(cfg, k)
  model = module(cfg)
  x = model.apply({"params": params}, tokens, method="embed")
  h = model.apply({"params": params}, x, 0, k, method="blocks")
  return h.astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("cfg", "k"))
def client_from_embeddings(params, cfg: ModelConfig, e: jax.Array, k: int) -> jax.Array:
  """`client` from input token embeddings e [B, T, d] (rows of the unscaled `input_table`,
  HF's `inputs_embeds`) in place of input_table[tokens]: positions (GPT-2's wpe) or the
  embed scale (Gemma) are applied here, as `embed` does. The hook of defenses on the input
  embeddings (lla.defenses.dx_privacy); with e = input_table[tokens] it is `client`."""
  _check_cut(cfg, k)
  if isinstance(cfg, DecoderConfig):  # RoPE: the position enters in the blocks
    x = e * jnp.float32(cfg.embed_scale) if cfg.embed_scale != 1.0 else e
  else:
    x = e + jnp.asarray(params["wpe"]["embedding"])[:e.shape[-2]]
  h = module(cfg).apply({"params": params}, x, 0, k, method="blocks")
  return h.astype(jnp.float32)


def next_token_loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  """Mean CE of logits[b, t] against tokens[b, t+1] over all B * (T-1) positions."""
  ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:])
  return ce.mean()


@functools.partial(jax.jit, static_argnames=("cfg", "k"))
def server_loss(params, cfg: ModelConfig, h: jax.Array, tokens: jax.Array, k: int):
  """Server side: h [B, T, d], tokens [B, T] -> (loss scalar, logits [B, T, V])."""
  _check_cut(cfg, k)
  logits = server_logits(params, cfg, h, k)
  return next_token_loss(logits, tokens), logits


@functools.partial(jax.jit, static_argnames=("cfg", "k"))
def boundary_messages(params, cfg: ModelConfig, tokens: jax.Array, k: int):
  """Both messages of one training step: (h [B, T, d], g = dL/dh [B, T, d]).

  One forward through the client, one forward + VJP through the server.
  """
  h = client(params, cfg, tokens, k)
  loss_of_h = lambda h_: next_token_loss(server_logits(params, cfg, h_, k), tokens)
  g = jax.grad(loss_of_h)(h)
  return h, g


@functools.partial(jax.jit, static_argnames=("cfg",))
def logits(params, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
  """The whole model: tokens [B, T] -> logits [B, T, V]."""
  return module(cfg).apply({"params": params}, tokens)


def lm_loss(params, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
  """Mean next-token CE of the whole model (differentiable; jit at the caller)."""
  return next_token_loss(module(cfg).apply({"params": params}, tokens), tokens)


def hidden_states(params, cfg: ModelConfig, tokens: jax.Array) -> list[jax.Array]:
  """HF's `output_hidden_states`: embeddings, each block's output, and ln_f of the last."""
  model = module(cfg)
  x = model.apply({"params": params}, tokens, method="embed")
  states = [x]
  for i in range(cfg.n_layer):
    x = model.apply({"params": params}, x, i, i + 1, method="blocks")
    states.append(x)
  ln_f = lambda m, y: m.ln_f(y)
  states[-1] = model.apply({"params": params}, x, method=ln_f)
  return states


# --- KV-cached incremental client -------------------------------------------------------


def init_cache(cfg: ModelConfig, k: int, max_len: int) -> jax.Array:
  """An empty client cache for one sequence: [k, 2, max_len, H_kv, D] float32 (H_kv = H for
  GPT-2; fewer with GQA)."""
  return jnp.zeros((k, 2, max_len, cfg.n_kv_head, cfg.head_dim), jnp.float32)


def client_step_kv(params, cfg: ModelConfig, cache: jax.Array, token_t: jax.Array,
                   t: jax.Array):
  """Client output at position t without writing the cache.

  Args:
    cache: [k, 2, T_max, H, D] keys/values of positions < t of one sequence; its leading
      size is the cut k.
    token_t: scalar int token at position t.
    t: scalar int position.

  Returns:
    (h_t [d], kv_t [k, 2, H, D]). Beam search evaluates many candidate tokens against one
    prefix cache: returning only the new row avoids materialising a cache per candidate;
    `write_cache` commits the rows of the survivors.
  """
  model = module(cfg)
  x_t = model.apply({"params": params}, token_t[None], t, method="embed")[0]
  h_t, kv_t = model.apply({"params": params}, x_t, cache, t, 0, cache.shape[0],
                          method="blocks_step")
  return h_t.astype(jnp.float32), kv_t


def client_step_embedding(params, cfg: ModelConfig, cache: jax.Array, e_t: jax.Array,
                          t: jax.Array):
  """`client_step_kv` from a continuous input embedding e_t [d] in place of wte[token_t].

  Differentiable in e_t: SipIt's gradient policy descends on it.
  """
  if isinstance(cfg, DecoderConfig):  # RoPE: the position enters in the blocks
    x_t = e_t * jnp.float32(cfg.embed_scale) if cfg.embed_scale != 1.0 else e_t
  else:
    x_t = e_t + jnp.asarray(params["wpe"]["embedding"])[t]
  h_t, kv_t = module(cfg).apply({"params": params}, x_t, cache, t, 0, cache.shape[0],
                              method="blocks_step")
  return h_t.astype(jnp.float32), kv_t


def write_cache(cache: jax.Array, kv_t: jax.Array, t: jax.Array) -> jax.Array:
  """cache [k, 2, T_max, H, D] with kv_t [k, 2, H, D] written at position t."""
  return jax.lax.dynamic_update_slice_in_dim(cache, kv_t[:, :, None].astype(cache.dtype), t, axis=2)


def client_step(params, cfg: ModelConfig, cache: jax.Array, token_t: jax.Array, t: jax.Array):
  """KV-cached client: (h_t [d], cache with position t written). Batch it with vmap."""
  h_t, kv_t = client_step_kv(params, cfg, cache, token_t, t)
  return h_t, write_cache(cache, kv_t, t)
