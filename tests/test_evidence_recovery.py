"""Crash-safe logging: a crash between writing a file and logging it, at every such point of
a replay, is followed by a resume that verifies and loses nothing.

The crash is injected by making the log's append fail for one event type, after the file
that event logs was written, in two ways: the process dies there ("killed": nothing after
it runs, so the run is left unsealed), or the append raises ("raised": the replay's
`extending` still finalizes the run on its way out). The resumed run must verify
(lla.evidence.rundir.verify), hold the predictions of an uninterrupted run byte for byte,
and say in its log what became of the file: `recovered` with the sha256 the test computes
itself (from the reference run's bytes or from the calibration tokens), or a logged
discard followed by a fresh write.
"""

import hashlib
import io
import json

import numpy as np
import pytest

from lla.capture import capture
from lla.evidence import hashlog, rundir
from lla.model.gpt2 import GPT2Config
from lla.replay import driver as replay

from test_attacks_units import random_params

CFG = GPT2Config(vocab_size=256, n_positions=16, n_embd=32, n_head=4, n_layer=3)
ATTACKS = ["ridge", "gradient_only"]


class Crash(Exception):
  """The injected failure of a log append (an exception no writer catches)."""


class Died(BaseException):
  """The injected death of the process: nothing after it runs (finalize is disabled)."""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  root = tmp_path_factory.mktemp("recovery")
  params = random_params(CFG, seed=13, std=0.05)
  rng = np.random.default_rng(13)
  tokens = rng.integers(0, CFG.vocab_size, (6, 8)).astype(np.int32)
  cal = rng.integers(0, CFG.vocab_size, (12, 8)).astype(np.int32)
  capture.capture_target(str(root / "cap"), params, CFG, tokens, range(6), 2, model_id="tiny",
                         batch_size=3)
  attacker = replay.Attacker(params, CFG, "tiny", cal, "public", {"hf_dir": "/models/tiny"})
  reference = root / "reference"
  replay.replay(str(reference), str(root / "cap"), attacker, ATTACKS, {}, seed=0, mesh=None,
                seal=True)
  assert rundir.verify(str(reference)) == []
  return root, attacker, reference


def _crash_at(monkeypatch, event_type: str, mode: str = "killed") -> type[BaseException]:
  """The next append of an event of `event_type` fails (once); returns what it raises."""
  original = hashlog.HashLog.append
  state = {"fired": False}
  error = Died if mode == "killed" else Crash

  def append(self, event, time=None):
    if event.get("type") == event_type and not state["fired"]:
      state["fired"] = True
      if mode == "killed":  # a dead process finalizes nothing on its way out
        monkeypatch.setattr(rundir, "finalize", lambda *a, **k: None)
      raise error(event_type)
    return original(self, event, time=time)

  monkeypatch.setattr(hashlog.HashLog, "append", append)
  return error


def _events(run) -> list[dict]:
  return [e["event"] for e in rundir.log(str(run)).entries()]


def _predictions(run) -> dict[str, bytes]:
  return {p.name: p.read_bytes() for p in sorted((run / "predictions").iterdir())}


