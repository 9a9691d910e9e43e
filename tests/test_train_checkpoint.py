"""Checkpoints: round trip, content hash, HF export, cache reuse, corrupt/partial detection."""

import contextlib
import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lla.model import hf_io
from lla.model.gpt2 import GPT2Config, init_params
from lla.model import checkpoint as ckpt

CFG = GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=2, n_head=2)


@pytest.fixture(scope="module")
def params():
  return init_params(CFG, jax.random.key(0))


def _equal(a, b):
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_round_trip_and_stable_hash(tmp_path, params):
  saved = ckpt.save(tmp_path / "c", params, CFG, {"note": "x"})
  restored = ckpt.restore(tmp_path / "c")
  assert _equal(restored.params, params) and restored.cfg == CFG
  assert restored.sha256 == saved.sha256 == ckpt.params_sha256(params)
  assert restored.metadata["note"] == "x"
  hf_params, hf_cfg = hf_io.load_hf_dir(restored.hf_dir)
  assert hf_cfg == CFG and _equal(hf_params, params)


def test_hash_is_canonical_and_content_sensitive(params):
  reordered = {name: params[name] for name in reversed(list(params))}
  assert ckpt.params_sha256(reordered) == ckpt.params_sha256(params)
  changed = jax.tree.map(jnp.array, params)
  changed["ln_f"]["bias"] = changed["ln_f"]["bias"].at[0].add(1e-7)
  assert ckpt.params_sha256(changed) != ckpt.params_sha256(params)


@contextlib.contextmanager
def absltest_logs():
  """Collects the messages absl logs at WARNING while the block runs."""
  messages = []

  class Collect(logging.Handler):
    def emit(self, record):
      messages.append(record.getMessage())

  handler = Collect(level=logging.WARNING)
  logger = logging.getLogger("absl")
  logger.addHandler(handler)
  try:
    yield messages
  finally:
    logger.removeHandler(handler)


def _counting_create(params):
  calls = []

  def create():
    calls.append(1)
    return params, CFG, {"run": len(calls)}

  return create, calls


def test_cached_checkpoint_is_reused(tmp_path, params):
  create, calls = _counting_create(params)
  first, created = ckpt.load_or_create(tmp_path / "c", create)
  second, created_again = ckpt.load_or_create(tmp_path / "c", create)
  assert created and not created_again and len(calls) == 1
  assert second.sha256 == first.sha256


def _corrupt_params_file(directory):
  # Flip bytes in every orbax data file (OCDBT's `d/` directories: the stored arrays and
  # the tree that indexes them), whichever of them a restore reads.
  files = [p for p in (directory / ckpt.PARAMS_DIR).rglob("*")
           if p.is_file() and p.parent.name == "d"]
  assert files, sorted((directory / ckpt.PARAMS_DIR).rglob("*"))
  for target in files:
    raw = bytearray(target.read_bytes())
    for i in range(len(raw) // 2, min(len(raw), len(raw) // 2 + 64)):
      raw[i] ^= 0xFF
    target.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage", ["params_bytes", "metadata_hash", "missing_metadata",
                                    "hf_weights"])
def test_damaged_checkpoint_detected_and_redone(tmp_path, params, damage):
  directory = tmp_path / "c"
  create, calls = _counting_create(params)
  ckpt.load_or_create(directory, create)
  if damage == "params_bytes":
    _corrupt_params_file(directory)
  elif damage == "metadata_hash":
    meta = json.loads((directory / ckpt.METADATA_FILE).read_text())
    meta["params_sha256"] = "0" * 64
    (directory / ckpt.METADATA_FILE).write_text(json.dumps(meta))
  elif damage == "missing_metadata":  # What an interrupted non-atomic write would leave.
    (directory / ckpt.METADATA_FILE).unlink()
  else:
    (directory / ckpt.HF_DIR / hf_io.WEIGHTS_FILE).write_bytes(b"truncated")
  with pytest.raises(ckpt.CheckpointError):
    ckpt.restore(directory)
  damaged = {p.relative_to(directory): p.read_bytes() for p in directory.rglob("*")
             if p.is_file()}
  with absltest_logs() as warnings:
    redone, created = ckpt.load_or_create(directory, create)
  assert created and len(calls) == 2
  assert redone.sha256 == ckpt.params_sha256(params)
  assert ckpt.restore(directory).metadata["run"] == 2
  # The damaged checkpoint was moved aside byte for byte, never deleted, and named.
  (moved,) = tmp_path.glob("c.quarantined-*")
  kept = {p.relative_to(moved): p.read_bytes() for p in moved.rglob("*") if p.is_file()
          and p.name != ckpt.QUARANTINE_NOTE}
  assert kept == damaged
  assert "failed to restore" in (moved / ckpt.QUARANTINE_NOTE).read_text()
  assert any(str(moved) in w and "kept, not deleted" in w for w in warnings)


def test_interrupted_save_leftover_is_ignored_and_cleaned(tmp_path, params):
  leftover = tmp_path / "c.partial-deadbeef"
  (leftover / ckpt.PARAMS_DIR).mkdir(parents=True)
  with pytest.raises(ckpt.CheckpointError):
    ckpt.restore(tmp_path / "c")
  create, calls = _counting_create(params)
  ckpt.load_or_create(tmp_path / "c", create)
  assert len(calls) == 1 and not leftover.exists()
  assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_resident_holds_a_few_copies_and_restores_the_rest(tmp_path, params, monkeypatch):
  """Resident(2) over three checkpoints: each is restored on first use and returns its own
  params; a third evicts the least recently used one, which is restored again when next
  read; one made in place (`keep`) is never restored; a directory holding another model
  than the one named is refused."""
  copies = {name: jax.tree.map(lambda x, i=i: x + i, params) for i, name in enumerate("abc")}
  saved = {name: ckpt.save(tmp_path / name, p, CFG, {}, export_hf=False)
           for name, p in copies.items()}
  restored = []
  real = ckpt.restore
  monkeypatch.setattr(ckpt, "restore", lambda d: restored.append(d.rsplit("/", 1)[-1])
                      or real(d))
  resident = ckpt.Resident(2)
  for name in ("a", "b", "a", "c", "a", "b"):
    assert _equal(resident.params(tmp_path / name, saved[name].sha256), copies[name])
  # a (used again before c came) stayed; b was the least recently used when c came.
  assert restored == ["a", "b", "c", "b"]
  resident.keep(saved["c"])
  assert _equal(resident.params(tmp_path / "c", saved["c"].sha256), copies["c"])
  assert restored == ["a", "b", "c", "b"]
  with pytest.raises(ckpt.CheckpointError, match="expected"):
    ckpt.Resident(1).params(tmp_path / "a", saved["b"].sha256)
  with pytest.raises(ValueError, match="at least one"):
    ckpt.Resident(0)
