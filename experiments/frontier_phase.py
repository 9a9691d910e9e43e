"""The main job's FLOP-matched frontier phase alone, with what it needs and nothing else.

  python -m experiments.frontier_phase --workdir=runs/main
  python -m experiments.frontier_phase --workdir=runs/main --config=configs/main_table.py:paper

It runs the main job's pre-training (cached in WORKDIR/pretrain) and fine-tunes only the
frontier's target (the first model seed at the primary setting, cached in
WORKDIR/finetune), then the frontier sweep exactly as lla.study.main_table.flop_frontier
runs it (WORKDIR/frontier, resumable), then its report (lla.sweep.frontier) into
WORKDIR/frontier/report. The sweep's wall time, the share of attack pairs compared at a
common FLOP level and the per-level table are printed and written to
WORKDIR/frontier/phase.json.
"""

import json
import pathlib
import time

from absl import app, flags
from ml_collections import config_flags

from lla import data, runtime
from lla.study import main_table
from lla.sweep import frontier

_CONFIG = config_flags.DEFINE_config_file("config", "configs/main_table.py:cpu",
                                          "Main-table config.", lock_config=False)
_WORKDIR = flags.DEFINE_string("workdir", "runs/main", "The main job's run directory.")


def main(argv):
  del argv
  runtime.configure()
  config = _CONFIG.value
  workdir = pathlib.Path(_WORKDIR.value)
  primary = (int(config.primary_cut), "public")
  config.settings = (primary,)
  config.finetune.num_models = 1
  splits = data.load_splits(**config.data.to_dict())
  start = time.perf_counter()
  base, base_source = main_table.base_model(config, workdir, splits)
  targets = main_table.fine_tuned_targets(config, workdir, splits, base, base_source)
  prepared = time.perf_counter()
  main_table.flop_frontier(config, workdir, targets, base_source)
  swept = time.perf_counter()
  study = workdir / main_table.FRONTIER / "study"
  lines = frontier.report(str(study), str(workdir / main_table.FRONTIER / "report"),
                          **frontier.report_options(config.frontier.sweep))
  table = json.loads((workdir / main_table.FRONTIER / "report" / frontier.TABLE).read_text())
  summary = {"prepare_s": prepared - start, "frontier_s": swept - prepared,
             "pairs": table["summary"]}
  (workdir / main_table.FRONTIER / "phase.json").write_text(json.dumps(summary, indent=1) + "\n")
  print("\n".join(lines))
  print(json.dumps(summary, indent=1))


if __name__ == "__main__":
  app.run(main)
