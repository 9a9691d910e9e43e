"""Sizes of a model read from its config: what the analytic FLOP and memory models count.

One place for the arithmetic the attacks' cost models (lla.attacks.flops, lla.attacks.memory
and every attack's own formula) need, for `GPT2Config` and for the RoPE families'
`DecoderConfig` alike (both expose `n_embd` d, `n_head` H, `n_kv_head` H_kv, `head_dim` D,
`d_ff` I, `mlp`, `norm`, `positions`, `tie_embeddings`):

  attention_width       H D                  query heads x head size (GPT-2: d)
  kv_width              H_kv D               key (or value) heads x head size (GPT-2: d)
  block_weights         d H D + 2 d H_kv D + H D d + m d I
                                             weight-matrix entries of one block: q, k, v, o
                                             and the MLP's m matrices (m = 3 gated: gate,
                                             up, down; m = 2 gelu: up, down). GPT-2: 12 d^2
  token_block_flops     2 block_weights + 4 T H D
                                             one token through one block attending to T
                                             positions: every weight matrix once (2 FLOPs an
                                             entry), scores and values 2 T H D each (per
                                             query head: keys shared under GQA are still
                                             multiplied once per query head).
                                             GPT-2: 24 d^2 + 4 T d
  block_params          block_weights + biases + norms     every parameter of one block
  param_count           the whole model's parameter count (embeddings, learned positions,
                        blocks, final norm, an untied head)

For a `GPT2Config` every function returns exactly the integers the GPT-2 formulas used
before (12 d^2, 12 d^2 + 13 d, d), so GPT-2's analytic FLOPs are unchanged bit for bit
(tests/test_attacks_flops.py pins them). Only matrix products are counted: norms,
activations, softmax, RoPE and the embedding scale are elementwise, and a sliding window is
a mask over the full score matrix, which is computed in full (so T counts every position).
"""

from __future__ import annotations


def attention_width(cfg) -> int:
  """H * D: the width of the concatenated query heads (and of o_proj's input)."""
  return cfg.n_head * cfg.head_dim


def kv_width(cfg) -> int:
  """H_kv * D: the width of the keys (and of the values); H * D without GQA."""
  return cfg.n_kv_head * cfg.head_dim


def mlp_matrices(cfg) -> int:
  """Weight matrices of the MLP: 3 gated (gate, up, down), 2 otherwise (up, down)."""
  return 3 if cfg.mlp in ("swiglu", "geglu") else 2


def block_weights(cfg) -> int:
  """Weight-matrix entries of one block (q, k, v, o and the MLP; no biases or norms)."""
  d, a, kv = cfg.n_embd, attention_width(cfg), kv_width(cfg)
  return d * a + 2 * d * kv + a * d + mlp_matrices(cfg) * d * cfg.d_ff


def token_block_flops(cfg, context: int) -> float:
  """Matmul FLOPs of one token through one block that attends to `context` positions."""
  return 2.0 * block_weights(cfg) + 4.0 * context * attention_width(cfg)


def _gpt2(cfg) -> bool:
  return cfg.family == "gpt2"


def norm_params(cfg, width: int) -> int:
  """Parameters of one norm over `width`: LayerNorm scale and bias, RMSNorm a scale."""
  return 2 * width if cfg.norm == "layernorm" else width


def block_biases(cfg) -> int:
  """Bias entries of one block (GPT-2: every projection has one, 9 d)."""
  gpt2 = _gpt2(cfg)
  d, a, kv, i = cfg.n_embd, attention_width(cfg), kv_width(cfg), cfg.d_ff
  qkv = (a + 2 * kv) if gpt2 or cfg.qkv_bias else 0
  out = d if gpt2 or cfg.o_bias else 0
  mlp = ((mlp_matrices(cfg) - 1) * i + d) if gpt2 or cfg.mlp_bias else 0
  return qkv + out + mlp


def block_params(cfg) -> int:
  """Every parameter of one block: weights, biases, its two norms (four with Gemma-3's
  sandwich norms; and the q/k norms over head_dim of Qwen3 and Gemma-3). GPT-2: 12 d^2 + 13 d."""
  qk_norm = 0 if _gpt2(cfg) or not cfg.qk_norm else 2 * cfg.head_dim
  norms = 4 if not _gpt2(cfg) and cfg.sandwich_norms else 2
  return (block_weights(cfg) + block_biases(cfg) + norms * norm_params(cfg, cfg.n_embd)
          + qk_norm)


def embedding_params(cfg) -> int:
  """The input token table V d, plus GPT-2's learned position table n_positions d."""
  positions = cfg.n_positions * cfg.n_embd if cfg.positions == "learned" else 0
  return cfg.vocab_size * cfg.n_embd + positions


def head_params(cfg) -> int:
  """The output table's own parameters: V d when untied (`lm_head`), 0 when tied."""
  return 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.n_embd


def param_count(cfg) -> int:
  """Every parameter of the model: embeddings, the blocks, the final norm, the head."""
  return (embedding_params(cfg) + cfg.n_layer * block_params(cfg)
          + norm_params(cfg, cfg.n_embd) + head_params(cfg))
