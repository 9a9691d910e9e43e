"""What a sweep cell's config fixes of an attack's FLOP model: the target's shape, the cut,
the documents and calibration documents (`shape_of`), and a cell at one rung of its knob
ladders (`rung_cell`). Below both the level placement (lla.sweep.isoflop) and the ladders
placed from the target (lla.sweep.ladders), which each read it."""

from __future__ import annotations

import copy
from typing import Sequence

import numpy as np

from lla.model.gpt2 import GPT2Config
from lla.sweep import cells as cells_lib

TOLERANCE = 1.5  # default: within a factor 1.5 of a level, both ways


def _npy_rows(path: str) -> tuple[int, ...]:
  return tuple(np.load(path, mmap_mode="r").shape)


def shape_of(cell: dict) -> dict:
  """The arguments of lla.attacks.flops.attack_flops that a cell config fixes."""
  target, data = cell["target"], cell["data"]
  cfg = GPT2Config(vocab_size=int(target["vocab_size"]), n_positions=int(target["n_positions"]),
                   n_embd=int(target["n_embd"]), n_layer=int(target["n_layer"]),
                   n_head=int(target["n_head"]))
  if data.get("tokens_npy"):
    num_docs, seq_len = _npy_rows(data["tokens_npy"])[:2]
    n_calibration = _npy_rows(data["calibration_npy"])[0]
  else:
    num_docs, seq_len = int(data["n_eval"]), int(data["seq_len"])
    n_calibration = int(data["n_calibration"])
  return dict(cfg=cfg, cut=int(cell["cut"]), num_docs=num_docs, seq_len=seq_len,
              n_calibration=n_calibration)


def rung_cell(base: dict, knobs: Sequence[tuple[str, Sequence]], rung: int) -> dict:
  """A copy of the cell config `base` with rung `rung` of every knob path assigned."""
  cell = copy.deepcopy(base)
  for path, ladder in knobs:
    cells_lib.assign(cell, path, ladder[rung])
  return cell
