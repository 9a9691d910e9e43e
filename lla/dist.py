"""One job across processes with jax.distributed: start-up, the leader, and agreement.

A replay or the main job can run as one job over several processes (hosts, or several
processes on one host). Every process runs the same binary; `initialize` comes before any
JAX computation and connects them (explicit coordinator address, process count and id, or
jax.distributed's auto-detection under Slurm, Open MPI and on TPU pod slices). Then:

* Process 0 leads: it runs the job and is the only process that writes. The others follow
  (lla.replay.driver.follow): for each replay the leader announces, they load the same
  capture and attacker and compute their share of every document chunk, because the
  `docs` mesh spans the devices of every process (lla.attacks.workspace).
* Control messages (a replay request, the end of the job: small JSON) go through the
  coordination service's key-value store with long timeouts, since the leader may train
  for an hour before its first replay. Data (each chunk's results and a status) goes
  through `multihost_utils.process_allgather`, an XLA collective (gloo on CPU).
* A dead peer closes its sockets, so the survivors' next collective fails at once
  (`PeerLostError`), and the coordination service, missing the peer's heartbeats for
  HEARTBEAT_TIMEOUT_S, terminates every survivor. Only process 0 writes, and only
  finished results (atomically), so nothing partial is left behind.
"""

from __future__ import annotations

import builtins
import contextlib
import ipaddress
import json
import os
import socket
import sys
from typing import Any

import jax
import numpy as np
from absl import logging

MODES = ("off", "auto")
HEARTBEAT_TIMEOUT_S = 30     # a peer silent this long is dead: every process is terminated
INITIALIZATION_TIMEOUT_S = 300
CONTROL_TIMEOUT_S = 7 * 24 * 3600  # followers wait this long for the leader's next message
STATUS_BYTES = 16384         # a chunk status (JSON) as exchanged between processes


EXIT_JOB_FAILED = 75  # EX_TEMPFAIL: the job lost a process; start every process again


class JobError(RuntimeError):
  """The job across processes cannot go on; never recorded as an attack's own failure."""


class PeerLostError(JobError):
  """A collective failed: another process of the job died or became unreachable."""


class DivergedError(JobError):
  """The processes of one job reached different collectives (a bug, or a one-sided fault)."""


def _is_loopback(address: str) -> bool:
  host = address.rsplit(":", 1)[0].strip("[]")
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return host == "localhost"


def initialize(mode: str = "off", coordinator_address: str | None = None,
               num_processes: int | None = None, process_id: int | None = None) -> bool:
  """Connects this process to the others of its job; returns whether it is distributed.

  Args:
    mode: "off" (one process unless the explicit arguments below are given) or "auto"
      (jax.distributed detects what is not given: Slurm, Open MPI, TPU pod slices).
    coordinator_address: "host:port" of process 0's coordination service.
    num_processes, process_id: the job's size and this process's rank.

  A loopback coordinator address makes process 0's coordination service listen on
  loopback only (jax's default binds every interface).

  Raises:
    ValueError: an unknown mode, or explicit arguments that are incomplete or out of range
      (a process id outside 0..num_processes-1).
    RuntimeError: a JAX backend is already initialised (a computation ran first).
  """
  if mode not in MODES:
    raise ValueError(f"--dist={mode!r}: expected one of {', '.join(MODES)}")
  given = {"coordinator_address": coordinator_address, "num_processes": num_processes,
           "process_id": process_id}
  if mode == "off" and not any(v is not None for v in given.values()):
    return False
  missing = [f"--{k}" for k, v in given.items() if v is None]
  if mode == "off" and missing:
    raise ValueError(f"a job across processes needs {', '.join(missing)} too (or --dist=auto "
                     "to detect them under Slurm, Open MPI or on a TPU pod slice)")
  if num_processes is not None and num_processes < 1:
    raise ValueError(f"--num_processes={num_processes}: a job has at least 1 process")
  if process_id is not None and not (0 <= process_id < (num_processes or process_id + 1)):
    ranks = "0 or more" if num_processes is None else f"0..{num_processes - 1}"
    raise ValueError(f"--process_id={process_id} is out of range: the ranks of a job of "
                     f"--num_processes={num_processes} are {ranks}")
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  if xla_bridge.backends_are_initialized():
    raise RuntimeError("lla.dist.initialize must run before any JAX computation (a backend "
                       "is already initialised)")
  bind = coordinator_address if coordinator_address and _is_loopback(coordinator_address) \
      else None
  jax.distributed.initialize(
      coordinator_address=coordinator_address, num_processes=num_processes,
      process_id=process_id, coordinator_bind_address=bind,
      initialization_timeout=INITIALIZATION_TIMEOUT_S,
      heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S)
  local = agree({"local_devices": jax.local_device_count(), "host": socket.gethostname()})
  counts = sorted({s["local_devices"] for s in local})
  if len(counts) != 1:
    raise ValueError(f"every process needs the same number of local devices, got {counts} "
                     f"({[s['host'] for s in local]})")
  logging.info("lla.dist: process %d of %d, %d local of %d devices", jax.process_index(),
               jax.process_count(), jax.local_device_count(), jax.device_count())
  return True


