"""`manifest.sha256`: a `sha256sum`-format manifest over a directory.

Each line is `<64 hex>  <relative/path>` (two spaces, POSIX separators), sorted
by path, so `sha256sum -c manifest.sha256` run inside the directory agrees with
`verify_manifest`.
"""

import dataclasses
import os
import re

from lla.evidence import files

MANIFEST_NAME = "manifest.sha256"
_LINE = re.compile(r"^([0-9a-f]{64}) [ *](.+)$")
# Temporary files of interrupted atomic writes are not results.
_IGNORED_PREFIX = ".tmp-"
# A run directory's lock file (lla.evidence.rundir.locked) is not part of the run.
LOCK_NAME = ".lock"


@dataclasses.dataclass(frozen=True)
class ManifestReport:
  """Result of checking a directory against its manifest.

  Attributes:
    changed: files whose sha256 differs from the manifest.
    missing: files in the manifest that are absent.
    extra: files present but not in the manifest.
    errors: malformed manifest lines or an absent manifest.
  """
  changed: tuple[str, ...] = ()
  missing: tuple[str, ...] = ()
  extra: tuple[str, ...] = ()
  errors: tuple[str, ...] = ()

  @property
  def ok(self) -> bool:
    return not (self.changed or self.missing or self.extra or self.errors)

  def problems(self) -> list[str]:
    return ([f"changed: {p}" for p in self.changed] +
            [f"missing: {p}" for p in self.missing] +
            [f"extra: {p}" for p in self.extra] + list(self.errors))


def list_files(directory: str, exclude=(MANIFEST_NAME,)) -> list[str]:
  """Sorted relative POSIX paths of all regular files below `directory`."""
  out = []
  for root, dirs, names in os.walk(directory):
    dirs.sort()
    for name in names:
      rel = os.path.relpath(os.path.join(root, name), directory)
      rel = rel.replace(os.sep, "/")
      if rel in exclude or rel == LOCK_NAME or name.startswith(_IGNORED_PREFIX):
        continue
      if "\n" in rel or "\\" in rel:
        raise ValueError(f"{directory}: file name {rel!r} cannot be listed "
                         "in a sha256sum manifest")
      out.append(rel)
  return sorted(out)


def compute(directory: str) -> dict[str, str]:
  """Maps every file below `directory` (except the manifest) to its sha256."""
  return {rel: files.sha256_file(os.path.join(directory, rel))
          for rel in list_files(directory)}


def write_manifest(directory: str, overwrite: bool = False) -> str:
  """Writes `directory/manifest.sha256` atomically and returns its path."""
  entries = compute(directory)
  text = "".join(f"{h}  {rel}\n" for rel, h in entries.items())
  path = os.path.join(directory, MANIFEST_NAME)
  files.atomic_write_bytes(path, text.encode("utf-8"), overwrite=overwrite)
  return path


def read_manifest(path: str) -> tuple[dict[str, str], list[str]]:
  """Parses a manifest; returns ({path: sha256}, [errors naming the line])."""
  entries, errors = {}, []
  with open(path, "rb") as f:
    lines = f.read().decode("utf-8", errors="replace").splitlines()
  for i, line in enumerate(lines, 1):
    m = _LINE.match(line)
    if not m:
      errors.append(f"{path}:{i}: malformed manifest line {line[:80]!r}")
      continue
    if m.group(2) in entries:
      errors.append(f"{path}:{i}: duplicate entry for {m.group(2)}")
    entries[m.group(2)] = m.group(1)
  return entries, errors


def verify_manifest(directory: str) -> ManifestReport:
  """Checks every file of `directory` against `directory/manifest.sha256`."""
  path = os.path.join(directory, MANIFEST_NAME)
  if not os.path.exists(path):
    return ManifestReport(errors=(f"{path}: manifest missing",))
  expected, errors = read_manifest(path)
  present = set(list_files(directory))
  changed = [rel for rel in sorted(expected) if rel in present and
             files.sha256_file(os.path.join(directory, rel)) != expected[rel]]
  return ManifestReport(
      changed=tuple(changed),
      missing=tuple(sorted(set(expected) - present)),
      extra=tuple(sorted(present - set(expected))),
      errors=tuple(errors))
