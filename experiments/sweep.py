"""Runs a sweep: a grid of replay cells, written into one study (lla.sweep).

  python -m experiments.sweep --config=configs/sweep.py:cpu --workdir=runs/sweep
  python -m experiments.sweep --config=configs/sweep.py:cpu --workdir=runs/sweep \
      --backend=ray --ray_address=auto                 # join a running Ray cluster
  python -m experiments.sweep --config=configs/sweep.py:cpu --workdir=runs/sweep \
      --backend=submitit --slurm_partition=gpu --slurm_gpus_per_node=1
  python -m experiments.sweep --config=configs/sweep.py:frontier_cpu --workdir=runs/frontier

Killed and started again with the same --workdir, it skips every finished cell (verified by
hash). configs/sweep.py documents the variants.
"""

from absl import flags
from ml_collections import config_flags

from experiments import cli
from lla import runtime
from lla.sweep import backends, driver, frontier

_CONFIG = config_flags.DEFINE_config_file("config", "configs/sweep.py:cpu", "Sweep config.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Sweep directory (resumed if it exists).",
                               required=True)
_BACKEND = flags.DEFINE_enum("backend", "local", backends.NAMES, "Where cells run.")
_CELLS = flags.DEFINE_list("cells", [], "Run only these cell ids (default: every cell).")
_RAY_ADDRESS = flags.DEFINE_string(
    "ray_address", "", "Ray cluster to join ('auto': the one `ray start` runs here; empty: "
    "start a local one).")
_RAY_ACTORS = flags.DEFINE_integer("ray_actors", 0, "Actors (0: one per node).", lower_bound=0)
_RAY_CPUS = flags.DEFINE_float("ray_cpus_per_actor", 1, "CPUs each actor reserves.")
_RAY_GPUS = flags.DEFINE_float("ray_gpus_per_actor", 0, "GPUs each actor reserves.")
_RAY_TPUS = flags.DEFINE_integer("ray_tpu_chips_per_actor", 0,
                                 "TPU chips each actor reserves (all of its host's).")
_MAX_RETRIES = flags.DEFINE_integer("max_retries", 3, "Retries of a cell whose worker died.")
_SUBMITIT_CLUSTER = flags.DEFINE_string(
    "submitit_cluster", None, "submitit cluster: slurm, local or debug (default: slurm if "
    "available, else local).")
_SLURM_PARTITION = flags.DEFINE_string("slurm_partition", None, "Slurm partition.")
_SLURM_GPUS = flags.DEFINE_integer("slurm_gpus_per_node", None, "GPUs per Slurm job.")
_SLURM_TIMEOUT = flags.DEFINE_integer("slurm_timeout_min", 240, "Slurm time limit per job.")


def _backend_options() -> dict:
  if _BACKEND.value == "ray":
    return dict(address=_RAY_ADDRESS.value, actors=_RAY_ACTORS.value,
                cpus_per_actor=_RAY_CPUS.value, gpus_per_actor=_RAY_GPUS.value,
                tpu_chips_per_actor=_RAY_TPUS.value, max_retries=_MAX_RETRIES.value)
  if _BACKEND.value == "submitit":
    slurm = {k: v for k, v in (("slurm_partition", _SLURM_PARTITION.value),
                               ("slurm_gpus_per_node", _SLURM_GPUS.value)) if v is not None}
    return dict(cluster=_SUBMITIT_CLUSTER.value, max_retries=_MAX_RETRIES.value,
                timeout_min=_SLURM_TIMEOUT.value, **slurm)
  return {}


def main(argv):
  del argv
  runtime.configure()
  # A failed cell is named with its error (the rest written); a bad grid, budget, plugin,
  # study or lock is refused before any cell ran (lla's input errors: experiments.cli).
  with cli.one_line_errors(driver.SweepError, KeyError, workdir=_WORKDIR.value):
    summary = driver.run(_CONFIG.value, _WORKDIR.value, _BACKEND.value,
                         only=tuple(_CELLS.value), **_backend_options())
  print(f"sweep: {summary.cells} cells ({summary.skipped} finished before, {summary.ran} run) "
        f"in {summary.wall_s:.1f} s -> {summary.study}")
  if _CONFIG.value.frontier.enabled and not _CELLS.value:
    for line in frontier.report(summary.study, f"{_WORKDIR.value}/{driver.FRONTIER}",
                                **frontier.report_options(_CONFIG.value)):
      print(line)


if __name__ == "__main__":
  cli.run(main)
