"""The cut-point split of PROTOCOL section 1, as pure jit-compiled functions.

The client holds tokens `x [B, T]` and sends the forward message
`h = blocks[0..k-1](wte[x] + wpe[0..T-1])`, `[B, T, d]` (no `ln_f`). The server runs
`blocks[k..L-1]`, `ln_f` and the tied head; in training it returns the backward message
`g = dL/dh` for the mean next-token cross-entropy over all `B * (T - 1)` positions.

`cfg` (hashable) and the cut `k` are static arguments: each (model, cut) compiles once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from lla.model.gpt2 import GPT2, GPT2Config


def _check_cut(cfg: GPT2Config, k: int) -> None:
  if not 1 <= k < cfg.n_layer:
    raise ValueError(f"cut k={k} must satisfy 1 <= k < n_layer={cfg.n_layer}")


def wte(params) -> jax.Array:
  """The token embedding matrix `[V, d]` (also the tied output head)."""
  return params["wte"]["embedding"]


@functools.partial(jax.jit, static_argnames=("cfg", "k"))
def client(params, cfg: GPT2Config, tokens: jax.Array, k: int) -> jax.Array:
  """Forward message: tokens [B, T] int -> h [B, T, d] float32."""
  _check_cut(cfg, k)
  model = GPT2(cfg)
  x = model.apply({"params": params}, tokens, method=GPT2.embed)
  h = model.apply({"params": params}, x, 0, k, method=GPT2.blocks)
  return h.astype(jnp.float32)


def _server_logits(params, cfg: GPT2Config, h: jax.Array, k: int) -> jax.Array:
  model = GPT2(cfg)
  x = model.apply({"params": params}, h, k, cfg.n_layer, method=GPT2.blocks)
  return model.apply({"params": params}, x, method=GPT2.head)


def next_token_loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  """Mean CE of logits[b, t] against tokens[b, t+1] over all B * (T-1) positions."""
  ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:])
  return ce.mean()


@functools.partial(jax.jit, static_argnames=("cfg", "k"))
def server_loss(params, cfg: GPT2Config, h: jax.Array, tokens: jax.Array, k: int):
  """Server side: h [B, T, d], tokens [B, T] -> (loss scalar, logits [B, T, V])."""
  _check_cut(cfg, k)
  logits = _server_logits(params, cfg, h, k)
  return next_token_loss(logits, tokens), logits


@functools.partial(jax.jit, static_argnames=("cfg", "k"))
def boundary_messages(params, cfg: GPT2Config, tokens: jax.Array, k: int):
  """Both messages of one training step: (h [B, T, d], g = dL/dh [B, T, d]).

  One forward through the client, one forward + VJP through the server.
  """
  h = client(params, cfg, tokens, k)
  loss_of_h = lambda h_: next_token_loss(_server_logits(params, cfg, h_, k), tokens)
  g = jax.grad(loss_of_h)(h)
  return h, g


@functools.partial(jax.jit, static_argnames=("cfg",))
def logits(params, cfg: GPT2Config, tokens: jax.Array) -> jax.Array:
  """The whole model: tokens [B, T] -> logits [B, T, V]."""
  return GPT2(cfg).apply({"params": params}, tokens)


def lm_loss(params, cfg: GPT2Config, tokens: jax.Array) -> jax.Array:
  """Mean next-token CE of the whole model (differentiable; jit at the caller)."""
  return next_token_loss(GPT2(cfg).apply({"params": params}, tokens), tokens)


def hidden_states(params, cfg: GPT2Config, tokens: jax.Array) -> list[jax.Array]:
  """HF's `output_hidden_states`: embeddings, each block's output, and ln_f of the last."""
  model = GPT2(cfg)
  x = model.apply({"params": params}, tokens, method=GPT2.embed)
  states = [x]
  for i in range(cfg.n_layer):
    x = model.apply({"params": params}, x, i, i + 1, method=GPT2.blocks)
    states.append(x)
  ln_f = lambda m, y: m.ln_f(y)
  states[-1] = model.apply({"params": params}, x, method=ln_f)
  return states


# --- KV-cached incremental client -------------------------------------------------------


def init_cache(cfg: GPT2Config, k: int, max_len: int) -> jax.Array:
  """An empty client cache for one sequence: [k, 2, max_len, H, D] float32."""
  return jnp.zeros((k, 2, max_len, cfg.n_head, cfg.head_dim), jnp.float32)


def client_step_kv(params, cfg: GPT2Config, cache: jax.Array, token_t: jax.Array,
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
  model = GPT2(cfg)
  x_t = model.apply({"params": params}, token_t[None], t, method=GPT2.embed)[0]
  h_t, kv_t = model.apply({"params": params}, x_t, cache, t, 0, cache.shape[0],
                          method=GPT2.blocks_step)
  return h_t.astype(jnp.float32), kv_t


def client_step_embedding(params, cfg: GPT2Config, cache: jax.Array, e_t: jax.Array,
                          t: jax.Array):
  """`client_step_kv` from a continuous input embedding e_t [d] in place of wte[token_t].

  Differentiable in e_t: SipIt's gradient policy descends on it.
  """
  x_t = e_t + jnp.asarray(params["wpe"]["embedding"])[t]
  h_t, kv_t = GPT2(cfg).apply({"params": params}, x_t, cache, t, 0, cache.shape[0],
                              method=GPT2.blocks_step)
  return h_t.astype(jnp.float32), kv_t


def write_cache(cache: jax.Array, kv_t: jax.Array, t: jax.Array) -> jax.Array:
  """cache [k, 2, T_max, H, D] with kv_t [k, 2, H, D] written at position t."""
  return jax.lax.dynamic_update_slice_in_dim(cache, kv_t[:, :, None].astype(cache.dtype), t, axis=2)


def client_step(params, cfg: GPT2Config, cache: jax.Array, token_t: jax.Array, t: jax.Array):
  """KV-cached client: (h_t [d], cache with position t written). Batch it with vmap."""
  h_t, kv_t = client_step_kv(params, cfg, cache, token_t, t)
  return h_t, write_cache(cache, kv_t, t)
