"""`python -m experiments.fetch_data` against a Hugging Face hub served by the test on 127.0.0.1.

The server speaks the part of the hub protocol `hf_hub_download` uses (HEAD, then GET, of
`/{datasets/}{repo}/resolve/{revision}/{path}`, answered with X-Repo-Commit, ETag and
Content-Length) and serves only the pinned revisions, so a fetch that asked for another
commit gets a 404. Its files are built here from the data directory's copy: the tokenizer
files as they are, each WikiText split as the hub stores it, one parquet row per line with
the blank line " \\n" as an empty row. Every fetch runs as the binary in a subprocess whose
HF_ENDPOINT is the local server (huggingface_hub reads it at import), so no test reaches the
internet.

The sums checked are the ones ../shared/data/README.md records, written out here. The
data directory's valid/test/tokenizer files are the canonical ones, so the fetched copies
must carry the canonical sums. Its train.txt is the re-packed copy (articles in another
order), so the train served here, and fetched, is that copy: sha256 728c77e8..., not the
canonical git blob 2d84b35a... that the real hub's rows give.

The last tests check that the corpus names its copy and that E carries it (E.C.copy).
"""

import hashlib
import http.server
import io
import json
import os
import socket
import subprocess
import sys
import threading
import types
from pathlib import Path

import jax
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from configs import capture as capture_config
from lla.capture import runner
from lla.data import corpora
from lla.data import fetch
from lla.data import paths
from lla.data import tokenizer as tokenizer_lib
from lla.model import hf_io
from lla.model.gpt2 import GPT2Config
from lla.model.gpt2 import init_params
from lla.protocol import tuple as protocol

_REPO_ROOT = Path(__file__).resolve().parent.parent
WIKITEXT_REVISION = "b08601e04326c79dfdd32d625aee71d232d685c3"
GPT2_REVISION = "607a30d783dfa663caf39e06633721c8d4cfcd7e"

# ../shared/data/README.md.
CANONICAL_SHA256 = {
    "wikitext-2/valid.txt": "f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8",
    "wikitext-2/test.txt": "d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0",
    "gpt2-tokenizer/vocab.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "gpt2-tokenizer/merges.txt": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}
REPACKED_TRAIN_SHA256 = "728c77e87e176af4730f9a80fc6008bcaff421a7202c1c048877c0eec3685f89"
VALID_GIT_BLOB = "eec944eb2d9e46061cd34a6913528797db6842fc"
LAYOUT = (*CANONICAL_SHA256, "wikitext-2/train.txt")


def _sha256(path: Path) -> str:
  return hashlib.sha256(path.read_bytes()).hexdigest()


def _hub_parquet(text: bytes) -> bytes:
  """A WikiText file as the hub's parquet: one row per line, " \\n" as ""."""
  rows = ["" if line == " \n" else line for line in text.decode("utf-8").splitlines(keepends=True)]
  buffer = io.BytesIO()
  pq.write_table(pa.table({"text": pa.array(rows, pa.string())}), buffer)
  return buffer.getvalue()


def _served_files(data_dir: Path) -> dict[str, bytes]:
  """URL path -> bytes, at the pinned revisions only."""
  wikitext = f"/datasets/Salesforce/wikitext/resolve/{WIKITEXT_REVISION}/wikitext-2-v1"
  gpt2 = f"/openai-community/gpt2/resolve/{GPT2_REVISION}"
  files = {f"{gpt2}/{name}": (data_dir / "gpt2-tokenizer" / name).read_bytes()
           for name in ("vocab.json", "merges.txt")}
  for split, hub_split in (("train", "train"), ("valid", "validation"), ("test", "test")):
    text = (data_dir / "wikitext-2" / f"{split}.txt").read_bytes()
    files[f"{wikitext}/{hub_split}-00000-of-00001.parquet"] = _hub_parquet(text)
  return files


class _Hub(http.server.ThreadingHTTPServer):
  """The hub's file endpoint on 127.0.0.1; `files` may be replaced between fetches."""

  def __init__(self, files: dict[str, bytes]):
    self.files = files
    self.requests: list[tuple[str, str]] = []
    super().__init__(("127.0.0.1", 0), _HubHandler)

  @property
  def url(self) -> str:
    return f"http://127.0.0.1:{self.server_address[1]}"


class _HubHandler(http.server.BaseHTTPRequestHandler):
  server: _Hub

  def do_HEAD(self):  # pylint: disable=invalid-name
    self._answer(body=False)

  def do_GET(self):  # pylint: disable=invalid-name
    self._answer(body=True)

  def _answer(self, body: bool) -> None:
    path = self.path.split("?")[0]
    self.server.requests.append((self.command, path))
    data = self.server.files.get(path)
    if data is None:
      self.send_error(404)
      return
    self.send_response(200)
    # What `get_hf_file_metadata` needs: the commit, an ETag (the hub's is the git blob id
    # of a small file) and the size.
    self.send_header("X-Repo-Commit", path.split("/resolve/")[1].split("/")[0])
    self.send_header("ETag", '"%s"' % hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest())
    self.send_header("Content-Length", str(len(data)))
    self.end_headers()
    if body:
      self.wfile.write(data)

  def log_message(self, *args):  # keeps the test's output to its failures
    pass


@pytest.fixture(scope="module")
def served(data_dir):
  return _served_files(data_dir)


@pytest.fixture
def hub(served):
  server = _Hub(dict(served))
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  yield server
  server.shutdown()
  server.server_close()


def _run_fetch(endpoint: str, *args: str, tmp_path: Path, offline: bool = False,
               env: dict[str, str] | None = None, cwd: Path = _REPO_ROOT):
  environment = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and k != paths.ENV_VAR}
  environment.update(
      HF_ENDPOINT=endpoint, HF_HOME=str(tmp_path / "hf-home"),  # no user token, no user cache
      HF_HUB_OFFLINE="1" if offline else "0", HF_HUB_ETAG_TIMEOUT="10", HF_HUB_DOWNLOAD_TIMEOUT="10",
      NO_PROXY="127.0.0.1", no_proxy="127.0.0.1", PYTHONPATH=str(_REPO_ROOT), **(env or {}))
  return subprocess.run([sys.executable, "-m", "experiments.fetch_data", *args], cwd=cwd,
                        env=environment, capture_output=True, text=True, timeout=300, check=False)


