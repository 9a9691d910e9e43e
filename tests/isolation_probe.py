"""A plugin attack that looks for what an attack must not receive (loaded as a plugin).

`isolation_probe` walks everything the attack API hands it (the Workspace's attributes,
recursively: dataclass fields, instance dictionaries, mappings, sequences, arrays, bytes,
closures of callables; the budget view; the key) and reports, in its record's details,
every place where it found one of the targets named by the JSON file at
$LLA_ISOLATION_PROBE:

  truth         the ground-truth tokens (an integer array equal to them, a row of them, a
                float array equal to them, or their raw bytes inside a bytes object)
  document_ids  any of the capture's document ids (an integer or an array element)
  paths         any string or bytes containing one of the listed paths (the capture, the
                study, the defender's key store, the test's root) or "truth.safetensors"

It walks every lla module's globals too (`module_globals`, with the binary's `__main__`
and experiments' modules), and the command line (`command_line`: sys.argv and absl's
flags, which name the capture and the run while the replay binary runs): module-level
and process-wide state is within any attack's reach.
  secret        the defender's secret (the integer or its decimal string)

`probe(obj, targets)` is the same walk, for the tests to run on the replay driver's own
objects (where it must find them: the probe can fail).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import types

import jax
import numpy as np
from absl import flags

from lla.attacks import registry

ENV = "LLA_ISOLATION_PROBE"
TRUTH_FILE_NAME = "truth.safetensors"
MAX_NODES = 500_000


@dataclasses.dataclass
class Targets:
  truth: np.ndarray           # [B, T] int32
  document_ids: tuple[int, ...]
  paths: tuple[str, ...]
  secret: int | None = None

  @classmethod
  def load(cls, path: str) -> "Targets":
    spec = json.loads(open(path).read())
    return cls(np.asarray(spec["truth"], np.int32), tuple(int(i) for i in spec["document_ids"]),
               tuple(spec["paths"]), None if spec.get("secret") is None else int(spec["secret"]))

  def to_json(self) -> dict:
    return {"truth": self.truth.tolist(), "document_ids": list(self.document_ids),
            "paths": list(self.paths), "secret": None if self.secret is None
            else str(self.secret)}


class _Walk:

  def __init__(self, targets: Targets, bare_name: bool = True):
    self.t = targets
    self.found: set[str] = set()
    self.seen: set[int] = set()
    self.visited = 0
    self.arrays = 0
    self.truth_rows = {tuple(r) for r in targets.truth.tolist()}
    self.truth_bytes = [np.ascontiguousarray(targets.truth, dt).tobytes()
                        for dt in (np.int32, np.int64)]
    self.ids = np.asarray(targets.document_ids, np.int64)
    needles = [p for p in targets.paths if p] + ([TRUTH_FILE_NAME] if bare_name else [])
    self.needles = needles + [os.path.realpath(p) for p in targets.paths if p]
    if targets.secret is not None:
      self.needles.append(str(targets.secret))

  def text(self, s: str, where: str) -> None:
    for needle in self.needles:
      if needle in s:
        kind = "secret" if self.t.secret is not None and needle == str(self.t.secret) else "path"
        self.found.add(f"{kind} {needle!r} in {where}")

  def raw(self, b: bytes, where: str) -> None:
    for truth in self.truth_bytes:
      if len(truth) and truth in b:
        self.found.add(f"truth bytes in {where}")
    for needle in self.needles:
      if needle.encode() in b:
        self.found.add(f"path or secret {needle!r} in bytes at {where}")

  def integer(self, v: int, where: str) -> None:
    if self.t.secret is not None and v == self.t.secret:
      self.found.add(f"secret in {where}")
    if v in self.t.document_ids:
      self.found.add(f"document id {v} in {where}")

  def array(self, a: np.ndarray, where: str) -> None:
    self.arrays += 1
    truth = self.t.truth
    if a.dtype.kind in "iu":
      if a.shape == truth.shape and np.array_equal(a, truth):
        self.found.add(f"truth array at {where}")
      elif a.ndim >= 1 and a.shape[-1] == truth.shape[1] and a.size:
        rows = {tuple(r) for r in a.reshape(-1, truth.shape[1]).tolist()}
        if rows & self.truth_rows:
          self.found.add(f"truth rows at {where}")
      if a.size and np.isin(a.astype(np.int64, copy=False), self.ids).any():
        self.found.add(f"document id(s) in array at {where}")
    elif a.dtype.kind == "f" and a.shape == truth.shape:
      if np.array_equal(a, truth.astype(a.dtype)):
        self.found.add(f"truth as floats at {where}")
    elif a.dtype.kind in "SUO":
      for i, x in enumerate(a.reshape(-1).tolist()):
        self.visit(x, f"{where}[{i}]", 0)

  def visit(self, obj, where: str, depth: int) -> None:
    if self.visited >= MAX_NODES or depth > 40:
      return
    self.visited += 1
    if obj is None or isinstance(obj, (bool, float, complex)):
      return
    if isinstance(obj, str):
      self.text(obj, where)
      return
    if isinstance(obj, (bytes, bytearray, memoryview)):
      self.raw(bytes(obj), where)
      return
    if isinstance(obj, (int, np.integer)):
      self.integer(int(obj), where)
      return
    if isinstance(obj, os.PathLike):
      self.text(os.fspath(obj), where)
      return
    if isinstance(obj, (types.ModuleType, type)):
      return  # Reachable by import anyway: outside the API (docs/writing_an_attack.md).
    if id(obj) in self.seen:
      return
    self.seen.add(id(obj))
    if isinstance(obj, jax.Array):
      if jax.dtypes.issubdtype(obj.dtype, jax.dtypes.prng_key):
        obj = jax.random.key_data(obj)
      self.array(np.asarray(obj), where)
      return
    if isinstance(obj, np.ndarray):
      self.array(obj, where)
      return
    if isinstance(obj, (dict, types.MappingProxyType)):
      for k, v in list(obj.items()):
        self.visit(k, f"{where}{{key}}", depth + 1)
        self.visit(v, f"{where}[{k!r}]", depth + 1)
      return
    if isinstance(obj, (list, tuple, set, frozenset)):
      for i, x in enumerate(list(obj)):
        self.visit(x, f"{where}[{i}]", depth + 1)
      return
    if isinstance(obj, functools.partial):
      self.visit(obj.func, f"{where}.func", depth + 1)
      self.visit(obj.args, f"{where}.args", depth + 1)
      self.visit(obj.keywords, f"{where}.keywords", depth + 1)
      return
    if isinstance(obj, types.MethodType):
      self.visit(obj.__self__, f"{where}.__self__", depth + 1)
      self.visit(obj.__func__, f"{where}.__func__", depth + 1)
      return
    if isinstance(obj, types.FunctionType):
      for i, cell in enumerate(obj.__closure__ or ()):
        try:
          self.visit(cell.cell_contents, f"{where}.<closure {i}>", depth + 1)
        except ValueError:  # An empty cell.
          pass
      self.visit(obj.__defaults__, f"{where}.__defaults__", depth + 1)
      self.visit(obj.__kwdefaults__, f"{where}.__kwdefaults__", depth + 1)
      return
    if dataclasses.is_dataclass(obj):
      for f in dataclasses.fields(obj):
        self.visit(getattr(obj, f.name, None), f"{where}.{f.name}", depth + 1)
    for name, value in list(getattr(obj, "__dict__", {}).items()):
      self.visit(value, f"{where}.{name}", depth + 1)
    for cls in type(obj).__mro__:
      for name in getattr(cls, "__slots__", ()):
        if isinstance(name, str) and hasattr(obj, name):
          self.visit(getattr(obj, name), f"{where}.{name}", depth + 1)


def module_globals() -> dict[str, dict]:
  """Module name -> a copy of its globals, for every imported lla and experiments module
  and the program's __main__."""
  return {name: dict(vars(module)) for name, module in sorted(sys.modules.items())
          if module is not None and (name in ("lla", "experiments", "__main__") or
                                     name.startswith(("lla.", "experiments.")))}


