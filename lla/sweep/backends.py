"""Where cells run: in process, on Ray actors, or as submitit (Slurm) jobs.

Every backend takes groups of cells (lla.sweep.cells.groups) and yields (cell, result) as
cells finish, a result being a worker.CellResult or the exception that stopped the cell.
Cells of one group run in order on one worker, which keeps their shared Workspace; groups
run in parallel. No backend writes results: the driver does.

* `local`: one in-process Worker, cell after cell.
* `ray`: long-lived actors (one per node by default, or `actors` of them), each holding a
  Worker, so compiled executables and Workspaces stay warm across cells. An actor that
  dies (its process killed, its node lost) is restarted by Ray and its cell retried
  (`max_retries`); the cell's result still reaches the driver once. `address="auto"` joins
  a running cluster (`ray start`), an empty address starts a local one.
* `submitit`: one job per group (Slurm, or `cluster="local"` to run the jobs as local
  processes); a failed job is submitted again up to `max_retries` times.
"""

from __future__ import annotations

import collections
import os
import time
from typing import Iterator

from absl import logging

from lla import allocator
from lla import runtime
from lla.sweep import worker as worker_lib

NAMES = ("local", "ray", "submitit")
# Environment a remote worker needs to run the same code with the same settings.
FORWARDED_ENV_PREFIXES = ("LLA_", "JAX_", "XLA_")


def _forwarded_env() -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}
  # The driver's compilation cache, wherever it came from (lla.runtime), so that no worker
  # compiles what another, or the driver, did.
  env.update(runtime.worker_environment())
  # A Ray worker runs its threads before it imports lla: glibc's arena limit must be in
  # the environment it starts with (lla/allocator.py).
  tunables = allocator.environment_for_workers().get(allocator.TUNABLES_ENV_VAR)
  if tunables:
    env[allocator.TUNABLES_ENV_VAR] = tunables
  paths = [os.getcwd()] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
  env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
  return env


class Local:
  """Cells in this process, one after the other."""

  def __init__(self, workdir: str):
    self._worker = worker_lib.Worker(workdir)

  def run(self, groups) -> Iterator:
    for group in groups:
      for cell in group:
        try:
          result = self._worker.run(cell)
        except Exception as e:  # The cell failed; the others still run.
          logging.exception("cell %s failed", cell.cell_id)
          result = e
        yield cell, result

  def close(self) -> None:
    pass


class _CellActor:
  """A Ray actor: one Worker, warm across every cell it is given."""

  def __init__(self, workdir: str):
    runtime.configure()
    self._worker = worker_lib.Worker(workdir)

  def run(self, cell):
    import ray  # pylint: disable=g-import-not-at-top
    result = self._worker.run(cell)
    result.worker["node_id"] = ray.get_runtime_context().get_node_id()
    return result


class Ray:
  """Cells on long-lived Ray actors (see the module doc)."""

  def __init__(self, workdir: str, address: str = "", actors: int = 0, cpus_per_actor: float = 1,
               gpus_per_actor: float = 0, tpu_chips_per_actor: int = 0, max_retries: int = 3):
    import ray  # pylint: disable=g-import-not-at-top
    self._ray = ray
    if not ray.is_initialized():
      ray.init(address=address or None, include_dashboard=False,
               runtime_env={"env_vars": _forwarded_env()}, log_to_driver=False)
    nodes = [n for n in ray.nodes() if n["Alive"]]
    count = actors or len(nodes)
    remote = ray.remote(_CellActor).options(
        num_cpus=cpus_per_actor, num_gpus=gpus_per_actor,
        resources={"TPU": tpu_chips_per_actor} if tpu_chips_per_actor else None,
        max_restarts=max_retries,
        max_task_retries=max_retries, scheduling_strategy="SPREAD")
    self._actors = [remote.remote(workdir) for _ in range(count)]
    logging.info("ray: %d actors on %d nodes", count, len(nodes))

  def run(self, groups) -> Iterator:
    ray = self._ray
    waiting = collections.deque(groups)
    queues = [collections.deque() for _ in self._actors]
    in_flight = {}

    def feed(i: int) -> None:
      if not queues[i] and waiting:
        queues[i].extend(waiting.popleft())
      if queues[i]:
        cell = queues[i].popleft()
        in_flight[self._actors[i].run.remote(cell)] = (i, cell)

    for i in range(len(self._actors)):
      feed(i)
    while in_flight:
      (done,), _ = ray.wait(list(in_flight), num_returns=1)
      i, cell = in_flight.pop(done)
      try:
        result = ray.get(done)
      except Exception as e:  # Retries exhausted, or the cell itself failed.
        logging.error("cell %s failed: %s", cell.cell_id, e)
        result = e
      yield cell, result
      feed(i)

  def close(self) -> None:
    for actor in self._actors:
      self._ray.kill(actor)


def run_group(workdir: str, group, environment: dict[str, str] | None = None) -> list:
  """A submitit job: the cells of one group on one Worker; [(cell_id, result or error)].
  `environment`: the driver's compilation cache (lla.runtime.worker_environment)."""
  os.environ.update(environment or {})
  runtime.configure()
  worker = worker_lib.Worker(workdir)
  out = []
  for cell in group:
    try:
      out.append((cell.cell_id, worker.run(cell)))
    except Exception as e:  # Reported per cell; the group's other cells still run.
      out.append((cell.cell_id, e))
  return out


class Submitit:
  """One submitit job per group (see the module doc)."""

  def __init__(self, workdir: str, cluster: str | None = None, max_retries: int = 2,
               poll_s: float = 1.0, **parameters):
    import submitit  # pylint: disable=g-import-not-at-top
    self._workdir = workdir
    self._executor = submitit.AutoExecutor(folder=os.path.join(workdir, "submitit", "%j"),
                                           cluster=cluster)
    self._executor.update_parameters(name="lla-sweep", **parameters)
    self._max_retries, self._poll_s = max_retries, poll_s

  def _submit(self, group):
    return self._executor.submit(run_group, self._workdir, group, runtime.worker_environment())

  def run(self, groups) -> Iterator:
    jobs = {self._submit(group): (group, 0) for group in groups}
    while jobs:
      finished = [job for job in jobs if job.done()]
      if not finished:
        time.sleep(self._poll_s)
        continue
      for job in finished:
        group, attempt = jobs.pop(job)
        try:
          results = dict(job.result())
        except Exception as e:  # The job died (killed, preempted, out of memory).
          if attempt < self._max_retries:
            logging.warning("submitit job %s failed (%s); submitting its group again",
                            job.job_id, e)
            jobs[self._submit(group)] = (group, attempt + 1)
            continue
          results = {cell.cell_id: e for cell in group}
        for cell in group:
          yield cell, results[cell.cell_id]

  def close(self) -> None:
    pass


def make(name: str, workdir: str, **options):
  if name not in NAMES:
    raise ValueError(f"--backend={name!r}: expected one of {', '.join(NAMES)}")
  cls = {"local": Local, "ray": Ray, "submitit": Submitit}[name]
  try:
    return cls(workdir, **options)
  except ImportError as e:
    extra = {"ray": "ray", "submitit": "slurm"}[name]
    raise ImportError(f"--backend={name} needs {e.name}: pip install -e \".[{extra}]\"") from e

