"""The seal's anchor: experiments.verify prints the seal hash, `--expect=HASH` fails on any
other, and a run rewritten and re-chained from scratch (which verifies on its own) fails
against the published hash.

The expected hash is recomputed here from log.jsonl's last line with hashlib and json (the
entry's index, prev, time and event, canonical JSON), and the forgery is made with hashlib
and json alone, not with lla's writers.
"""

import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from lla.capture import capture
from lla.evidence import rundir
from lla.model.gpt2 import GPT2Config
from lla.replay import driver as replay

from test_attacks_units import random_params

REPO = pathlib.Path(__file__).resolve().parent.parent
CFG = GPT2Config(vocab_size=256, n_positions=16, n_embd=32, n_head=4, n_layer=3)


def _canonical(obj) -> bytes:
  return (json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
          + "\n").encode("utf-8")


def _sha(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def _entries(run: pathlib.Path) -> list[dict]:
  return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


def _seal_hash(run: pathlib.Path) -> str:
  """The last entry's hash, recomputed from its fields; it must be a seal."""
  last = _entries(run)[-1]
  assert last["event"]["type"] == "seal"
  recomputed = _sha(_canonical({k: last[k] for k in ("index", "prev", "time", "event")}))
  assert recomputed == last["hash"]
  return recomputed


def _verify(run, *extra):
  return subprocess.run([sys.executable, "-m", "experiments.verify", f"--workdir={run}", *extra],
                        capture_output=True, text=True, cwd=REPO, timeout=300,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  root = tmp_path_factory.mktemp("anchor")
  params = random_params(CFG, seed=17, std=0.05)
  rng = np.random.default_rng(17)
  tokens = rng.integers(0, CFG.vocab_size, (6, 8)).astype(np.int32)
  cal = rng.integers(0, CFG.vocab_size, (12, 8)).astype(np.int32)
  capture.capture_target(str(root / "cap"), params, CFG, tokens, range(6), 2, model_id="tiny",
                         batch_size=3)
  attacker = replay.Attacker(params, CFG, "tiny", cal, "public", {"hf_dir": "/models/tiny"})
  replay.replay(str(root / "run"), str(root / "cap"), attacker, ["ridge"], {}, seed=0,
                mesh=None, seal=True)
  return root, attacker


def _copy(root: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
  """A copy of the run beside a copy of its capture (records name it as ../cap)."""
  shutil.copytree(root / "cap", tmp_path / "cap")
  return shutil.copytree(root / "run", tmp_path / "run")


def _forge(run: pathlib.Path) -> None:
  """Rewrites ridge's predictions, its record's hash, every log entry naming them (the whole
  chain re-hashed) and the manifest: a consistent rewrite of the whole run."""
  pred = run / "predictions" / "ridge.npy"
  forged = np.load(pred)
  forged[0, :] = (forged[0, :] + 1) % CFG.vocab_size
  pred.unlink()
  np.save(pred, forged, allow_pickle=False)
  record_path = run / "records" / "ridge.json"
  record = json.loads(record_path.read_text())
  record["prediction_sha256"] = _sha(pred.read_bytes())
  record_path.write_bytes(_canonical(record))
  new_sha = {"predictions/ridge.npy": _sha(pred.read_bytes()),
             "records/ridge.json": _sha(record_path.read_bytes())}
  lines, prev = [], "0" * 64
  for entry in _entries(run):
    event = dict(entry["event"])
    if event.get("file") in new_sha and "sha256" in event:
      event["sha256"] = new_sha[event["file"]]
    body = {"index": entry["index"], "prev": prev, "time": entry["time"], "event": event}
    prev = _sha(_canonical(body))
    lines.append(_canonical({**body, "hash": prev}))
  (run / "log.jsonl").write_bytes(b"".join(lines))
  (run / "manifest.sha256").unlink()
  listing = sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file())
  (run / "manifest.sha256").write_text(
      "".join(f"{_sha((run / rel).read_bytes())}  {rel}\n" for rel in listing))


def test_verify_prints_the_seal_and_checks_it_against_expect(setup, tmp_path):
  root, _ = setup
  run = _copy(root, tmp_path)
  seal = _seal_hash(run)
  proc = _verify(run)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert f"SEAL {seal} " in proc.stdout
  assert _verify(run, f"--expect={seal}").returncode == 0
  assert _verify(run, f"--expect={seal.upper()}").returncode == 0
  other = _sha(b"another run")
  proc = _verify(run, f"--expect={other}")
  assert proc.returncode != 0 and "Traceback" not in proc.stderr and "OK" not in proc.stdout
  line, = proc.stderr.strip().splitlines()
  assert seal in line and other in line and "differs" in line
  proc = _verify(run, "--expect=12ab")
  assert proc.returncode != 0 and proc.stderr.strip().splitlines() == [
      "--expect='12ab': not a sha256 (64 hex digits)"]


def test_a_rewritten_and_rechained_run_fails_only_against_the_anchor(setup, tmp_path):
  root, _ = setup
  run = _copy(root, tmp_path)
  published = _seal_hash(run)
  original = (run / "predictions" / "ridge.npy").read_bytes()
  _forge(run)
  assert (run / "predictions" / "ridge.npy").read_bytes() != original
  forged_seal = _seal_hash(run)
  assert forged_seal != published
  proc = _verify(run)  # on its own, the forgery verifies
  assert proc.returncode == 0, proc.stdout
  assert f"SEAL {forged_seal} " in proc.stdout
  proc = _verify(run, f"--expect={published}")
  assert proc.returncode != 0
  line, = proc.stderr.strip().splitlines()
  assert published in line and forged_seal in line


def test_an_earlier_seal_is_named_as_such(setup, tmp_path):
  root, attacker = setup
  run = _copy(root, tmp_path)
  first = _seal_hash(run)
  replay.replay(str(run), str(tmp_path / "cap"), attacker, ["gradient_only"], {}, seed=0,
                mesh=None, seal=True)
  second = _seal_hash(run)
  assert second != first
  # The reopen entry names the first seal: it is an earlier seal of the same chain.
  assert [e["event"]["seal_hash"] for e in _entries(run) if e["event"]["type"] == "reopen"] == [
      first]
  proc = _verify(run, f"--expect={first}")
  assert proc.returncode != 0
  line, = proc.stderr.strip().splitlines()
  assert "earlier seal" in line and second in line
  assert _verify(run, f"--expect={second}").returncode == 0


def test_the_report_shows_the_seal(setup, tmp_path):
  from lla.study import report  # pylint: disable=g-import-not-at-top
  root, _ = setup
  run = _copy(root, tmp_path)
  line = report.seal_line(run)
  assert f"`{_seal_hash(run)}`" in line and f"--expect={_seal_hash(run)}" in line
  (run / "log.jsonl").write_bytes(b"".join(
      _canonical(e) for e in _entries(run)[:-1]))  # the seal cut off
  assert report.seal_line(run).startswith("Seal: none")


def _keypair(directory: pathlib.Path, name: str) -> tuple[pathlib.Path, str]:
  """A fresh ed25519 key without passphrase: (private key file, public key line)."""
  key = directory / name
  subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(key)],
                 check=True, capture_output=True, timeout=60)
  return key, (directory / f"{name}.pub").read_text().split(" ", 2)[:2]


