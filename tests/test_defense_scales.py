"""The scales defense parameters are set from (lla.defenses.scales) and their binary."""

import json
import subprocess
import sys

import jax.numpy as jnp
import numpy as np

from lla.defenses import scales
from lla.model import hf_io, split
from lla.model.gpt2 import GPT2Config

from test_attacks_units import random_params

CFG = GPT2Config(vocab_size=50257, n_positions=32, n_embd=16, n_head=2, n_layer=2)


def test_row_and_message_norms_against_numpy():
  params = random_params(CFG, seed=0, std=0.1, emb_std=0.3)
  tokens = np.random.default_rng(1).integers(0, CFG.vocab_size, (7, 5))
  table = np.asarray(params["wte"]["embedding"], np.float64)
  expected_rows = [np.sqrt(sum(v * v for v in table[t])) for t in tokens.reshape(-1)]
  np.testing.assert_allclose(scales.input_row_norms(params, tokens), expected_rows, rtol=1e-12)
  # In batches of 3 (the last one short) as in one call, each passage's sqrt of its sum of
  # squares.
  h = np.asarray(split.client(params, CFG, jnp.asarray(tokens), 1), np.float64)
  expected_messages = np.sqrt((h ** 2).sum(axis=(1, 2)))
  np.testing.assert_allclose(scales.message_norms(params, CFG, tokens, 1, batch_size=3),
                             expected_messages, rtol=1e-6)
  figures = scales.summary(params, CFG, tokens, 1)
  assert figures["d"] == 16 and figures["passages"] == 7 and figures["seq_len"] == 5
  np.testing.assert_allclose(figures["input_row_norm_median"], np.median(expected_rows))
  np.testing.assert_allclose(figures["message_frobenius_median"],
                             np.median(expected_messages), rtol=1e-6)


def test_binary_prints_and_writes_the_figures_and_refuses_in_one_line(tmp_path, data_dir):
  hf_io.save_hf_dir(random_params(CFG, seed=2, std=0.1, emb_std=0.3), CFG, tmp_path / "hf")
  out = tmp_path / "scales.json"
  run = lambda *flags: subprocess.run(
      [sys.executable, "-m", "experiments.defense_scales", f"--data_dir={data_dir}", *flags],
      capture_output=True, text=True, timeout=600)
  done = run(f"--model_dir={tmp_path / 'hf'}", "--cut=1", "--passages=4", f"--out={out}")
  assert done.returncode == 0, done.stderr
  figures = json.loads(out.read_text())
  assert figures["passages"] == 4 and figures["cut"] == 1 and figures["d"] == 16
  lo, hi = figures["message_frobenius_range"]
  assert 0 < lo <= figures["message_frobenius_median"] <= hi
  missing = run(f"--model_dir={tmp_path / 'nowhere'}", "--cut=1")
  assert missing.returncode != 0 and "Traceback" not in missing.stderr
  lines = [line for line in missing.stderr.splitlines() if line.strip()]
  assert len(lines) == 1 and lines[0].startswith("defense_scales: "), missing.stderr