def _all_entries(directory: Path) -> set[str]:
  return {str(p.relative_to(directory)) for p in directory.rglob("*")}


def test_fetch_writes_the_recorded_files_and_a_second_run_downloads_nothing(hub, tmp_path):
  out = tmp_path / "data"
  run = _run_fetch(hub.url, f"--out={out}", tmp_path=tmp_path)
  assert run.returncode == 0, run.stderr
  for relative, expected in CANONICAL_SHA256.items():
    assert _sha256(out / relative) == expected, relative
  assert _sha256(out / "wikitext-2/train.txt") == REPACKED_TRAIN_SHA256
  assert "shared-repacked copy" in run.stdout
  # Only the layout stays: the hub's cache and the temporary files are gone.
  assert _all_entries(out) == {"wikitext-2", "gpt2-tokenizer", *LAYOUT}
  # Every served file was fetched at its pinned path (huggingface_hub 2.x also asks
  # /api/agent-harnesses, its own telemetry, which is answered 404 here).
  assert {path for method, path in hub.requests if method == "GET" and "/resolve/" in path} == set(hub.files)

  hub.requests.clear()
  again = _run_fetch(hub.url, f"--out={out}", tmp_path=tmp_path)
  assert again.returncode == 0, again.stderr
  assert hub.requests == []
  assert "0 downloaded, 5 already there" in again.stdout


def test_out_defaults_to_lla_data_dir_else_data_in_the_working_directory(hub, tmp_path):
  from_env = tmp_path / "from-env"
  run = _run_fetch(hub.url, tmp_path=tmp_path, env={paths.ENV_VAR: str(from_env)})
  assert run.returncode == 0, run.stderr
  assert _all_entries(from_env) == {"wikitext-2", "gpt2-tokenizer", *LAYOUT}
  elsewhere = tmp_path / "cwd"
  elsewhere.mkdir()
  run = _run_fetch(hub.url, tmp_path=tmp_path, cwd=elsewhere)
  assert run.returncode == 0, run.stderr
  assert _all_entries(elsewhere / "data") == {"wikitext-2", "gpt2-tokenizer", *LAYOUT}