def command_line() -> dict:
  """The process's command line as code can read it: sys.argv and every absl flag (its
  value, default, and for a config flag the ConfigDict and its overrides)."""
  return {"sys.argv": sys.argv, "absl FLAGS": {n: flags.FLAGS[n] for n in flags.FLAGS}}


def probe(obj, targets: Targets, bare_name: bool = True) -> dict:
  """{"found": [what and where], "visited": nodes, "arrays": arrays inspected}; with
  `bare_name`, the truth file's name alone counts as a path."""
  walk = _Walk(targets, bare_name)
  walk.visit(obj, "api", 0)
  return {"found": sorted(walk.found), "visited": walk.visited, "arrays": walk.arrays}


@dataclasses.dataclass(frozen=True)
class IsolationProbe:
  spec: registry.AttackSpec

  def __call__(self, ws, budget, key) -> registry.AttackResult:
    targets = Targets.load(os.environ[ENV])
    # The API, and every lla module's globals: state an attack reaches by importing lla
    # (a lock's table of held run directories, a cache keyed by path) must hold none of
    # the targets either while it runs.
    report = probe({"workspace": ws, "budget": budget, "key": key}, targets)
    # (lla's own constants name the truth file, "truth.safetensors": only the paths count.)
    report["found"] = sorted(report["found"] + probe(
        {"lla module globals": module_globals(), "command line": command_line()}, targets,
        bare_name=False)["found"])
    # What the command line held, so that a test can tell the walk saw it.
    report["argv_length"] = len(sys.argv)
    report["flags"] = sorted(flags.FLAGS)
    # What the walk was given, so that a test can tell it walked the whole workspace.
    report["workspace_fields"] = sorted(f.name for f in dataclasses.fields(ws))
    report["capture_files"] = sorted(ws.capture_files)
    report["capture_info"] = sorted(ws.capture_info)
    return registry.AttackResult(np.zeros((ws.num_docs, ws.seq_len), np.int32), 0.0, report)


registry.register(IsolationProbe(registry.AttackSpec(
    "isolation_probe", "isolation_probe", ("activations",),
    knowledge=("public", "trained", "none"), role="negative_control",
    description="looks for ground truth, document ids, paths and secrets in the attack API",
    threat_model="a plugin that reads everything its workspace, budget view and key reach")))
