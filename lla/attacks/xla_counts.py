"""XLA's FLOP counts of small programs against counts by hand: does the meter hold here?

The workspace meter (lla.attacks.workspace) charges an attack XLA's FLOP count of each
compiled executable it ran (one device's share times the devices), and a compiled loop
(`scan_steps`) as its body counted once times the trip count, on the platforms where that
was checked (`workspace.XLA_COUNT_CHECKED`). On an H200 the count came out 67 times below
the activation beam's analytic count (docs/kernels.md; XLA:GPU's count of a compiled
executable leaves out the matmuls it hands to cuBLAS, jax-ml/jax#22249). `probe` isolates
the pieces, each counted both ways, compiled (what the meter reads) and lowered (the
program before the backend rewrites it, the candidate fix), against a count by hand:

  matmul       one [n, n] @ [n, n] product: 2 n^3
  scan         `scan_steps` over `trips` such products (one per step), the count times
               `trips` as the meter takes it, against 2 n^3 per step
  client       the first `cut` blocks of a random GPT-2 of width `n_embd` on [docs, T]
               tokens, against lla.model.cost's count of the blocks' matmuls
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lla.attacks import workspace
from lla.model import cost
from lla.model import split
from lla.model.gpt2 import GPT2Config, random_params


@jax.jit
def _matmul(a, b):
  return a @ b


def _square_step(a, state, x):
  """One loop step: a matmul the loop cannot hoist (it reads the carried state)."""
  return jnp.tanh(state @ a + x[0])


def probe(n: int, trips: int, n_embd: int, cut: int, docs: int, seq_len: int) -> dict:
  """{piece: {"lowered", "compiled", "by_hand", "lowered_ratio", "compiled_ratio"}} on the
  default backend (module docstring); a count is None where the backend gives none."""
  flops_of = workspace._flops_of  # pylint: disable=protected-access
  a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n), dtype=np.float32))
  xs = (jnp.zeros((trips, n, n), jnp.float32),)
  cfg = GPT2Config(vocab_size=512, n_positions=seq_len, n_embd=n_embd, n_head=4,
                   n_layer=cut + 1)
  tokens = jnp.zeros((docs, seq_len), jnp.int32)
  pieces = {  # name: (lowered, times the meter multiplies its count by, count by hand)
      "matmul": (_matmul.lower(a, a), 1, 2.0 * n**3),
      "scan": (workspace.scan_steps.lower((a,), a, xs, step=_square_step), trips,
               2.0 * n**3 * trips),
      "client": (split.client.lower(random_params(cfg, 0), cfg, tokens, cut), 1,
                 docs * seq_len * cut * cost.token_block_flops(cfg, seq_len))}
  out = {}
  for name, (lowered, times, by_hand) in pieces.items():
    row = {"by_hand": by_hand}
    for way, stage in (("lowered", lowered), ("compiled", lowered.compile())):
      counted = flops_of(stage)
      row[way] = None if counted is None else counted * times
      row[f"{way}_ratio"] = None if counted is None else counted * times / by_hand
    out[name] = row
  return out
