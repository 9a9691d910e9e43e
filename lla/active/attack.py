"""The registered attack `fsha_decode`: invert a hijacked capture with the server's decoder.

After N hijacked steps the server's decoder f~^-1 (lla.active.fsha) maps the client's h
back to tokens. The hijacked training stores, in each capture it writes, the decoder of
that step as a file covered by the capture's manifest, with its sha256 in the capture's
metadata (`active.decoder_sha256`). Replay reads and checks it, so the attack is
deterministic and its predictions re-scorable: argmax_v f~^-1(n(h))[v] at every position.

Knowledge `none`: the attacker holds no client weights, only public text and the networks
it trained on it (the official threat model); E's V is the active server with the rights
("observe", "write_gradient"), as the capture records.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from safetensors.numpy import load as load_safetensors
from safetensors.numpy import save as save_safetensors

from lla.active import fsha
from lla.attacks import registry
from lla.capture import store
from lla.evidence import files

DECODER_FILE = "fsha_decoder.safetensors"
DECODER_KEYS = ("emb", "tau", "bias", "off", "scale")


def decoder_bytes(decoder: dict) -> bytes:
  """A decoder (fsha.decoder_of) as safetensors bytes of float32 arrays."""
  return save_safetensors({k: np.ascontiguousarray(np.asarray(decoder[k], np.float32))
                           for k in DECODER_KEYS})


def decoder_from(capture_files, active: dict, where: str = "capture") -> dict:
  """The decoder arrays stored with a capture (its attack-side files, name -> bytes), checked
  against the hash in the capture's `active` metadata."""
  if not (active or {}).get("decoder_sha256"):
    raise ValueError(f"{where}: no FSHA decoder is stored with this capture (it was not "
                     "written by a hijacking server)")
  name = active.get("decoder_file", DECODER_FILE)
  if name not in capture_files:
    raise ValueError(f"{where}: the capture's metadata names decoder {name!r}, which is not "
                     "among its files")
  raw = capture_files[name]
  if files.sha256_bytes(raw) != active["decoder_sha256"]:
    raise ValueError(f"{where}: {name} sha256 differs from the capture's metadata")
  return load_safetensors(raw)


def load_decoder(capture_dir: str) -> tuple[dict, dict]:
  """(decoder arrays, the capture's `active` metadata) read from a capture directory (for
  the tests and tools; an attack gets them through its workspace)."""
  capture = store.load_capture(capture_dir)
  active = store.attack_metadata(capture).get("active") or {}
  return decoder_from(store.attack_files(capture), active, capture_dir), active


@dataclasses.dataclass(frozen=True)
class FSHADecode:
  spec: registry.AttackSpec

  def __call__(self, ws, budget, key: jax.Array) -> registry.AttackResult:
    del budget, key  # Deterministic, no knobs: the decoder is what the hijack produced.
    # The decoder and its hash come with the workspace (files stored with the capture,
    # checked against its manifest): no path to the capture is needed.
    active = dict(ws.capture_info.get("active") or {})
    decoder = decoder_from(ws.capture_files, active)
    vocab = decoder["emb"].shape[0]
    predictions = ws.map_call(
        fsha.invert, (ws.activations,), 8.0 * ws.seq_len * vocab,
        consts=tuple(decoder[k] for k in DECODER_KEYS))
    return registry.AttackResult(
        predictions.astype(np.int32),
        fsha.invert_flops(ws.num_docs * ws.seq_len, vocab, ws.activations.shape[-1]),
        {"decoder_sha256": active["decoder_sha256"], "hijack_step": active.get("step"),
         "server": active.get("server")})


registry.register(FSHADecode(registry.AttackSpec(
    "fsha_decode", "active_hijack", ("activations",), knowledge=("none",), needs_weights=False,
    tier="active",
    description="FSHA: the hijacking server's decoder inverts h (argmax per position)",
    reference="Pasquini, Ateniese, Bernaschi, CCS'21 (arXiv 2012.02670), official "
              "pasquini-dario/SplitNN_FSHA; GPT-2 design: notes/active-server.md 4.4",
    threat_model="an active server that returned FSHA's adversarial gradient instead of dL/dh "
                 "for N steps; holds public text and the pilot, decoder and critic it trained "
                 "on it, no client weights",
    capabilities=("inverts its own pilot's features", "inverts a hijacked client's h"),
    checks=(("synthetic", "tests/test_active_fsha.py::test_pilot_and_decoder_train_and_invert",
             "the decoder inverts its own pilot's features on a tiny vocabulary"),
            ("synthetic", "tests/test_active_run.py::test_fsha_decode_replays_bit_identical",
             "replay and regenerate give identical predictions from the stored decoder")))))
