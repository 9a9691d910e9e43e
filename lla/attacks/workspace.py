"""One capture and one attacker: the shared stages of a replay and the meter of what ran.

Attacks on one capture share stages (the ridge decoder, activation candidates, the
gradient ranking, a trained inverter). A `Workspace` computes each once, in document
chunks sized to a memory budget, sharded over the devices of a mesh axis `docs` when there
are several.

Every compiled computation an attack runs goes through `Workspace.call` (or the chunked
`map_call` / `map_documents`): it is compiled once per process for its (function, static
arguments, argument shapes) and reused across captures, attacks, seeds and chunks, and its
FLOPs are XLA's cost analysis of that very executable, added once per invocation. An
attack's FLOPs are therefore what it executed, loops included: XLA counts a loop body once,
so a loop either runs from Python, each iteration counted, or as one `Workspace.scan`,
whose executable is nothing but the loop and is charged its body's count times the trip
count (tested equal to the per-iteration sum). One exception: rows that a call is padded
with only so that fewer row counts compile (the buckets of documents still searching of
SipIt and `projection_adaptive`) are not the attack's work, and such a call is charged its real rows' share of XLA's count
(`real_fraction`; tested against the same search run unpadded). The chunks of
`map_documents`, padded to one size, are still charged whole. Shared
stages keep their own FLOPs, compile and wall time, and every attack that uses a stage is
charged its full cost, as if it had run alone; the record lists the stages it was charged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import re
import time
import types
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.lib import xla_client
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lla import dist
from lla import runtime
from lla.attacks import candidates as cand_lib
from lla.attacks import memory
from lla.attacks import ridge
from lla.attacks import withheld
from lla.model import cost
from lla.model import layer_stack
from lla.model import split
from lla.model.gpt2 import GPT2Config
from lla.protocol import tuple as protocol_tuple

# (jitted function, argument tree, argument signatures) ->
#     (executable, its dynamic keyword names, FLOPs per call or None).
_EXECUTABLES: dict = {}
runtime.register_executable_cache(_EXECUTABLES.clear)
STATUS_ERROR_CHARS = 2000  # of an error message passed between processes
# Platforms whose XLA FLOP count of a compiled executable was checked against counts by
# hand (tests/test_attacks_flops.py, lla.attacks.xla_counts). On an H200 it left out
# the matmuls (docs/kernels.md): elsewhere an attack is charged its analytic count.
XLA_COUNT_CHECKED = ("cpu",)
# How the attacks' model calls run the layers (`Workspace.layer_form`): "scanned" (the
# layers stacked once, a range of them one loop of a single layer body, so a program's size
# and compile time do not grow with the depth or the cut), "unrolled" (one copy of the
# layer per layer, the HF-named tree), or "auto": unrolled on CPU, scanned elsewhere. On
# CPU the scan compiles flat in the depth but does not run faster warm (every iteration
# copies its layer's weights out of the stack): at the `cpu` job's GPT-2 (8 layers, d 128,
# k = 6) the beam search and SipIt took 0.92-1.27x the unrolled warm time across runs, for
# equal first calls, and at SmolLM2's shape (30 layers) 1.05-1.06x, its first calls slower
# too (docs/benchmarks.md section 16, `bench_compile --forms`): the jobs' many documents run
# warm. Predictions and charged FLOPs are the same in either form (tests/test_attacks_flops.py).
LAYER_FORMS = ("auto", "scanned", "unrolled")


@functools.partial(jax.jit, static_argnames=("step", "static"))
def scan_steps(consts, state, xs, step, static=()):
  """`state` after `state = step(*consts, state, *x, **dict(static))` for each x along the
  leading axis of the pytree `xs`, as one XLA while loop.

  The positions of a beam search are such a loop. Driven from Python, every call would redo
  what the compiled loop hoists out of it once (weight layouts, broadcast constants): a
  quarter of a beam-search step on CPU.
  """
  body = lambda s, x: (step(*consts, s, *x, **dict(static)), None)
  return jax.lax.scan(body, state, xs)[0]


def run_steps(step, consts, state, xs, **static):
  """`scan_steps` unmetered (outside an attack); `Workspace.scan` is the metered twin."""
  return scan_steps(consts, state, xs, step=step, static=tuple(sorted(static.items())))


def _flops_of(executable, layer_loops: bool = True) -> float | None:
  """XLA's FLOPs of one call of a compiled executable, its layer loops counted in full
  (`_layer_loop_flops`; `layer_loops` False where its arguments hold no stacked layers,
  which spares reading its HLO text, 20-30 ms an executable); None without a count."""
  try:
    cost = executable.cost_analysis()
    loops = _layer_loop_flops(executable) if layer_loops else 0.0
  except Exception:  # Backends without cost analysis raise assorted errors.
    return None
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  if cost is None:
    return None
  # An executable without arithmetic (allocation, gathers) has no "flops" entry: zero.
  return max(float(cost.get("flops", 0.0)), 0.0) + loops


def _holds_layer_stack(tree) -> bool:
  """Whether a pytree holds a model's stacked layers (`layer_stack.STACK`), the only way a
  metered executable gets layer loops: attacks pass the parameters as arguments."""
  paths = jax.tree_util.tree_flatten_with_path(tree)[0]
  return any(getattr(key, "key", None) == layer_stack.STACK for path, _ in paths for key in path)


# A while loop over a model's layers (lla.model.layer_stack.scan) in compiled HLO text: its
# body computation and trip count.
_LAYER_LOOP = re.compile(r"\bwhile\(.*\bbody=%?([\w.\-]+).*op_name=\"[^\"]*"
                         + re.escape(layer_stack.LOOP_SCOPE)
                         + r"[^\"]*\".*\"known_trip_count\":\{\"n\":\"(\d+)\"\}")


def _layer_loop_flops(executable) -> float:
  """The FLOPs of every iteration but the first of the layer loops in a compiled executable.

  XLA's cost analysis counts a while loop's body once. Given the layers' computation form
  (`Workspace.model_params`) the models run a range of layers as one loop
  (`layer_stack.scan`), so the executable's count plus this is what ran, as with the layers
  unrolled (tested equal: tests/test_attacks_flops.py). Each loop body is counted by XLA as
  the entry of a copy of the module; a loop nested in another (the layers inside a beam
  search's positions) is added once per iteration of the outer body, which the outer
  loop's own multiplier (`Workspace.scan`'s trips) then scales. An executable without
  compiled HLO (a `Lowered`) has nothing added."""
  if not hasattr(executable, "runtime_executable"):
    return 0.0
  runtime_executable = executable.runtime_executable()
  text = runtime_executable.hlo_modules()[0].to_string()
  flops = 0.0
  for body, trips in _LAYER_LOOP.findall(text):
    lines = [line.removeprefix("ENTRY ") for line in text.splitlines()]
    lines = ["ENTRY " + line if re.match(rf"%?{re.escape(body)} ", line) else line
             for line in lines]
    module = xla_client.hlo.hlo_module_from_text("\n".join(lines))
    cost = xla_client._xla.hlo_module_cost_analysis(runtime_executable.client, module)  # pylint: disable=protected-access
    flops += (int(trips) - 1) * max(float(cost.get("flops", 0.0)), 0.0)
  return flops


def _signature(x):
  """A hashable stand-in for one argument leaf: arrays by type and placement, the rest
  (static configuration such as a GPT2Config or a cut) by value."""
  if isinstance(x, (jax.Array, np.ndarray, np.generic)):
    return jax.typeof(x), getattr(x, "sharding", None)
  return x


def compiled(jitted, *args, **kwargs):
  """(executable, the keyword arguments it takes, XLA FLOPs of one call or None, compile
  seconds spent now) of `jitted(*args, **kwargs)`.

  `jitted` must be a jax.jit-wrapped function defined once (module level), not a fresh
  wrapper: the cache is keyed by the function object, so that each (model, cut, budget,
  chunk shape) compiles once per process. Static arguments are passed by keyword.
  """
  leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
  key = (jitted, tree, tuple(_signature(x) for x in leaves),
         jax.config.jax_default_matmul_precision)
  if key in _EXECUTABLES:
    return (*_EXECUTABLES[key], 0.0)
  start = time.perf_counter()
  executable = jitted.lower(*args, **kwargs).compile()
  seconds = time.perf_counter() - start
  _, kwargs_tree = jax.tree_util.treedef_children(executable.in_tree)
  dynamic = tuple(kwargs_tree.node_data()[1])
  devices = max((len(x.sharding.device_set) for x in leaves if isinstance(x, jax.Array)),
                default=1)
  flops = _flops_of(executable, layer_loops=_holds_layer_stack((args, kwargs)))
  # A partitioned executable's cost analysis is per device.
  _EXECUTABLES[key] = (executable, dynamic, None if flops is None else flops * devices)
  return (*_EXECUTABLES[key], seconds)


@dataclasses.dataclass
class Tally:
  """What one scope (an attack's own work, or one shared stage) executed."""

  xla_flops: float = 0.0
  missing_xla: bool = False      # an executable ran without a cost analysis we trust
  analytic_flops: float = 0.0
  compile_s: float = 0.0
  wall_s: float = 0.0
  nested_wall_s: float = 0.0     # wall time of stages computed inside this scope
  start: float = dataclasses.field(default_factory=time.perf_counter)


@dataclasses.dataclass(frozen=True)
class StageCost:
  flops: float | None            # XLA's count; None if part of it ran without a trusted one
  analytic: float
  wall_s: float
  compile_s: float
  computed_by: str               # the attack during which it was computed

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Charge:
  """An attack's whole cost: its own work plus every shared stage it used."""

  flops: float
  flops_source: str              # "xla" or "analytic"
  flops_analytic: float
  wall_s: float
  compile_s: float
  stages: dict


def document_mesh() -> Mesh | None:
  """A 1-D mesh over every device of the job (axis `docs`), process by process; None on a
  single device. In a job across processes (lla.dist) it spans every process's devices."""
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  return Mesh(np.array(devices), ("docs",)) if len(devices) > 1 else None


def spans_processes(mesh: Mesh | None) -> bool:
  return mesh is not None and len({d.process_index for d in mesh.devices.flat}) > 1


def local_mesh(mesh: Mesh | None) -> Mesh | None:
  """The part of `mesh` on this process's devices (None if that is a single device)."""
  if mesh is None:
    return None
  mine = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
  return Mesh(np.array(mine), ("docs",)) if len(mine) > 1 else None


def chunk_plan(num_docs: int, chunk: int, mesh: Mesh | None) -> tuple[int, int]:
  """(chunk size, number of chunks): the size rounded to a multiple of the device count."""
  devices = 1 if mesh is None else mesh.devices.size
  chunk = max(devices, min(chunk, num_docs) // devices * devices)
  chunk = int(math.ceil(chunk / devices) * devices)
  return chunk, int(math.ceil(num_docs / chunk))


def _local_rows(mesh: Mesh, size: int) -> slice:
  """The rows of a [size, ...] chunk that the `docs` sharding over `mesh` puts on this
  process's devices (contiguous, since the mesh lists devices process by process)."""
  rows = NamedSharding(mesh, PartitionSpec("docs")).addressable_devices_indices_map((size,))
  starts = sorted(index[0].start or 0 for index in rows.values())
  step = size // mesh.devices.size
  return slice(starts[0], starts[-1] + step)


def iterate_chunks(arrays: tuple, chunk: int, mesh: Mesh | None):
  """Yields (real size, padded chunk arrays) of arrays (all [B, ...]) along documents.

  Every chunk is padded (by repeating its last document) to the same size, so it compiles
  once, and with a mesh is placed with a `docs`-sharded NamedSharding so that jit
  partitions the batch. With a mesh across processes, each process gets only the rows
  that the `docs` sharding assigns to its own devices (placed over them), and
  `Workspace.map_documents` gathers the results.
  """
  size, count = chunk_plan(arrays[0].shape[0], chunk, mesh)
  rows = _local_rows(mesh, size) if spans_processes(mesh) else slice(None)
  place = local_mesh(mesh) if spans_processes(mesh) else mesh
  for i in range(count):
    piece = [np.asarray(a[i * size:(i + 1) * size]) for a in arrays]
    real = piece[0].shape[0]
    if real < size:
      piece = [np.concatenate([p, np.repeat(p[-1:], size - real, axis=0)]) for p in piece]
    piece = [p[rows] for p in piece]
    if place is not None:
      piece = [jax.device_put(p, NamedSharding(place, PartitionSpec("docs"))) for p in piece]
    yield real, piece


@dataclasses.dataclass
class Workspace:
  """One capture, one attacker. Arrays are numpy on the host.

  Attributes:
    activations: [B, T, d] observed forward messages.
    gradients: [B, T, d] observed backward messages or None.
    params, cfg: the attacker's copy of the model (exact client weights under `public`
      knowledge, pre-trained ones under `trained`); its blocks k.. are the attacker's
      downstream model for gradient matching.
    cut: k.
    calibration_tokens: [N, T] int32 public calibration documents.
    ridge_alpha: ridge strength relative to trace(Hc^T Hc)/d.
    memory_budget_bytes: per-chunk working-set budget.
    mesh: document mesh or None.
    calibration_transform: for defense-aware attackers, the defense's mechanism with the
      attacker's own randomness, applied to the calibration activations [N, T, d] before
      the ridge fit; None for a defense-unaware attacker.
    batch_docs: [B] documents in each document's training batch at capture time; the
      server's loss is the mean over batch_docs * (T - 1) positions, which scales g.
    defense: the capture's public defense description (name, params) or None.
    capture_files: name -> bytes of the files stored with the capture for its attacks,
      checked against its manifest (an active server's decoder, lla.active.attack); never
      the ground truth (lla.capture.store.attack_files). Read-only.
    capture_info: the blocks of the capture's metadata an attack may read
      (lla.capture.store.ATTACK_METADATA, e.g. `active`); never document ids, the session
      or a path. Read-only.
    known_prefix: the tokens every document starts with, public (the model's BOS; E.C):
      an attack may start after them, and no position among them is scored. The
      calibration passages start with them too.
    knowledge: the attacker's E.K weights (lla.protocol.tuple.KNOWLEDGE): "public"
      (`params` are the victim's client), "trained" (pre-trained ones) or "none" (no
      weights: an active server's decoder), when whoever built the workspace knows it
      (the replay driver always does); None: unknown, and an attack assumes it holds
      less than the victim's client.
    layer_form: how the model calls that take `model_params` run the layers, one of
      LAYER_FORMS (the same predictions and FLOPs in each; its compile and warm seconds
      differ).

  A workspace holds arrays and metadata only: no ground truth, no document ids and no path
  to the capture, the study or the defender's key store (the replay driver keeps those;
  docs/writing_an_attack.md, "What an attack can reach").
  """

  activations: np.ndarray
  gradients: np.ndarray | None
  params: dict
  cfg: GPT2Config
  cut: int
  calibration_tokens: np.ndarray
  ridge_alpha: float = 1e-3
  memory_budget_bytes: int = 2 << 30
  mesh: Mesh | None = None
  calibration_transform: Callable[[np.ndarray], np.ndarray] | None = None
  batch_docs: np.ndarray | None = None
  defense: dict | None = None
  capture_files: Mapping[str, bytes] = dataclasses.field(default_factory=dict)
  capture_info: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  known_prefix: tuple[int, ...] = ()
  knowledge: str | None = None
  layer_form: str = "auto"
  costs: dict = dataclasses.field(default_factory=dict)
  _cache: dict = dataclasses.field(default_factory=dict)
  _depends: dict = dataclasses.field(default_factory=dict)  # stage -> stages it used
  _scopes: list = dataclasses.field(default_factory=lambda: [Tally()])
  _used: set = dataclasses.field(default_factory=set)
  _attack: str = ""
  _in_chunk: bool = False        # inside a chunk spread across processes: stay local
  _spread_calls: int = 0         # chunks spread so far (the same count on every process)

  def __post_init__(self):
    if self.batch_docs is None:
      self.batch_docs = np.full(self.num_docs, self.num_docs, np.int32)
    self.capture_files = types.MappingProxyType(
        {str(k): bytes(v) for k, v in dict(self.capture_files).items()})
    self.capture_info = types.MappingProxyType(json.loads(json.dumps(dict(self.capture_info))))
    self.known_prefix = tuple(int(t) for t in self.known_prefix)
    if self.knowledge is not None and self.knowledge not in protocol_tuple.KNOWLEDGE:
      raise ValueError(f"knowledge {self.knowledge!r}: one of {protocol_tuple.KNOWLEDGE} "
                       "or None")
    if self.layer_form not in LAYER_FORMS:
      raise ValueError(f"layer_form {self.layer_form!r}: one of {LAYER_FORMS}")

  @property
  def num_docs(self) -> int:
    return self.activations.shape[0]

  @property
  def seq_len(self) -> int:
    return self.activations.shape[1]

  @property
  def doc_index(self) -> np.ndarray:
    """[B] int32 each document's index in the capture (for per-document randomness)."""
    return np.arange(self.num_docs, dtype=np.int32)

  @property
  def scan_layers(self) -> bool:
    """Whether `model_params` is the stacked form (`layer_form`, "auto" by platform)."""
    if self.layer_form == "auto":
      return self.platform != "cpu"
    return self.layer_form == "scanned"

  @property
  def model_params(self) -> dict:
    """`params` in the form the attacks' compiled model calls take (`layer_form`): the
    computation form (`split.computation_form`, stacked once per tree) or the HF-named tree.
    An attack that reads or replaces named layers, or differentiates by them, uses
    `params`."""
    return split.computation_form(self.params, self.cfg) if self.scan_layers else self.params

  @property
  def wte(self) -> jax.Array:
    return split.wte(self.params)

  def chunk_for(self, bytes_per_doc: float) -> int:
    return max(1, int(self.memory_budget_bytes // max(bytes_per_doc, 1.0)))

  # --- metering ---------------------------------------------------------------------

  def call(self, jitted, *args, real_fraction: float = 1.0, **kwargs):
    """Runs `jitted(*args, **kwargs)` through its cached executable and meters it.

    real_fraction: the share of the call's independent (vmapped) rows that are the
    attack's; a call padded with copies of its last row so that fewer row counts compile
    (SipIt's buckets) is charged that share of XLA's count, the padding being lla's."""
    return self._metered(jitted, args, kwargs, trips=real_fraction)

  def scan(self, step, consts, state, xs, *, real_fraction: float = 1.0, **static):
    """`run_steps` metered: the executable is the loop alone, so XLA's count of its body
    (the while loop counted once) times the trip count is what ran (`call`'s
    real_fraction likewise)."""
    trips = int(jax.tree_util.tree_leaves(xs)[0].shape[0])
    return self._metered(scan_steps, (consts, state, xs),
                         {"step": step, "static": tuple(sorted(static.items()))},
                         trips * real_fraction)

  def _metered(self, jitted, args: tuple, kwargs: dict, trips: float):
    executable, dynamic, flops, compile_s = compiled(jitted, *args, **kwargs)
    scope = self._scopes[-1]
    scope.compile_s += compile_s
    # An unchecked platform's count is no count: the attack's charge and every stage it
    # computes say so, rather than a stage entry showing a number its charge did not use.
    if flops is None or self.platform not in XLA_COUNT_CHECKED:
      scope.missing_xla = True
    else:
      scope.xla_flops += flops * trips
    return executable(*args, **{name: kwargs[name] for name in dynamic})

  def count_host(self, flops: float) -> None:
    """FLOPs of host-side (numpy/scipy) work, e.g. the float64 ridge solve."""
    self._scopes[-1].xla_flops += flops
    self._scopes[-1].analytic_flops += flops

  def map_documents(self, per_chunk: Callable, arrays: tuple, bytes_per_doc: float):
    """per_chunk(*chunk arrays) over document chunks of `arrays` (all [B, ...]).

    `per_chunk` runs its computations with `call`; outputs (a pytree of [chunk, ...]
    arrays) are cut to the real documents and concatenated. Outputs are identical for any
    chunking because every function passed here treats documents independently. With a
    mesh across processes every process computes its rows of each chunk (`_spread`).
    """
    spanning = spans_processes(self.mesh)
    spread = spanning and not self._in_chunk
    # Inside a spread chunk (a stage computed there), work stays on this process.
    mesh = local_mesh(self.mesh) if spanning and not spread else self.mesh
    outputs = []
    for real, piece in iterate_chunks(arrays, self.chunk_for(bytes_per_doc), mesh):
      result = self._spread(per_chunk, piece) if spread else per_chunk(*piece)
      outputs.append(jax.tree_util.tree_map(lambda x: np.asarray(x)[:real], result))
    return jax.tree_util.tree_map(lambda *xs: np.concatenate(xs), *outputs)

  def _spread(self, per_chunk: Callable, piece: list):
    """One chunk across processes: this process's rows, then every process's results.

    per_chunk runs on local arrays only (attacks may read values on the host), so the
    processes exchange nothing until the chunk is done: then a status (error, and the
    FLOPs of the work each did in the current scope, which add up to the chunk's) and the
    results. A failure on any process is raised on every process, so that all of them
    leave the attack together and stay in step.
    """
    scope = self._scopes[-1]
    flops = scope.xla_flops
    self._in_chunk, self._spread_calls = True, self._spread_calls + 1
    try:
      result, error = jax.tree_util.tree_map(np.asarray, per_chunk(*piece)), None
    except Exception as e:  # Raised again below, on every process.
      result, error = None, e
    finally:
      self._in_chunk = False
    statuses = dist.agree({
        "call": [self._attack, self._spread_calls], "flops": scope.xla_flops - flops,
        "missing": scope.missing_xla, "error_type": type(error).__name__,
        "error": None if error is None else str(error)[:STATUS_ERROR_CHARS]})
    if len({json.dumps(s["call"]) for s in statuses}) != 1:
      raise dist.DivergedError(
          f"processes reached different chunks: {[s['call'] for s in statuses]}")
    failed = [s for s in statuses if s["error"] is not None]
    if failed:
      raise error if error is not None else dist.remote_error(failed[0])
    scope.xla_flops = flops + sum(s["flops"] for s in statuses)
    scope.missing_xla = any(s["missing"] for s in statuses)
    return dist.gather_documents(result)

  def map_call(self, jitted, arrays: tuple, bytes_per_doc: float, consts: tuple = (),
               real_fraction: float = 1.0, **static):
    """`jitted(*consts, *chunk arrays, **static)` over document chunks, metered (each
    chunk charged `real_fraction` of its count, as `call`)."""
    return self.map_documents(
        lambda *piece: self.call(jitted, *consts, *piece, real_fraction=real_fraction,
                                 **static), arrays, bytes_per_doc)

  def _mark_used(self, name: str) -> None:
    if name not in self._used:
      self._used.add(name)
      for dependency in self._depends.get(name, ()):
        self._mark_used(dependency)

  def stage(self, name: str, compute: Callable[[], Any], analytic: float = 0.0):
    """A shared stage: computed once (metered on its own), then reused. Using it marks it
    and every stage it used as used, whether it is computed now or was cached."""
    if name in self._cache:
      self._mark_used(name)
      return self._cache[name]
    outer_used, self._used = self._used, set()
    self._scopes.append(Tally(analytic_flops=analytic))
    try:
      value = compute()
    finally:
      tally = self._scopes.pop()
      self._depends[name] = frozenset(self._used)
      self._used = outer_used
    self._mark_used(name)
    wall = time.perf_counter() - tally.start - tally.nested_wall_s
    self._scopes[-1].nested_wall_s += time.perf_counter() - tally.start
    self.costs[name] = StageCost(None if tally.missing_xla else tally.xla_flops,
                                 tally.analytic_flops, wall, tally.compile_s, self._attack)
    self._cache[name] = value
    return value

  @contextlib.contextmanager
  def attack_scope(self, name: str):
    """Meters one attack; `charge()` inside the scope gives its cost so far. The process's
    command line names no path inside it (lla.attacks.withheld)."""
    self._scopes, self._used, self._attack = [Tally()], set(), name
    try:
      with withheld.paths_withheld():
        yield self
    finally:
      self._attack = ""

  @property
  def platform(self) -> str:
    """The platform it computes on: its mesh's, else JAX's default backend."""
    return self.mesh.devices.flat[0].platform if self.mesh is not None else jax.default_backend()

  def charge(self, own_analytic: float) -> Charge:
    """The attack's own work plus the full cost of every stage it used (see module doc)."""
    own = self._scopes[0]
    stages = {s: self.costs[s] for s in sorted(self._used)}
    analytic = own_analytic + sum(c.analytic for c in stages.values())
    exact = not own.missing_xla and all(c.flops is not None for c in stages.values())
    flops = own.xla_flops + sum(c.flops for c in stages.values()) if exact else analytic
    own_wall = time.perf_counter() - own.start - own.nested_wall_s
    return Charge(flops=float(flops), flops_source="xla" if exact else "analytic",
                  flops_analytic=float(analytic),
                  wall_s=own_wall + sum(c.wall_s for c in stages.values()),
                  compile_s=own.compile_s + sum(c.compile_s for c in stages.values()),
                  stages={s: c.to_json() for s, c in stages.items()})

  # --- shared stages ------------------------------------------------------------------

  @property
  def decoder(self) -> ridge.RidgeDecoder:
    """The ridge decoder fitted on the attacker's calibration activations (stage `ridge`)."""
    return self.stage("ridge", self._fit_ridge, analytic=self._ridge_analytic())

  def _ridge_analytic(self) -> float:
    d, rows = self.cfg.n_embd, self.calibration_tokens[:, len(self.known_prefix):].size
    return ridge.ridge_flops(rows, d, d)

  def calibration_activations(self) -> np.ndarray:
    """[N, T, d] the attacker's client on its calibration documents (stage
    `calibration_activations`; analytic FLOPs as lla.attacks.flops.calibration_activations:
    2 per weight-matrix entry of each block, T H D for attention)."""
    rows, width = self.calibration_tokens.size, cost.attention_width(self.cfg)
    compute = lambda: np.asarray(self.call(split.client, self.model_params, cfg=self.cfg,
                                           tokens=jnp.asarray(self.calibration_tokens),
                                           k=self.cut))
    return self.stage("calibration_activations", compute,
                      analytic=2.0 * rows * self.cut * (cost.block_weights(self.cfg)
                                                        + self.seq_len * width))

  def _fit_ridge(self) -> ridge.RidgeDecoder:
    h_cal = self.calibration_activations()
    if self.calibration_transform is not None:
      h_cal = np.asarray(self.calibration_transform(h_cal), np.float32)
    return self.fit_ridge(h_cal, self.wte)

  def fit_ridge(self, h_cal: np.ndarray, table, alpha: float | None = None) -> ridge.RidgeDecoder:
    """A ridge decoder from calibration rows h_cal [N, T, d] to the rows of table [V, d]
    of their tokens (host FLOPs counted; `alpha` defaults to the workspace's). A known
    prefix's rows are left out: one constant row per position (a BOS's, with the massive
    activations of an attention sink), they would only weigh on the fit."""
    skip = len(self.known_prefix)
    tokens = self.calibration_tokens[:, skip:]
    d = self.cfg.n_embd
    self.count_host(ridge.ridge_flops(tokens.size, d, d))
    return ridge.fit_ridge(np.asarray(h_cal)[:, skip:], np.asarray(table)[tokens],
                           self.ridge_alpha if alpha is None else alpha)

  @functools.cached_property
  def baseline_token(self) -> int:
    """The calibration corpus's most common token (ties: lower id), after the known prefix
    (the positions that are scored)."""
    tokens = self.calibration_tokens[:, len(self.known_prefix):]
    return int(np.bincount(tokens.reshape(-1)).argmax())


  def decoded_embeddings(self) -> np.ndarray:
    """[B, T, d] ridge-decoded embeddings of the observed activations (part of `ridge`)."""
    decoder = self.decoder
    return self.map_call(ridge.decode, (self.activations,),
                         memory.decode_bytes_per_doc(self.seq_len, self.cfg.n_embd),
                         consts=(decoder.weights, decoder.mu_h, decoder.mu_e))

  def activation_ranked(self, num: int) -> np.ndarray:
    """[B, T, num] nearest tokens to the decoded embeddings (stage `activation_candidates`).

    Ranked once at the largest `num` asked for; a smaller request is its prefix (the
    ranking is a stable sort, so prefixes agree).
    """
    decoder, wte, vocab = self.decoder, self.wte, self.cfg.vocab_size
    positions = self.num_docs * self.seq_len
    # The distances to every row, and the ridge decode (its d x d map, for every family).
    analytic = (cand_lib.candidate_flops(positions, vocab, self.cfg.n_embd)
                + 2.0 * positions * self.cfg.n_embd**2)
    compute = lambda: self.map_call(
        cand_lib.decoded_nearest_tokens, (self.activations,),
        memory.ranking_bytes_per_doc(self.seq_len, vocab, self.cfg.n_embd, num),
        consts=(decoder.weights, decoder.mu_h, decoder.mu_e, wte), num=num)
    return self._ranked_stage("activation_candidates", num, compute, analytic)

  def gradient_ranked(self, num: int, gradients: np.ndarray, stage: str) -> np.ndarray:
    """[B, T, num] tokens ranked by <-g[t-1], wte[v]> (stage `stage`)."""
    wte, vocab = split.output_table(self.params), self.cfg.vocab_size  # the output head
    analytic = cand_lib.candidate_flops(self.num_docs * self.seq_len, vocab, self.cfg.n_embd)
    compute = lambda: self.map_call(
        cand_lib.gradient_ranked_tokens, (gradients,),
        memory.ranking_bytes_per_doc(self.seq_len, vocab, self.cfg.n_embd, num), consts=(wte,),
        num=num)
    return self._ranked_stage(stage, num, compute, analytic)

  def _ranked_stage(self, stage: str, num: int, compute, analytic: float) -> np.ndarray:
    have = self._cache.get(stage)
    if have is not None and have.shape[-1] < num:
      # A longer ranking than the cached one: recompute (and charge) the stage at `num`.
      del self._cache[stage]
    return self.stage(stage, compute, analytic)[..., :num]
