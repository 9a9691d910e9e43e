"""Manifests (checked with the real sha256sum) and atomic writes."""

import os
import shutil
import subprocess

import pytest

from lla.evidence import files
from lla.evidence import manifest


def _tree(d):
  os.makedirs(d / "sub")
  (d / "a.txt").write_text("alpha\n")
  (d / "sub" / "b.bin").write_bytes(bytes(range(256)))


def test_manifest_agrees_with_sha256sum(tmp_path):
  _tree(tmp_path)
  manifest.write_manifest(str(tmp_path))
  if shutil.which("sha256sum"):
    out = subprocess.run(["sha256sum", "-c", "manifest.sha256"], cwd=tmp_path,
                         capture_output=True, text=True, check=True).stdout
    assert "a.txt: OK" in out and "sub/b.bin: OK" in out
  assert manifest.verify_manifest(str(tmp_path)).ok


def test_manifest_names_changed_missing_extra(tmp_path):
  _tree(tmp_path)
  manifest.write_manifest(str(tmp_path))
  (tmp_path / "a.txt").write_text("alphA\n")
  os.remove(tmp_path / "sub" / "b.bin")
  (tmp_path / "c.txt").write_text("new")
  rep = manifest.verify_manifest(str(tmp_path))
  assert rep.problems() == ["changed: a.txt", "missing: sub/b.bin",
                            "extra: c.txt"]
  with open(tmp_path / "manifest.sha256", "a") as f:
    f.write("garbage\n")
  assert "malformed" in manifest.verify_manifest(str(tmp_path)).errors[0]


def test_atomic_write_never_overwrites_or_leaves_halves(tmp_path, monkeypatch):
  p = str(tmp_path / "result.json")
  files.atomic_write_json(p, {"b": 1, "a": [1.5]})
  assert open(p, "rb").read() == b'{"a":[1.5],"b":1}\n'
  with pytest.raises(FileExistsError, match="result.json"):
    files.atomic_write_bytes(p, b"other")
  files.atomic_write_bytes(p, b"new", overwrite=True)
  assert open(p, "rb").read() == b"new"

  def crash(*a):
    raise KeyboardInterrupt
  monkeypatch.setattr(os, "link", crash)
  q = str(tmp_path / "interrupted.json")
  with pytest.raises(KeyboardInterrupt):
    files.atomic_write_bytes(q, b"x" * 1000)
  assert sorted(os.listdir(tmp_path)) == ["result.json"]
