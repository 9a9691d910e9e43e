"""The two parties' shares of one GPT-2 and the server's forward, used by both sides.

The client computes with wte, wpe and blocks 0..k-1; the server with blocks k..L-1, ln_f
and the head. A real split unties the head: the server holds its own copy of wte (the
tied-head joint fine-tune of lla.train shares it). The client also keeps a copy of the
public pre-trained tail for its reference detector and its task-loss evaluator, so this
module is neither party's code: it imports nothing of either.
"""

from __future__ import annotations

import jax

from lla.model.gpt2 import GPT2, GPT2Config
from lla.train import loop


def client_params(params: dict, k: int) -> dict:
  """The client's share of a GPT-2: wte, wpe and blocks 0..k-1."""
  return {name: params[name] for name in loop.client_layer_names(k)}


def tail_params(params: dict, cfg: GPT2Config, k: int) -> dict:
  """The server's share: blocks k..L-1, ln_f and its own copy of wte for the head."""
  return {**{f"h_{i}": params[f"h_{i}"] for i in range(k, cfg.n_layer)},
          "ln_f": params["ln_f"], "wte": params["wte"]}


def tail_logits(tail: dict, cfg: GPT2Config, h: jax.Array, k: int) -> jax.Array:
  """The server's forward: h [B, T, d] -> logits [B, T, V] (blocks k.., ln_f, head)."""
  model = GPT2(cfg)
  x = model.apply({"params": tail}, h, k, cfg.n_layer, method=GPT2.blocks)
  return model.apply({"params": tail}, x, method=GPT2.head)
