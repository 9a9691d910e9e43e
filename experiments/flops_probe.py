"""Probe: does this backend's XLA cost analysis count what the FLOP meter assumes?

A matmul, a scanned loop and a client, each counted as compiled (what the meter reads) and
as lowered, against counts by hand (lla.attacks.xla_counts); the first step of
experiments/device_check.sh, since an H200's compiled count left out the matmuls
(docs/kernels.md). Ratios of 1 mean the count holds.

  python -m experiments.flops_probe --out_json=/tmp/flops_probe.json
"""

from __future__ import annotations

import json

from absl import app, flags
import jax

from lla.attacks import xla_counts

_N = flags.DEFINE_integer("n", 512, "Matrix side of the matmul pieces.")
_TRIPS = flags.DEFINE_integer("trips", 16, "Steps of the scanned loop.")
_N_EMBD = flags.DEFINE_integer("n_embd", 256, "Width of the client's random GPT-2.")
_CUT = flags.DEFINE_integer("cut", 2, "Client blocks.")
_DOCS = flags.DEFINE_integer("docs", 4, "Documents of the client piece.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 32, "Tokens per document T.")
_OUT_JSON = flags.DEFINE_string("out_json", "", "Where to write the results (JSON).")


def main(argv):
  del argv
  device = jax.devices()[0]
  results = xla_counts.probe(_N.value, _TRIPS.value, _N_EMBD.value, _CUT.value, _DOCS.value,
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