def test_a_recognised_copy_is_verified_and_nothing_downloaded(hub, data_dir, tmp_path):
  before = {p: p.stat().st_mtime_ns for p in data_dir.rglob("*")}
  run = _run_fetch(hub.url, f"--out={data_dir}", tmp_path=tmp_path)
  assert run.returncode == 0, run.stderr
  assert hub.requests == []
  assert "shared-repacked copy" in run.stdout and "0 downloaded" in run.stdout
  assert {p: p.stat().st_mtime_ns for p in data_dir.rglob("*")} == before


def test_a_corrupt_served_file_is_refused_in_one_line_and_leaves_no_file(hub, tmp_path):
  valid = next(path for path in hub.files if "validation" in path)
  text = (pq.read_table(io.BytesIO(hub.files[valid])).column("text").to_pylist())
  index = next(i for i, row in enumerate(text) if "lobster" in row)
  text[index] = text[index].replace("lobster", "lobstar", 1)  # one letter of one article
  buffer = io.BytesIO()
  pq.write_table(pa.table({"text": pa.array(text, pa.string())}), buffer)
  hub.files[valid] = buffer.getvalue()
  out = tmp_path / "data"
  run = _run_fetch(hub.url, f"--out={out}", tmp_path=tmp_path)
  assert run.returncode == 1
  assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr
  assert "wikitext-2/valid.txt as downloaded" in run.stderr and "matches no recorded copy" in run.stderr
  # The files fetched before it verified and stay; the corrupt one left nothing, not even a
  # temporary file, and nothing after it was fetched.
  assert _all_entries(out) == {"gpt2-tokenizer", "gpt2-tokenizer/vocab.json",
                               "gpt2-tokenizer/merges.txt"}


