"""The capture directory: round trip, determinism and refusal of every kind of bad input.

Messages are synthetic arrays (no model): the store is checked on its own. Each refusal
must name the file and the problem.
"""

import json
import pathlib
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from lla.capture import capture, store
from lla.evidence import files, manifest
from lla.model.gpt2 import GPT2Config
from lla.protocol import tuple as protocol

B, T, D = 4, 6, 8


def messages(seed=0):
  rng = np.random.default_rng(seed)
  h = rng.standard_normal((B, T, D)).astype(np.float32)
  g = rng.standard_normal((B, T, D)).astype(np.float32) * 1e-3
  tokens = rng.integers(0, 100, (B, T)).astype(np.int32)
  return h, g, tokens


def metadata():
  e = protocol.make(T=protocol.Target(model_id="m", cut=2),
                    O=protocol.Observations(gradients=True))
  return {"document_ids": list(range(B)), "protocol": e.to_dict(), "e_hash": e.sha256()}


@pytest.fixture
def good(tmp_path):
  h, g, tokens = messages()
  sha = store.write_capture(tmp_path / "cap", h, g, tokens, metadata())
  return tmp_path / "cap", sha


def rewrite(directory: pathlib.Path, name: str, tensors: dict) -> None:
  """Replaces a safetensors file and rewrites the manifest (a consistent forgery)."""
  (directory / name).unlink()
  save_file(tensors, str(directory / name))
  (directory / manifest.MANIFEST_NAME).unlink()
  manifest.write_manifest(str(directory))


def test_round_trip(good):
  directory, sha = good
  h, g, tokens = messages()
  cap = store.load_capture(directory)
  np.testing.assert_array_equal(cap.activations, h)
  np.testing.assert_array_equal(cap.gradients, g)
  np.testing.assert_array_equal(store.load_truth(directory), tokens)
  assert cap.observations == {"activations", "gradients"}
  assert cap.manifest_sha256 == sha == files.sha256_file(str(directory / manifest.MANIFEST_NAME))
  assert cap.document_ids == list(range(B))
  assert not hasattr(cap, "tokens")  # the attack side never sees the ground truth
  # Written atomically: no staging directory left behind.
  assert sorted(p.name for p in directory.parent.iterdir()) == ["cap"]
  # Inference capture: no gradients.
  inf = directory.parent / "inf"
  store.write_capture(inf, h, None, tokens, metadata())
  assert store.load_capture(inf).observations == {"activations"}
  assert "gradients" not in load_file(str(inf / store.MESSAGES_FILE))


def test_write_refuses_overwrite_and_bad_messages(good, tmp_path):
  directory, _ = good
  h, g, tokens = messages()
  with pytest.raises(FileExistsError, match="refusing to overwrite"):
    store.write_capture(directory, h, g, tokens, metadata())
  bad_h = h.copy()
  bad_h[0, 1, 2] = np.nan
  bad_g = g.copy()
  bad_g[3, 0, 0] = np.inf
  cases = [
      ((bad_h, g, tokens), r"activations contain NaN or Inf \(1 values\)"),
      ((h, bad_g, tokens), r"gradients contain NaN or Inf \(1 values\)"),
      ((h[0], g, tokens), r"activations must be \[B, T, d\], got shape \(6, 8\)"),
      ((h, g[:, :-1], tokens), r"gradients shape \(4, 5, 8\) != activations shape \(4, 6, 8\)"),
      ((h, g, tokens[:, :-1]), r"tokens must be int32 \(4, 6\)"),
  ]
  for i, (args, message) in enumerate(cases):
    target = tmp_path / f"bad{i}"
    with pytest.raises(store.CaptureError, match=message) as err:
      store.write_capture(target, *args, metadata())
    assert str(target) in str(err.value)
    assert not target.exists()
  with pytest.raises(store.CaptureError, match="metadata needs 4 document_ids"):
    store.write_capture(tmp_path / "ids", h, g, tokens, {**metadata(), "document_ids": [0]})
  assert sorted(p.name for p in tmp_path.iterdir()) == ["cap"]  # nothing half-written