def test_a_signed_seal_verifies_against_the_published_key_only(setup, tmp_path):
  """`--sign_with` signs the line 'lla-seal <seal>' (checked here with ssh-keygen directly, on
  the seal recomputed from the log), changes no file of the run, and `--signers/--signer`
  accepts that signature and refuses another key's, another identity, and a forgery's seal."""
  root, _ = setup
  run = _copy(root, tmp_path)
  seal = _seal_hash(run)
  alice, alice_pub = _keypair(tmp_path, "alice")
  mallory, _ = _keypair(tmp_path, "mallory")
  signers = tmp_path / "allowed_signers"
  signers.write_text(f"alice@lab namespaces=\"lla-seal\" {' '.join(alice_pub)}\n")
  before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
  proc = _verify(run, f"--sign_with={alice}")
  assert proc.returncode == 0, proc.stdout + proc.stderr
  signature = pathlib.Path(f"{run}.seal.sig")
  assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
  direct = subprocess.run(["ssh-keygen", "-Y", "verify", "-f", str(signers), "-I", "alice@lab",
                           "-n", "lla-seal", "-s", str(signature)],
                          input=f"lla-seal {seal}\n".encode(), capture_output=True, timeout=60)
  assert direct.returncode == 0, direct.stderr
  check = ("--signers=" + str(signers), "--signer=alice@lab")
  proc = _verify(run, *check)
  assert proc.returncode == 0 and "signed by the expected key" in proc.stdout, proc.stderr
  refusals = [("another identity", ("--signers=" + str(signers), "--signer=bob@lab"))]
  mallory_sig = tmp_path / "mallory.sig"
  assert _verify(run, f"--sign_with={mallory}", f"--signature={mallory_sig}").returncode == 0
  refusals.append(("another key", (*check, f"--signature={mallory_sig}")))
  for what, extra in refusals:
    proc = _verify(run, *extra)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, (what, proc.stderr)
    line, = proc.stderr.strip().splitlines()
    assert "not a valid signature of seal " + seal in line, (what, line)
  # A forgery re-chained from scratch has another seal: alice's signature does not cover it.
  _forge(run)
  proc = _verify(run, *check)
  assert proc.returncode != 0
  line, = proc.stderr.strip().splitlines()
  assert "not a valid signature of seal " + _seal_hash(run) in line, line
