"""The two parties' shares of one model, used by both sides (the server's forward on its
share is `lla.model.split.server_logits`).

The client computes with the input table (and GPT-2's wpe) and blocks 0..k-1; the server
with blocks k..L-1, the final norm and the head (`lla.model.split` names the groups of
every family). A real split unties the head: the server holds its own copy of the output
table (the tied-head joint fine-tune of lla.train shares it). The client also keeps a copy
of the public pre-trained tail for its reference detector and its task-loss evaluator, so
this module is neither party's code: it imports nothing of either.
"""

from __future__ import annotations

from lla.model import split


def client_params(params: dict, k: int) -> dict:
  """The client's share: the groups of `split.client_layer_names`."""
  return {name: params[name] for name in split.client_layer_names(params, k)}


def tail_params(params: dict, cfg: split.ModelConfig, k: int) -> dict:
  """The server's share: blocks k..L-1, the final norm and its own copy of the head."""
  return {name: params[name] for name in split.server_layer_names(params, cfg, k)}

