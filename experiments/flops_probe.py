"""Probe: does this backend's XLA cost analysis count what the FLOP meter assumes?

The workspace meter (lla.attacks.workspace) charges an attack XLA's FLOP count of each
compiled executable it ran (one device's share times the devices), and a compiled loop
(`scan_steps`) as its body counted once times the trip count. On an H200 that count came
out 67 times below the activation beam's analytic count (docs/kernels.md; XLA:GPU's count
of a compiled executable leaves out the matmuls it hands to cuBLAS, jax-ml/jax#22249).
This binary isolates the pieces, each counted both ways, compiled (what the meter reads)
and lowered (the program before the backend rewrites it, the candidate fix), against a
count by hand:

  matmul       one [n, n] @ [n, n] product: 2 n^3
  scan         `scan_steps` over `trips` such products (one per step): XLA's count of the
               executable, which the meter multiplies by `trips`, against 2 n^3 per step
  client       the first `cut` blocks of a random GPT-2 of `n_embd` on [docs, T] tokens:
               against lla.model.cost's count of the same blocks

and prints, per piece, both counts, the count by hand and their ratios to it (1 where the
meter's assumption holds; the client's are near 1, its hand count being the matmuls
alone).

  python -m experiments.flops_probe --out_json=/tmp/flops_probe.json
"""

from __future__ import annotations

import json

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from lla.attacks import workspace
from lla.model import cost
from lla.model import split
from lla.model.gpt2 import GPT2Config, random_params

_N = flags.DEFINE_integer("n", 512, "Matrix side of the matmul pieces.")
_TRIPS = flags.DEFINE_integer("trips", 16, "Steps of the scanned loop.")
_N_EMBD = flags.DEFINE_integer("n_embd", 256, "Width of the client's random GPT-2.")
_CUT = flags.DEFINE_integer("cut", 2, "Client blocks.")
_DOCS = flags.DEFINE_integer("docs", 4, "Documents of the client piece.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 32, "Tokens per document T.")
_OUT_JSON = flags.DEFINE_string("out_json", "", "Where to write the results (JSON).")


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


def main(argv):
  del argv
  device = jax.devices()[0]
  results = probe(_N.value, _TRIPS.value, _N_EMBD.value, _CUT.value, _DOCS.value,
                  _SEQ_LEN.value)
  print(f"XLA's FLOP counts on {device.device_kind} ({device.platform}), jax {jax.__version__}")
  print(f"{'piece':8s}{'by hand':>12s}{'lowered':>12s}{'ratio':>8s}{'compiled':>12s}"
        f"{'ratio':>8s}")
  show = lambda value, spec: "none" if value is None else format(value, spec)
  for name, r in results.items():
    print(f"{name:8s}{r['by_hand']:12.4g}{show(r['lowered'], '.4g'):>12s}"
          f"{show(r['lowered_ratio'], '.3f'):>8s}{show(r['compiled'], '.4g'):>12s}"
          f"{show(r['compiled_ratio'], '.3f'):>8s}")
  if _OUT_JSON.value:
    with open(_OUT_JSON.value, "w") as f:
      json.dump({"device_kind": device.device_kind, "platform": device.platform,
                 "jax_version": jax.__version__, "pieces": results}, f, indent=2,
                sort_keys=True)
    print(f"wrote {_OUT_JSON.value}")


if __name__ == "__main__":
  app.run(main)