def _sha(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def _calibration_bytes(tokens) -> bytes:
  buffer = io.BytesIO()
  np.save(buffer, np.ascontiguousarray(tokens, np.int32), allow_pickle=False)
  return buffer.getvalue()


def _crash_then_resume(setup, tmp_path, monkeypatch, event_type, first_attacker=None,
                       first_seed=0, mode="killed"):
  root, attacker, reference = setup
  run = tmp_path / "run"
  error = _crash_at(monkeypatch, event_type, mode)
  with pytest.raises(error):
    replay.replay(str(run), str(root / "cap"), first_attacker or attacker, ATTACKS, {},
                  seed=first_seed, mesh=None, seal=True)
  monkeypatch.undo()
  if mode == "killed":
    assert rundir.verify(str(run)), "the crash left nothing to repair"
  elif (run / rundir.LOG).exists():
    # Finalized on the way out: the unlogged file discarded, the run sealed and verifying.
    assert rundir.verify(str(run)) == []
  records = replay.replay(str(run), str(root / "cap"), attacker, ATTACKS, {}, seed=0, mesh=None,
                          seal=True)
  assert [r.status for r in records] == ["ok"] * len(ATTACKS)
  assert rundir.verify(str(run)) == []
  assert _predictions(run) == _predictions(reference)
  assert not (run / rundir.LOCK).exists()
  return run, _events(run)


@pytest.mark.parametrize("event_type, rel", [
    ("run_started", "protocol.json"),
    ("inputs", None),  # inputs/<e_hash>.json
])
def test_crash_before_logging_a_rederivable_file_recovers_it(setup, tmp_path, monkeypatch,
                                                            event_type, rel):
  _, _, reference = setup
  e_hash = _sha((reference / "protocol.json").read_bytes())
  rel = rel or f"inputs/{e_hash}.json"
  run, events = _crash_then_resume(setup, tmp_path, monkeypatch, event_type)
  recovered = [e for e in events if e["type"] == "recovered"]
  expected = _sha((reference / rel).read_bytes())  # written by an uninterrupted run
  assert [(e["file"], e["written_as"], e["sha256"]) for e in recovered] == [
      (rel, event_type, expected)]
  assert _sha((run / rel).read_bytes()) == expected
  assert not [e for e in events if e["type"] == event_type and e.get("file") == rel]


def test_crash_before_logging_the_calibration_recovers_it(setup, tmp_path, monkeypatch):
  _, attacker, _ = setup
  expected = _sha(_calibration_bytes(attacker.calibration_tokens))
  # Named by the hash of the token ids themselves (E's K.calibration_sha256).
  name = _sha(np.ascontiguousarray(attacker.calibration_tokens, np.int32).tobytes())[:16]
  rel = f"inputs/calibration_{name}.npy"
  run, events = _crash_then_resume(setup, tmp_path, monkeypatch, "input_file")
  assert [(e["file"], e["written_as"], e["sha256"]) for e in events
          if e["type"] == "recovered"] == [(rel, "input_file", expected)]
  assert _sha((run / rel).read_bytes()) == expected


@pytest.mark.parametrize("event_type, discard", [("predictions", "discard_orphan"),
                                                 ("record", "discard_unlogged")])
def test_crash_before_logging_a_result_discards_it_and_runs_again(setup, tmp_path, monkeypatch,
                                                                  event_type, discard):
  run, events = _crash_then_resume(setup, tmp_path, monkeypatch, event_type)
  folder, suffix = ("predictions", "npy") if event_type == "predictions" else ("records", "json")
  rel = f"{folder}/{ATTACKS[0]}.{suffix}"
  kinds = [(e["type"], e.get("file")) for e in events]
  assert (discard, rel) in kinds
  assert kinds.index((discard, rel)) < kinds.index((event_type, rel))
  assert not [e for e in events if e["type"] == "recovered"]


def test_crash_before_the_seal_is_sealed_on_resume(setup, tmp_path, monkeypatch):
  run, events = _crash_then_resume(setup, tmp_path, monkeypatch, "seal")
  assert [e["type"] for e in events].count("seal") == 1 and events[-1]["type"] == "seal"


def test_unlogged_files_that_differ_from_their_inputs_are_discarded(setup, tmp_path,
                                                                    monkeypatch):
  """The crashed replay pinned another weights locator (same E, other inputs/<e>.json
  bytes): on resume that file is discarded (logged) and written from the resumed inputs."""
  _, attacker, reference = setup
  other = replay.Attacker(attacker.params, attacker.cfg, attacker.model_id,
                          attacker.calibration_tokens, "public", {"hf_dir": "/elsewhere"})
  e_hash = _sha((reference / "protocol.json").read_bytes())
  rel = f"inputs/{e_hash}.json"
  run, events = _crash_then_resume(setup, tmp_path, monkeypatch, "inputs", first_attacker=other)
  kinds = [(e["type"], e.get("file")) for e in events]
  assert kinds.index(("discard_unlogged", rel)) < kinds.index(("inputs", rel))
  assert json.loads((run / rel).read_text())["attacker_source"] == {"hf_dir": "/models/tiny"}
  assert (run / rel).read_bytes() == (reference / rel).read_bytes()


def test_a_leftover_protocol_of_another_e_is_discarded(setup, tmp_path, monkeypatch):
  """A create interrupted before its log entry, for another seed (another E): the resumed
  replay of seed 0 discards that protocol.json (logged) and starts the run afresh."""
  _, _, reference = setup
  run, events = _crash_then_resume(setup, tmp_path, monkeypatch, "run_started", first_seed=1)
  assert [(e["type"], e.get("file")) for e in events[:2]] == [
      ("discard_unlogged", "protocol.json"), ("run_started", "protocol.json")]
  assert (run / "protocol.json").read_bytes() == (reference / "protocol.json").read_bytes()


def test_a_study_protocol_written_but_not_logged_is_recovered(setup, tmp_path, monkeypatch):
  """add_protocol: the study's protocols/<e_hash>.json, written and then not logged."""
  root, attacker, reference = setup
  study = tmp_path / "study"
  rundir.create_study(str(study), {"G": {"policy": "test"}})
  error = _crash_at(monkeypatch, "protocol")
  with pytest.raises(error):
    replay.replay(str(study), str(root / "cap"), attacker, ATTACKS, {}, seed=0, mesh=None)
  monkeypatch.undo()
  replay.replay(str(study), str(root / "cap"), attacker, ATTACKS, {}, seed=0, mesh=None)
  rundir.finalize(str(study))
  assert rundir.verify(str(study)) == []
  expected = _sha((reference / "protocol.json").read_bytes())  # the same E, file named by it
  rel = f"protocols/{expected}.json"
  assert [(e["file"], e["written_as"], e["sha256"]) for e in _events(study)
          if e["type"] == "recovered"] == [(rel, "protocol", expected)]
  assert _predictions(study) == _predictions(reference)


@pytest.mark.parametrize("event_type", ["inputs", "input_file", "predictions", "record"])
def test_a_replay_that_raised_is_sealed_without_the_unlogged_file(setup, tmp_path, monkeypatch,
                                                                  event_type):
  """The append raised (the process lives on): the replay's run is finalized on its way out
  with the unlogged file discarded (logged), verifies at once, and a resume completes it."""
  run, events = _crash_then_resume(setup, tmp_path, monkeypatch, event_type, mode="raised")
  first_seal = [e["type"] for e in events].index("seal")
  discarded = [e for e in events[:first_seal] if e["type"] == "discard_unlogged"]
  assert len(discarded) == 1
  assert discarded[0]["reason"] == "not logged when the run was sealed"
  rel = discarded[0]["file"]
  assert [e["type"] for e in events[first_seal + 1:]][0] == "reopen"
  written = [e for e in events[first_seal:] if e.get("file") == rel and "sha256" in e]
  assert written and written[-1]["type"] == event_type
  assert not [e for e in events if e["type"] == "recovered"]


def test_a_record_made_by_other_code_runs_again_on_resume(setup, tmp_path, monkeypatch):
  """The registered code identity changed since a finished record (an lla module the attack
  imports was edited): resuming runs that attack again (logged retry, with the two
  identities) instead of reusing a record the gates would count as unmeasured; the other
  attack's record, made by its registered code, is reused."""
  from lla.attacks import registry  # pylint: disable=g-import-not-at-top
  root, attacker, reference = setup
  run = tmp_path / "run"
  first = replay.replay(str(run), str(root / "cap"), attacker, ATTACKS, {}, seed=0, mesh=None,
                        seal=True)
  assert [r.attack_code_sha256 for r in first] == [
      registry.source(a)["sha256"] for a in ATTACKS]
  edited = {**registry.source("ridge"), "sha256": "e" * 64}
  monkeypatch.setitem(registry._SOURCES, "ridge", edited)  # pylint: disable=protected-access
  again = replay.replay(str(run), str(root / "cap"), attacker, ATTACKS, {}, seed=0, mesh=None,
                        seal=True)
  assert [r.attack_code_sha256 for r in again] == ["e" * 64, first[1].attack_code_sha256]
  assert again[1] == first[1]  # gradient_only: reused as it was
  retries = [e for e in _events(run) if e["type"] == "retry"]
  assert [(e["attack"], e["reason"]) for e in retries] == [
      ("ridge", f"made by code {first[0].attack_code_sha256[:12]}, registered code is "
                "eeeeeeeeeeee")]
  assert rundir.verify(str(run)) == []
  assert _predictions(run) == _predictions(reference)
