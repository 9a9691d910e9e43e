"""The sweep driver: expands the grid, skips finished cells, runs the rest, writes results.

    WORKDIR/study/      the lla.evidence study (lla.sweep.study); only this process writes it
    WORKDIR/captures/   captures, content-addressed (written by workers, once)
    WORKDIR/frontier/   the FLOP-matched comparison, when the config asks for it

A config with FLOP levels (`frontier.levels`) has its knobbed attacks placed at them first
(lla.sweep.isoflop). Everything is checked before anything runs (every cell's attacks and
budget). Finished cells are verified by hash and skipped, so a killed sweep resumes. Results are written as cells
finish, whichever backend ran them; a cell that failed is reported and left unwritten, so
the next run retries it. The study is sealed (lla.evidence.rundir.finalize) whenever a run
ends, and reopened by the next one that has cells to add, so it always verifies with
`python -m experiments.verify --workdir=WORKDIR/study`.
"""

from __future__ import annotations

import dataclasses
import os
import time

import ml_collections
from absl import logging
from tqdm import tqdm

from lla.evidence import rundir
from lla.sweep import backends, cells as cells_lib, isoflop, study as study_lib
from lla.sweep import worker as worker_lib

FRONTIER = "frontier"


class SweepError(RuntimeError):
  """Some cells failed; the others are written."""


@dataclasses.dataclass(frozen=True)
class Summary:
  cells: int
  skipped: int          # finished before this run
  ran: int
  failed: dict          # cell id -> error
  wall_s: float
  study: str


def run(config: ml_collections.ConfigDict, workdir: str, backend: str = "local",
        only: tuple[str, ...] = (), **backend_options) -> Summary:
  """Runs (or resumes) the sweep of `config` in `workdir`.

  Args:
    only: cell ids to run (a subset of the grid); empty: every cell.
    backend_options: passed to the backend (lla.sweep.backends).

  Raises:
    SweepError: after writing every cell that finished, if any failed.
  """
  start = time.perf_counter()
  if isoflop.absolute_levels(config):
    # Iso-FLOP levels: each attack of `frontier.knobs` placed at each level (lla.sweep.isoflop).
    logging.info("%s", isoflop.describe(config))
  cells = cells_lib.expand(isoflop.resolve(config))
  if only:
    unknown = sorted(set(only) - {c.cell_id for c in cells})
    if unknown:
      raise cells_lib.SweepConfigError(f"--cells: no cell {', '.join(unknown)} in this sweep")
    cells = [c for c in cells if c.cell_id in only]
  study = os.path.join(workdir, worker_lib.STUDY)
  # One writer from the first check of the study to its seal: a second sweep on the same
  # workdir is refused before it writes anything (its threat space included).
  with rundir.locked(study, what="sweep"):
    return _run_locked(cells, config, workdir, study, backend, start, backend_options)


def _run_locked(cells, config, workdir, study, backend, start, backend_options) -> Summary:
  study_lib.open_study(study, config.policy, config.name)
  done = {c.cell_id: study_lib.finished(study, c) for c in cells}
  todo = [c for c in cells if done[c.cell_id] is None]
  failed = {}
  if todo:
    # A finished (sealed) study is reopened and sealed again: a sweep can grow.
    with rundir.extending(study, always_finalize=True):
      for cell in todo:
        study_lib.discard_orphans(study, cell)
      runner = backends.make(backend, workdir, **backend_options)
      groups = cells_lib.groups(todo)
      logging.info("sweep: %d cells (%d finished before), %d groups, backend %s", len(cells),
                   len(cells) - len(todo), len(groups), backend)
      try:
        with tqdm(total=len(cells), initial=len(cells) - len(todo), unit="cell",
                  desc=f"sweep ({backend})") as bar:
          for cell, result in runner.run(groups):
            if isinstance(result, BaseException):
              failed[cell.cell_id] = f"{type(result).__name__}: {result}"
              bar.set_postfix(failed=len(failed))
            else:
              study_lib.write_cell(study, cell, result)
            bar.update()
      finally:
        runner.close()
  summary = Summary(len(cells), len(cells) - len(todo), len(todo) - len(failed), failed,
                    time.perf_counter() - start, study)
  if failed:
    raise SweepError(f"{len(failed)} of {len(cells)} cells failed (the others are written; "
                     "run again to retry them): " + "; ".join(
                         f"{k}: {v}" for k, v in sorted(failed.items())))
  return summary
