"""Writes the inputs of the scale-out tests: python tests/scaleout_inputs.py OUT

OUT/hf (a random tiny GPT-2: V = 512, d = 32, 3 layers), OUT/tokens.npy (12 evaluation
documents of 8 tokens), OUT/cal.npy (24 calibration documents) and OUT/cap (a training
capture at k = 2). Run in a subprocess: the pytest process never imports JAX.
"""

import pathlib
import sys

import numpy as np

from lla.capture import capture
from lla.model import hf_io
from lla.model.gpt2 import GPT2Config

from test_attacks_units import random_params

CFG = GPT2Config(vocab_size=512, n_positions=16, n_embd=32, n_head=4, n_layer=3)


def main(out: pathlib.Path) -> None:
  hf_io.save_hf_dir(random_params(CFG, seed=3, std=0.05), CFG, out / "hf")
  params, _ = hf_io.load_hf_dir(out / "hf")
  rng = np.random.default_rng(3)
  tokens = rng.integers(0, CFG.vocab_size, (12, 8)).astype(np.int32)
  np.save(out / "tokens.npy", tokens)
  np.save(out / "cal.npy", rng.integers(0, CFG.vocab_size, (24, 8)).astype(np.int32))
  capture.capture_target(str(out / "cap"), params, CFG, tokens, range(12), 2, model_id="tiny",
                         training=True, batch_size=6)


if __name__ == "__main__":
  main(pathlib.Path(sys.argv[1]))