def test_a_file_that_is_not_parquet_is_refused_in_one_line(hub, tmp_path):
  test_split = next(path for path in hub.files if "/test-" in path)
  hub.files[test_split] = hub.files[test_split][: len(hub.files[test_split]) // 2]  # cut short
  run = _run_fetch(hub.url, f"--out={tmp_path / 'data'}", tmp_path=tmp_path)
  assert run.returncode == 1
  assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr
  assert "test-00000-of-00001.parquet: not a parquet file" in run.stderr
  assert not (tmp_path / "data" / "wikitext-2" / "test.txt").exists()


def test_an_unrecognised_file_already_there_is_refused_and_kept(hub, tmp_path):
  out = tmp_path / "data"
  (out / "gpt2-tokenizer").mkdir(parents=True)
  (out / "gpt2-tokenizer" / "merges.txt").write_bytes(b"#version: 0.2\n")
  run = _run_fetch(hub.url, f"--out={out}", tmp_path=tmp_path)
  assert run.returncode == 1
  assert "merges.txt exists and matches no recorded copy" in run.stderr
  assert (out / "gpt2-tokenizer" / "merges.txt").read_bytes() == b"#version: 0.2\n"
  assert hub.requests == []


@pytest.mark.parametrize("offline", [False, True])
def test_no_data_and_no_network_is_one_line_naming_both_ways(tmp_path, offline):
  with socket.socket() as probe:  # a port nothing listens on once the probe is closed
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
  run = _run_fetch(f"http://127.0.0.1:{port}", f"--out={tmp_path / 'data'}", tmp_path=tmp_path,
                   offline=offline)
  assert run.returncode == 1
  assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr
  assert f"{paths.ENV_VAR}=DIR" in run.stderr
  assert "python -m experiments.fetch_data --out DIR" in run.stderr
  assert not (tmp_path / "data" / "gpt2-tokenizer" / "vocab.json").exists()


def test_no_data_directory_names_the_fetch_command(monkeypatch):
  monkeypatch.delenv(paths.ENV_VAR, raising=False)
  with pytest.raises(paths.DataNotFoundError) as error:
    paths.resolve_data_dir(None)
  assert "python -m experiments.fetch_data" in str(error.value)


def test_identities_are_sha256_and_the_git_blob_id(data_dir):
  ids = fetch.identities((data_dir / "wikitext-2/valid.txt").read_bytes())
  assert ids == {f"sha256:{CANONICAL_SHA256['wikitext-2/valid.txt']}", f"git-blob:{VALID_GIT_BLOB}"}


def test_identify_names_the_copy_of_a_corpus(data_dir, tmp_path):
  splits = {f"wikitext-2/{s}.txt": data_dir / "wikitext-2" / f"{s}.txt" for s in ("train", "valid", "test")}
  assert fetch.identify(splits) == "shared-repacked"
  changed = tmp_path / "train.txt"
  changed.write_bytes(splits["wikitext-2/train.txt"].read_bytes().replace(b"lobster", b"lobstar", 1))
  assert fetch.identify({**splits, "wikitext-2/train.txt": changed}) == fetch.UNRECOGNISED


def test_the_corpus_records_its_copy_and_e_names_it_only_when_known(data_dir, tmp_path):
  tokenizer = tokenizer_lib.load_tokenizer(data_dir)
  assert corpora.WikiText2(tokenizer, data_dir=data_dir).metadata()["copy"] == "shared-repacked"
  # The same splits with one word of train changed are no recorded copy.
  other = tmp_path / "other"
  (other / "wikitext-2").mkdir(parents=True)
  for split in ("valid", "test"):
    (other / "wikitext-2" / f"{split}.txt").symlink_to(data_dir / "wikitext-2" / f"{split}.txt")
  (other / "wikitext-2" / "train.txt").write_bytes(
      (data_dir / "wikitext-2" / "train.txt").read_bytes().replace(b"lobster", b"lobstar", 1))
  assert corpora.WikiText2(tokenizer, data_dir=other).metadata()["copy"] == fetch.UNRECOGNISED

  target = protocol.Target(model_id="m", cut=1, n_layer=2)
  before = protocol.make(T=target, C=protocol.Corpora(seq_len=32))
  assert "copy" not in before.to_dict()["C"]  # an E without a copy keeps the hash it had
  named = protocol.make(T=target, C=protocol.Corpora(seq_len=32, copy="shared-repacked"))
  assert named.to_dict()["C"]["copy"] == "shared-repacked"
  assert named.sha256() != before.sha256()
  assert protocol.ProtocolTuple.from_dict(named.to_dict()) == named


def test_a_capture_of_wikitext_records_the_copy_in_e(data_dir, tmp_path):
  cfg = GPT2Config(vocab_size=50257, n_positions=16, n_embd=8, n_layer=2, n_head=2)
  hf_io.save_hf_dir(init_params(cfg, jax.random.key(0)), cfg, tmp_path / "model")
  config = capture_config.get_config("tiny")
  config.model.hf_dir = str(tmp_path / "model")
  config.data.data_dir = str(data_dir)
  config.data.seq_len, config.data.n_calibration, config.data.n_train, config.data.n_eval = 8, 1, 1, 2
  config.cut, config.training, config.batch_size = 1, False, 2
  runner.capture_from_config(config, str(tmp_path / "capture"))
  e = json.loads((tmp_path / "capture" / "metadata.json").read_text())["protocol"]
  assert e["C"]["name"] == "wikitext2" and e["C"]["copy"] == "shared-repacked"


def test_the_hub_corpus_reads_rows_back_into_the_files_text(data_dir, served, monkeypatch):
  # `datasets` gives WikiText2Hub the rows of the hub's parquet; a stand-in serves the ones
  # built above from the data directory's valid.txt.
  valid = pq.read_table(io.BytesIO(next(data for path, data in served.items() if "validation" in path)))
  stand_in = types.ModuleType("datasets")
  stand_in.load_dataset = lambda name, config, split: {"text": valid.column("text").to_pylist()}
  monkeypatch.setitem(sys.modules, "datasets", stand_in)
  tokenizer = tokenizer_lib.load_tokenizer(data_dir)
  text = corpora.WikiText2Hub(tokenizer).documents("valid")
  assert text == [(data_dir / "wikitext-2" / "valid.txt").read_text(encoding="utf-8")]


def test_an_out_that_is_a_file_is_one_line(hub, tmp_path):
  (tmp_path / "file").write_text("not a directory")
  run = _run_fetch(hub.url, f"--out={tmp_path / 'file'}", tmp_path=tmp_path)
  assert run.returncode == 1
  assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr
  assert f"cannot write the data under {tmp_path / 'file'}" in run.stderr