def process_count() -> int:
  return jax.process_count()


def process_index() -> int:
  return jax.process_index()


def is_leader() -> bool:
  """Whether this process leads (and alone writes): process 0, or the only process."""
  return jax.process_index() == 0


def gather_documents(tree):
  """Each process's [n, ...] arrays concatenated in process order: [P * n, ...] numpy,
  the same on every process."""
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  try:
    return multihost_utils.process_allgather(tree, tiled=True)
  except Exception as e:  # XLA reports a closed peer connection as a runtime error.
    raise PeerLostError(f"a peer process died or became unreachable while gathering results "
                        f"({e})") from e


def agree(status: dict) -> list[dict]:
  """Every process's `status` (small JSON), in process order, on every process."""
  data = json.dumps(status, sort_keys=True).encode()
  if len(data) > STATUS_BYTES:
    raise ValueError(f"status of {len(data)} bytes exceeds {STATUS_BYTES}")
  if process_count() == 1:
    return [json.loads(data)]
  buffer = np.zeros(STATUS_BYTES, np.uint8)
  buffer[:len(data)] = np.frombuffer(data, np.uint8)
  gathered = np.asarray(gather_documents(buffer)).reshape(process_count(), STATUS_BYTES)
  return [json.loads(bytes(row).rstrip(b"\0")) for row in gathered]


def _client():
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  client = distributed.global_state.client
  if client is None:
    raise RuntimeError("lla.dist: not a job across processes (initialize was not called)")
  return client


_sent = [0]
_received = [0]


def send(message: dict) -> None:
  """Leader -> every follower: the next control message (JSON)."""
  _client().key_value_set(f"lla/control/{_sent[0]}", json.dumps(message))
  _sent[0] += 1


def receive(timeout_s: float = CONTROL_TIMEOUT_S) -> dict:
  """Follower: the leader's next control message (blocks until it is sent)."""
  value = _client().blocking_key_value_get(f"lla/control/{_received[0]}",
                                           int(timeout_s * 1000))
  _received[0] += 1
  return json.loads(value)


@contextlib.contextmanager
def leading():
  """The leader's job: when it ends, however it ends, the followers are told so (with the
  error, if any) and stop. A lost process ends this one at once (`fail_fast`)."""
  if process_count() == 1:
    yield
    return
  try:
    yield
  except BaseException as e:
    send({"type": "exit", "error": f"{type(e).__name__}: {e}"})
    if isinstance(e, JobError):
      fail_fast(e)
    raise
  send({"type": "exit", "error": None})


@contextlib.contextmanager
def following():
  """A follower's part: a lost process ends this one at once (`fail_fast`)."""
  try:
    yield
  except JobError as e:
    fail_fast(e)


def fail_fast(error: JobError) -> None:
  """Ends this process now with EXIT_JOB_FAILED, naming the error: waiting for the lost
  peer at jax.distributed's shutdown barrier would take minutes. Nothing is being written
  (the leader writes only finished results, atomically), so nothing partial is left."""
  message = (f"lla.dist: process {process_index()} of {process_count()}: {error}; the job "
             "stops (finished results are kept; start every process again to resume)")
  logging.error(message)
  print(message, file=sys.stderr, flush=True)
  os._exit(EXIT_JOB_FAILED)  # pylint: disable=protected-access


def remote_error(status: dict) -> Exception:
  """The exception another process raised (by its type name if it is a builtin one)."""
  kind = getattr(builtins, status["error_type"], None)
  if not (isinstance(kind, type) and issubclass(kind, Exception)):
    kind = RuntimeError
  try:
    return kind(status["error"])
  except Exception:  # An exception type that does not take one message.
    return RuntimeError(f"{status['error_type']}: {status['error']}")


def describe() -> dict[str, Any]:
  """The job's topology, for manifests."""
  return {"process_count": jax.process_count(), "device_count": jax.device_count(),
          "local_device_count": jax.local_device_count()}
