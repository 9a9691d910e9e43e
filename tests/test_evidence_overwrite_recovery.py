"""Files a study replaces (its threat space, scorecard, qualification outcomes, defense
utility costs): a crash at either side of each write resumes to a study that verifies.

A replacement logs the old file's removal (`supersede`) first, then writes the new bytes,
then logs them. The crash is injected as in tests/test_evidence_recovery.py, on a sealed
synthetic study being extended (lla.evidence.rundir.extending): after the new bytes are
written and before their log entry (the log's append raises), or after the removal is
logged and before the new bytes are written (the atomic write raises); "raised": the
writer's `extending` finalizes the study on its way out, which must verify and reopen;
"killed": nothing runs after the crash (finalize disabled), and the next writer must
repair what is left. Either way the same write again ends in a study that verifies and
holds the new bytes. Before, a crash after the bytes left a logged file whose bytes
differ from the log: a study that verifies no more, hence can never be reopened.
"""

import json

import pytest

from lla.evidence import files, hashlog, rundir
from lla.scoring import policy as policy_lib
from lla.scoring import scorecard
from lla.scoring import synthetic as syn
from lla.scoring import threat_space
from lla.study import qualification

POL = policy_lib.load_policy()
OLD = [{"name": "activation", "family": "beam_inversion", "observations": ["activations"]}]
NEW = OLD + [{"name": "joint", "family": "beam_inversion",
              "observations": ["activations", "gradients"]}]


class Crash(Exception):
  pass


class Died(BaseException):
  pass


def _threat_space(run, entries):
  threat_space.record(run, entries)
  return threat_space.FILE, threat_space.to_bytes(entries)


def _scorecard(run, entries):
  card = scorecard.build(run, POL, modules=entries, contrasts=False)
  scorecard.write(run, card, overwrite=True)
  return rundir.SCORECARD_JSON, scorecard.to_bytes(card)


def _utility(run, entries):
  data = files.canonical_json({"costs": [m["name"] for m in entries]})
  rundir.save_file(run, f"{rundir.INPUTS}/defense_utility.json", data, "defense_utility",
                   overwrite=True)
  return f"{rundir.INPUTS}/defense_utility.json", data


def _outcomes(run, entries):
  document = {"tests": {m["name"]: {"outcome": "passed"} for m in entries}}
  qualification.record_outcomes(run, document, "test")
  return qualification.OUTCOMES_FILE, files.canonical_json({**document, "recorded": "test"})


WRITERS = {"threat_space": (_threat_space, "threat_space"),
           "scorecard": (_scorecard, "scorecard"),
           "defense_utility": (_utility, "defense_utility"),
           "qualification": (_outcomes, "qualification_outcomes")}


@pytest.fixture(scope="module")
def cap(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("cap"))
  syn.make_capture(d, syn.truth_tokens(docs=16))
  return d


def _sealed_study(tmp_path, cap, writer):
  """A sealed synthetic run holding the writer's file made from OLD."""
  run = str(tmp_path / "run")
  syn.make_run(run, cap, [syn.Spec("activation", "beam_inversion", 3, 0)], POL.sha256,
               finalize=False)
  WRITERS[writer][0](run, OLD)
  rundir.finalize(run)
  assert rundir.verify(run) == []
  return run


@pytest.mark.parametrize("writer", sorted(WRITERS))
@pytest.mark.parametrize("point", ["after_bytes", "before_bytes"])
@pytest.mark.parametrize("mode", ["raised", "killed"])
def test_a_crash_replacing_a_study_file_resumes_to_a_verifying_study(tmp_path, cap, monkeypatch,
                                                                     writer, point, mode):
  run = _sealed_study(tmp_path, cap, writer)
  write, event_type = WRITERS[writer]
  error = Died if mode == "killed" else Crash
  fired = []
  if point == "after_bytes":
    original = hashlog.HashLog.append

    def append(self, event, time=None):
      if event.get("type") == event_type and not fired:
        fired.append(event["file"])
        raise error(event["file"])
      return original(self, event, time=time)
    monkeypatch.setattr(hashlog.HashLog, "append", append)
  else:
    original = files.atomic_write_bytes

    def atomic_write_bytes(path, data, overwrite=False):
      if not fired and path.startswith(run) and "/log.jsonl" not in path and (
          "manifest" not in path):
        fired.append(path)
        raise error(path)
      return original(path, data, overwrite=overwrite)
    monkeypatch.setattr(files, "atomic_write_bytes", atomic_write_bytes)
  if mode == "killed":
    monkeypatch.setattr(rundir, "finalize", lambda *a, **k: None)
  with pytest.raises(error):
    with rundir.extending(run):
      write(run, NEW)
  monkeypatch.undo()
  assert fired
  if mode == "raised":
    # Finalized on the way out without the unlogged file: it verifies, so it reopens.
    assert rundir.verify(run) == []
  with rundir.extending(run, always_finalize=True):
    rel, data = write(run, NEW)
  assert rundir.verify(run) == []
  with open(f"{run}/{rel}", "rb") as f:
    assert f.read() == data
  events = [e["event"] for e in rundir.log(run).entries()]
  assert [e["type"] for e in events if e.get("file") == rel][:2] == [event_type, "supersede"]


def test_replacing_a_file_changed_after_it_was_logged_is_refused(tmp_path, cap):
  run = _sealed_study(tmp_path, cap, "defense_utility")
  rel = f"{rundir.INPUTS}/defense_utility.json"
  with rundir.extending(run):
    with open(f"{run}/{rel}", "w") as f:
      json.dump({"forged": True}, f)
    with pytest.raises(ValueError, match="differs from the sha256 log.jsonl recorded"):
      _utility(run, NEW)
    with pytest.raises(ValueError, match="defense_utility.json: differs from the sha256"):
      rundir.read_logged_json(run, rel)


@pytest.mark.parametrize("mode", ["raised", "killed"])
def test_a_crash_pinning_the_tokenizer_resumes_to_a_verifying_study(tmp_path, cap, monkeypatch,
                                                                    data_dir, mode):
  """The tokenizer's definition written, its `input_file` entry not: raised, the study is
  finalized without it; killed, the next pin logs the same bytes as recovered. Either way
  the pinned tokenizer is the one given, by hash, and the study verifies."""
  from lla.data.tokenizer import load_tokenizer  # pylint: disable=g-import-not-at-top
  tokenizer = load_tokenizer(str(data_dir))
  run = _sealed_study(tmp_path, cap, "threat_space")
  original, error = hashlog.HashLog.append, Died if mode == "killed" else Crash

  def append(self, event, time=None):
    if event.get("file") == scorecard.TOKENIZER_FILE and event["type"] == "input_file":
      raise error(event["file"])
    return original(self, event, time=time)

  monkeypatch.setattr(hashlog.HashLog, "append", append)
  if mode == "killed":
    monkeypatch.setattr(rundir, "finalize", lambda *a, **k: None)
  with pytest.raises(error):
    with rundir.extending(run):
      scorecard.pin_tokenizer(run, tokenizer)
  monkeypatch.undo()
  assert (rundir.verify(run) == []) == (mode == "raised")
  with rundir.extending(run, always_finalize=True):
    scorecard.pin_tokenizer(run, tokenizer)
  assert rundir.verify(run) == []
  assert scorecard.pinned_tokenizer(run).sha256 == tokenizer.sha256
  kinds = [e["event"]["type"] for e in rundir.log(run).entries()
           if e["event"].get("file") == scorecard.TOKENIZER_FILE]
  assert kinds == (["discard_unlogged", "input_file"] if mode == "raised" else ["recovered"])
