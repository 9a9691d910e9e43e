"""Probe: does this backend's XLA cost analysis count what the FLOP meter assumes?

The workspace meter (lla.attacks.workspace) charges an attack XLA's FLOP count of each
executable it ran, and a compiled loop (`scan_steps`) as its body counted once times the
trip count. On CPU both hold (tests/test_attacks_flops.py). On an H200 the activation
beam's XLA count came out 67 times below its analytic count (docs/kernels.md), so this
binary isolates the pieces, each against a count by hand:

  matmul       one [n, n] @ [n, n] product: 2 n^3
  scan         `scan_steps` over `trips` such products (one per step): XLA's count of the
               executable, which the meter multiplies by `trips`, against 2 n^3 per step
  client       the first `cut` blocks of a random GPT-2 of `n_embd` on [docs, T] tokens:
               against lla.model.cost's count of the same blocks

and prints, per piece, XLA's count, the count by hand and their ratio (1 where the meter's
assumption holds; the client's ratio is near 1, its hand count being the matmuls alone).

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
  """{piece: {"xla", "by_hand", "ratio"}} on the default backend (module docstring)."""
  xla = lambda executable: workspace._flops_of(executable)  # pylint: disable=protected-access
  a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n), dtype=np.float32))
  pieces = {"matmul": (xla(_matmul.lower(a, a).compile()), 2.0 * n**3)}
  xs = (jnp.zeros((trips, n, n), jnp.float32),)
  loop = workspace.scan_steps.lower((a,), a, xs, step=_square_step).compile()
  counted = xla(loop)
  pieces["scan"] = (None if counted is None else counted * trips, 2.0 * n**3 * trips)
  cfg = GPT2Config(vocab_size=512, n_positions=seq_len, n_embd=n_embd, n_head=4, n_layer=cut + 1)
  tokens = jnp.zeros((docs, seq_len), jnp.int32)
  client = split.client.lower(random_params(cfg, 0), cfg, tokens, cut).compile()
  pieces["client"] = (xla(client), docs * seq_len * cut * cost.token_block_flops(cfg, seq_len))
  return {name: {"xla": got, "by_hand": want, "ratio": None if got is None else got / want}
          for name, (got, want) in pieces.items()}


def main(argv):
  del argv
  device = jax.devices()[0]
  results = probe(_N.value, _TRIPS.value, _N_EMBD.value, _CUT.value, _DOCS.value,
                  _SEQ_LEN.value)
  print(f"XLA's FLOP counts on {device.device_kind} ({device.platform}), jax {jax.__version__}")
  print(f"{'piece':8s}{'xla':>14s}{'by hand':>14s}{'ratio':>9s}")
  for name, r in results.items():
    got = "none" if r["xla"] is None else f"{r['xla']:.4g}"
    ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
    print(f"{name:8s}{got:>14s}{r['by_hand']:>14.4g}{ratio:>9s}")
  if _OUT_JSON.value:
    with open(_OUT_JSON.value, "w") as f:
      json.dump({"device_kind": device.device_kind, "platform": device.platform,
                 "jax_version": jax.__version__, "pieces": results}, f, indent=2,
                sort_keys=True)
    print(f"wrote {_OUT_JSON.value}")


if __name__ == "__main__":
  app.run(main)
