"""experiments/profile_beam.py: its attribution of the beam loop's operations, on the tiny model.

Every top-level instruction of the compiled loop gets one kind; the block's projections are
the matrix products the model's Dense layers name, attention's own work is named attention;
and the binary's reported shares add up to the traced operations it read.
"""

import json
import os
from pathlib import Path
import subprocess
import sys

import numpy as np

from configs import models
from lla.train import models as models_lib
from experiments import profile_beam
from lla.attacks.seed import beam
from lla.attacks import workspace
from lla.model.gpt2 import random_params

ROOT = Path(__file__).resolve().parent.parent


def test_classify_names_the_projections_and_attention_of_every_block():
  spec = models.get_config("tiny")
  cfg = models_lib.gpt2_config(spec)
  k, docs, seq_len, num, width = 2, 3, 6, 4, 2
  rng = np.random.default_rng(0)
  target = rng.standard_normal((docs, seq_len, cfg.n_embd), dtype=np.float32)
  candidates = rng.integers(0, cfg.vocab_size, (docs, seq_len, num)).astype(np.int32)
  state = beam.start(target, cfg=cfg, k=k, width=width)
  text = workspace.scan_steps.lower((random_params(cfg, 0),), state,
                                    beam.positions(target, candidates), step=beam.step,
                                    static=(("cfg", cfg),)).compile().as_text()
  kinds = profile_beam.classify(text)
  assert set(kinds.values()) <= {"projection GEMMs", "attention", "fused GEMM+other", "other"}
  lines = {line.split(" = ")[0].strip().removeprefix("ROOT ").lstrip("%"): line
           for line in text.splitlines() if " = " in line}
  projections = [n for n, kind in kinds.items() if kind == "projection GEMMs"]
  # Each block's c_fc product (or its fusion with elementwise work) is there for both blocks.
  named = lambda n, what: what in lines[n]
  for block in range(k):
    assert any(named(n, f"h_{block}.step/mlp/c_fc") for n in kinds
               if kinds[n] in ("projection GEMMs", "fused GEMM+other")), block
  assert all("dot_general" in lines[n] for n in projections)
  assert any(kind == "attention" for kind in kinds.values())


def test_binary_shares_add_up(tmp_path):
  out = tmp_path / "profile.json"
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.profile_beam", "--model=tiny", "--docs=3",
       "--cut=2", "--seq_len=6", "--candidates=4", "--repeats=1", "--matmul_n=64",
       f"--out_json={out}"],
      cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
      timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  result = json.loads(out.read_text())
  assert result["traced_op_s"] > 0 and result["by_kind_s"]["projection GEMMs"] > 0
  np.testing.assert_allclose(sum(result["by_kind_s"].values()), result["traced_op_s"])
  np.testing.assert_allclose(sum(result["by_kind_share"].values()), 1.0)
  flops = beam.analytic_flops(models_lib.gpt2_config(models.get_config("tiny")), 2, 3, 2, 4, 6)
  assert result["analytic_flops"] == flops

