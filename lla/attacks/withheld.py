"""The process's command line out of an attack's reach while it runs.

The attack API hands an attack arrays and metadata, never a path (docs/writing_an_attack.md),
and no lla module global names the run while it runs (lla.evidence.rundir keys its lock
table by file identity). Two process-wide places still would: the command line (`sys.argv`,
e.g. `--config.capture_dir=CAP --workdir=RUN`) and absl's parsed flags (the config flag's
ConfigDict, its per-field override flags and their record of overrides, `--workdir`).
`paths_withheld()` replaces, for its body, every string there that names an existing file
or directory (alone, or as a piece of a `--flag=value`, a list or a `file:variant`) with
WITHHELD, in place, and puts each original object back on the way out, also when the body
raises. Lla's attack scope (Workspace.attack_scope) runs every attack inside it.

The originals live only in the context manager's frame: no module state names them. Not
covered: what Python lets any code reach by introspection (the callers' frames, the
garbage collector's objects, /proc/self); an attack is trusted not to go looking there.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys

import ml_collections
from absl import flags

WITHHELD = "<withheld>"
# What separates the paths inside one string: "--flag=value", "a,b", "file.py:variant",
# quotes (absl's default_as_str) and brackets (a list's repr).
_SEPARATORS = re.compile(r"[\s=,:;'\"()\[\]{}]+")
# Pieces that exist everywhere and name no run: the working directory and the root.
_TOO_GENERIC = {".", "..", os.sep}
# Recursed into (their instance dictionaries): the flag objects and the config's nodes.
_OBJECTS = (flags.Flag, ml_collections.ConfigDict, ml_collections.FieldReference)


def names_a_path(text: str) -> bool:
  """Whether `text`, or a piece of it, names an existing file or directory."""
  if len(text) > 4096:  # help text and the like: no single path
    return False
  return any(piece not in _TOO_GENERIC and os.path.lexists(piece)
             for piece in _SEPARATORS.split(text) if piece)


class _Scrub:
  """Replaces path strings inside containers in place, remembering how to undo it."""

  def __init__(self):
    self.undo: list[tuple[object, object, object]] = []  # (container, key, original)
    self.seen: set[int] = set()
    self.tuples: dict[int, tuple] = {}  # id of a tuple -> its replacement

  def value(self, value):
    """`value` with its path strings withheld: the same object when nothing changed (lists,
    dictionaries and objects are changed in place), else a new string or tuple."""
    if isinstance(value, str):
      return WITHHELD if names_a_path(value) else value
    if id(value) in self.seen:
      return self.tuples.get(id(value), value)
    if isinstance(value, (dict, list, tuple, *_OBJECTS)):
      self.seen.add(id(value))
    if isinstance(value, dict):
      for key in list(value):
        self.slot(value, key)
    elif isinstance(value, list):
      for i in range(len(value)):
        self.slot(value, i)
    elif type(value) is tuple:  # (a named tuple is left as it is)
      items = tuple(self.value(x) for x in value)
      if any(a is not b for a, b in zip(items, value)):
        self.tuples[id(value)] = items
        return items
    elif isinstance(value, _OBJECTS):
      self.value(vars(value))
    return value

  def slot(self, container, key) -> None:
    original = container[key]
    new = self.value(original)
    if new is not original:
      self.undo.append((container, key, original))
      container[key] = new

  def restore(self) -> None:
    for container, key, original in reversed(self.undo):
      container[key] = original
    self.undo.clear()


@contextlib.contextmanager
def paths_withheld():
  """For the body: no string of sys.argv or of absl's flags names an existing path."""
  scrub = _Scrub()
  try:
    scrub.value(sys.argv)
    for name in list(flags.FLAGS):
      scrub.value(flags.FLAGS[name])
    yield
  finally:
    scrub.restore()
