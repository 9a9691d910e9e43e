"""Flags of the binaries that run as one job across processes (lla.dist).

Every process runs the same command; process 0 leads and alone writes:

  python -m experiments.replay ... --coordinator_address=HOST0:PORT --num_processes=N \
      --process_id=$RANK
  srun --nodes=2 --ntasks-per-node=1 python -m experiments.replay ... --dist=auto
"""

from absl import flags

from experiments import cli
from lla import dist

_DIST = flags.DEFINE_enum(
    "dist", "off", dist.MODES,
    "off: one process unless the flags below are given; auto: jax.distributed detects the "
    "coordinator, process count and id (Slurm, Open MPI, TPU pod slices).")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0's coordination service.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the job.", lower_bound=1)
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's rank.", lower_bound=0)


def initialize() -> bool:
  """Connects this process to its job (before any JAX computation); whether it is one.

  Flags that are incomplete or out of range (a --process_id outside 0..num_processes-1) end
  the binary with one line on stderr and a non-zero exit.
  """
  with cli.one_line_errors(ValueError):
    return dist.initialize(_DIST.value, _COORDINATOR.value, _NUM_PROCESSES.value,
                           _PROCESS_ID.value)
