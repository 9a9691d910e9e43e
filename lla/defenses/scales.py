"""The scales a defense's public parameters are set from, measured on a model and passages.

A noise or clipping parameter means nothing without the size of what it acts on: d_chi
noise on the input embeddings has E||z|| = d / epsilon, so epsilon is chosen against the
median norm r of the input rows of the tokens the client sends (`input_row_norms`);
DP-Forward clips each sequence's forward message to C, chosen at the median per-sequence
Frobenius norm of h at the cut (`message_norms`), so that about half the sequences are
clipped. configs/main_table.py's DX_PRIVACY_EPSILONS and DP_FORWARD_CLIP quote these
figures; `python -m experiments.defense_scales` prints them for any model.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from lla.model import split


def input_row_norms(params, tokens: np.ndarray) -> np.ndarray:
  """||table[x]|| of every token of tokens [N, T], [N * T] (the unscaled input table)."""
  table = np.asarray(split.input_table(params), np.float64)
  return np.linalg.norm(table[np.asarray(tokens).reshape(-1)], axis=1)


def message_norms(params, cfg, tokens: np.ndarray, cut: int, batch_size: int = 32) -> np.ndarray:
  """||h||_F of each passage's undefended forward message at `cut`, tokens [N, T] -> [N]."""
  tokens = np.asarray(tokens)
  out = []
  for i in range(0, len(tokens), batch_size):
    h = np.asarray(split.client(params, cfg, jnp.asarray(tokens[i:i + batch_size]), cut),
                   np.float64)
    out.append(np.linalg.norm(h.reshape(len(h), -1), axis=1))
  return np.concatenate(out)


def summary(params, cfg, tokens: np.ndarray, cut: int) -> dict:
  """The medians (and ranges) of both scales over tokens [N, T], JSON-ready."""
  rows, messages = input_row_norms(params, tokens), message_norms(params, cfg, tokens, cut)
  table = np.asarray(split.input_table(params), np.float64)
  return {"passages": int(len(tokens)), "seq_len": int(np.asarray(tokens).shape[1]),
          "cut": int(cut), "d": int(table.shape[1]),
          "input_row_norm_median": float(np.median(rows)),
          "input_row_norm_median_whole_table": float(np.median(np.linalg.norm(table, axis=1))),
          "message_frobenius_median": float(np.median(messages)),
          "message_frobenius_range": [float(messages.min()), float(messages.max())]}