def test_load_refuses_tampered_and_malformed_files(good, tmp_path):
  directory, _ = good
  h, g, _ = messages()

  def copy(name):
    out = tmp_path / name
    shutil.copytree(directory, out)
    return out

  # One byte edited: the manifest names the file.
  edited = copy("edited")
  data = bytearray((edited / store.MESSAGES_FILE).read_bytes())
  data[-5] ^= 1
  (edited / store.MESSAGES_FILE).write_bytes(bytes(data))
  with pytest.raises(store.CaptureError, match="manifest check failed: changed: messages.safetensors"):
    store.load_capture(edited)
  # Truncated: caught by the manifest; with the manifest forged, by the reader.
  truncated = copy("truncated")
  data = (truncated / store.MESSAGES_FILE).read_bytes()
  (truncated / store.MESSAGES_FILE).write_bytes(data[:len(data) // 2])
  with pytest.raises(store.CaptureError, match="changed: messages.safetensors"):
    store.load_capture(truncated)
  (truncated / manifest.MANIFEST_NAME).unlink()
  manifest.write_manifest(str(truncated))
  with pytest.raises(store.CaptureError, match=r"messages.safetensors: unreadable safetensors"):
    store.load_capture(truncated)
  # A missing file.
  missing = copy("missing")
  (missing / store.METADATA_FILE).unlink()
  with pytest.raises(store.CaptureError, match="missing: metadata.json"):
    store.load_capture(missing)
  # Consistent forgeries (manifest rewritten): NaN, wrong dtype, wrong shape, no activations.
  nan = h.copy()
  nan[2, 2, 2] = np.nan
  forgeries = [
      ({"activations": nan, "gradients": g}, r"activations contain NaN or Inf \(1 values\)"),
      ({"activations": h.astype(np.float16), "gradients": g},
       "activations must be float32, got float16"),
      ({"activations": h, "gradients": g.astype(np.float64)}, "gradients must be float32, got float64"),
      ({"activations": h.reshape(B, -1), "gradients": g}, r"activations must be \[B, T, d\]"),
      ({"gradients": g}, r"no 'activations' tensor \(has: \['gradients'\]\)"),
  ]
  for i, (tensors, message) in enumerate(forgeries):
    forged = copy(f"forged{i}")
    rewrite(forged, store.MESSAGES_FILE, tensors)
    with pytest.raises(store.CaptureError, match=message) as err:
      store.load_capture(forged)
    assert f"forged{i}" in str(err.value) and store.MESSAGES_FILE in str(err.value)
  # Metadata disagreeing with the messages.
  ids = copy("ids")
  meta = json.loads((ids / store.METADATA_FILE).read_text())
  meta["document_ids"] = [0, 1]
  (ids / store.METADATA_FILE).write_text(json.dumps(meta))
  (ids / manifest.MANIFEST_NAME).unlink()
  manifest.write_manifest(str(ids))
  with pytest.raises(store.CaptureError, match="metadata.json: 2 document_ids for 4 documents"):
    store.load_capture(ids)
  with pytest.raises(store.CaptureError, match="capture directory does not exist"):
    store.load_capture(tmp_path / "nowhere")


def test_capture_target_is_deterministic_and_validates(tmp_path):
  from test_attacks_units import random_params
  cfg = GPT2Config(vocab_size=50, n_positions=8, n_embd=16, n_head=2, n_layer=2)
  params = random_params(cfg, seed=1)
  tokens = np.random.default_rng(1).integers(0, 50, (4, 8))
  shas = [capture.capture_target(str(tmp_path / f"c{i}"), params, cfg, tokens, range(4), 1,
                                 model_id="m", batch_size=2) for i in range(2)]
  assert shas[0] == shas[1]
  for name in (store.MESSAGES_FILE, store.TRUTH_FILE, store.METADATA_FILE):
    assert (tmp_path / "c0" / name).read_bytes() == (tmp_path / "c1" / name).read_bytes()
  meta = store.load_capture(tmp_path / "c0").metadata
  assert meta["step"] == [0, 0, 1, 1] and meta["order"] == [0, 1, 0, 1]
  assert meta["mode"] == "training" and meta["e_hash"] == protocol.ProtocolTuple.from_dict(
      meta["protocol"]).sha256()
  with pytest.raises(ValueError, match=r"token ids must lie in \[0, 50\)"):
    capture.capture_target(str(tmp_path / "x"), params, cfg, tokens + 49, range(4), 1, model_id="m")
  with pytest.raises(ValueError, match="exceeds the model's n_positions=8"):
    capture.capture_target(str(tmp_path / "x"), params, cfg, np.zeros((2, 9), int), range(2), 1,
                           model_id="m")
  with pytest.raises(ValueError, match="tokens must be"):
    capture.capture_target(str(tmp_path / "x"), params, cfg, tokens.astype(float), range(4), 1,
                           model_id="m")


def test_reuse_compares_the_stored_target(good):
  directory, sha = good
  never = lambda d: pytest.fail("a finished capture must be reused, not rewritten")
  assert store.reuse_or_write(directory, never, expected={"T.model_id": "m", "T.cut": 2}) == sha
  with pytest.raises(store.CaptureError, match=r"capture there is of another target: differs "
                     r"in T.cut \(stored 2, expected 3\); T.model_id \(stored 'm', expected "
                     r"'other'\)"):
    store.reuse_or_write(directory, never, expected={"T.model_id": "other", "T.cut": 3})
