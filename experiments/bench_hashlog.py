r"""Time per append of the hash-chained study log as it grows (lla.evidence.hashlog).

  python -m experiments.bench_hashlog [--entries=10000 --window=100] [--out_json=PATH]

Appends `--entries` events shaped like a study's record entries (file name, run id,
status, sha256) to a fresh log in a temporary directory, each one fsync'ed, and reports
the mean wall time per append over the `--window` appends that end at 1,000 and at
`--entries` (and at every power of ten in between): flat figures mean O(1) appends. The
finished log is verified once at the end (time reported too).
"""

from __future__ import annotations

import json
import os
import tempfile
import time

from absl import app, flags

from lla.evidence import hashlog

_ENTRIES = flags.DEFINE_integer("entries", 10_000, "Entries appended.")
_WINDOW = flags.DEFINE_integer("window", 100, "Appends averaged at each reported point.")
_OUT_JSON = flags.DEFINE_string("out_json", None, "Where to write the results as JSON.")


def _event(i: int) -> dict:
  return {"type": "record", "file": f"records/k6__public__m{i % 10}__s0__attack{i}.json",
          "run_id": f"k6/public/m{i % 10}/s0/attack{i}", "status": "ok",
          "sha256": f"{i:064x}"}


def main(argv):
  del argv
  n, window = _ENTRIES.value, _WINDOW.value
  points = sorted({p for p in (1_000, 10_000, 100_000, n) if window <= p <= n})
  with tempfile.TemporaryDirectory(prefix="lla-bench-hashlog-") as tmp:
    path = os.path.join(tmp, "log.jsonl")
    log = hashlog.HashLog(path)
    seconds = []
    for i in range(n):
      start = time.perf_counter()
      log.append(_event(i))
      seconds.append(time.perf_counter() - start)
    log.seal()
    start = time.perf_counter()
    report = hashlog.verify_log(path)
    verify_s = time.perf_counter() - start
    size = os.path.getsize(path)
  if not report.ok or report.n_entries != n + 1:
    raise SystemExit(f"benchmark log fails verification: {report.problems[:3]}")
  results = {
      "entries": n, "window": window, "log_bytes": size,
      "per_append_ms": {str(p): 1e3 * sum(seconds[p - window:p]) / window for p in points},
      "total_append_s": sum(seconds), "verify_s": verify_s,
  }
  for p in points:
    print(f"append #{p - window + 1}..{p}: {results['per_append_ms'][str(p)]:.3f} ms per "
          "append (fsync'ed)")
  print(f"{n} appends in {results['total_append_s']:.2f} s; log {size / 1e6:.2f} MB; full "
        f"verification {verify_s:.2f} s")
  if _OUT_JSON.value:
    with open(_OUT_JSON.value, "w") as f:
      json.dump(results, f, indent=1, sort_keys=True)
      f.write("\n")


if __name__ == "__main__":
  app.run(main)
