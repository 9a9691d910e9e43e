"""experiments/real_weights.py on a tiny random Llama written as a GGUF file.

The vocabulary is the 256 byte-level symbols with no merges, so a passage's token ids are its
UTF-8 bytes mapped through that alphabet: the test computes the documents and the calibration
passages from the WikiText-2 text itself, the frequency baseline from them, and every
attack's recovery from the stored predictions, and checks the scorecard against those.
"""

import hashlib
import json
import os
import pathlib
import re
import subprocess
import sys

import gguf
import numpy as np
import pytest
import tokenizers
import torch
import transformers

from lla.evidence import rundir
from test_model_gguf import write_gguf

pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parent.parent
ALPHABET = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
# GPT-2's byte -> symbol map (bytes_to_unicode): printable bytes map to themselves, the
# rest to U+0100 onwards in byte order.
_PRINTABLE = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
              *range(ord("®"), ord("ÿ") + 1)]
_SYMBOL = {b: chr(b) for b in _PRINTABLE}
_SYMBOL.update({b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in _SYMBOL)})
T, DOCS, CAL, MIN_CHARS, SEED = 16, 4, 16, 200, 0


def _ids(text: str) -> list[int]:
  return [ALPHABET.index(_SYMBOL[b]) for b in text.encode("utf-8")]


def tiny_llama() -> transformers.LlamaForCausalLM:
  """The tiny random Llama (byte-level vocabulary) that `gguf_file` writes: the same weights
  on every call."""
  torch.manual_seed(0)
  cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=3, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=64,
                                 tie_word_embeddings=True,
                                 rope_parameters=dict(rope_type="default", rope_theta=10000.0))
  return transformers.LlamaForCausalLM(cfg).eval()


def gguf_file(path: pathlib.Path, add_bos: bool = False) -> pathlib.Path:
  """`tiny_llama` written to `path` as a float32 GGUF file with the byte-level tokenizer."""
  write_gguf(tiny_llama(), "llama", gguf.GGMLQuantizationType.F32, path, tokens=ALPHABET,
             add_bos=add_bos)
  return path


def _paragraphs(data_dir: pathlib.Path, split: str) -> list[str]:
  lines = [l.strip() for l in (data_dir / "wikitext-2" / f"{split}.txt").read_text(
      encoding="utf-8").splitlines()]
  return [l for l in lines if len(l) >= MIN_CHARS and not l.startswith("=")]


def _drawn(texts: list[str], n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
  eligible = [i for i, t in enumerate(texts) if len(_ids(t)) >= T]
  chosen = np.sort(np.random.default_rng(seed).choice(eligible, n, replace=False))
  return np.asarray([_ids(texts[i])[:T] for i in chosen], np.int32), chosen


def _run(workdir, gguf_path, *extra):
  return subprocess.run(
      [sys.executable, "-m", "experiments.real_weights", "--config=configs/real_weights.py:tiny",
       f"--config.model.gguf={gguf_path}", f"--config.data.seq_len={T}", "--config.cut=2",
       f"--workdir={workdir}", *extra],
      capture_output=True, text=True, cwd=REPO, timeout=600,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))


@pytest.fixture(scope="module")
def finished(tmp_path_factory, data_dir):
  root = tmp_path_factory.mktemp("real")
  path = gguf_file(root / "tiny.gguf")
  proc = _run(root / "out", path)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return root, path, proc.stdout


def test_documents_baseline_and_recovery_from_the_text(finished, data_dir):
  root, _, stdout = finished
  docs, doc_index = _drawn(_paragraphs(data_dir, "test"), DOCS, SEED)
  calibration, _ = _drawn(_paragraphs(data_dir, "train"), CAL, SEED + 1)
  run = root / "out" / "run"
  assert rundir.verify(str(run)) == []
  card = json.loads((run / rundir.SCORECARD_JSON).read_text())
  (undefended,) = card["undefended"]
  records = {r.attack: r for r in rundir.load_records(str(run))}
  assert sorted(records) == ["activation", "ridge"]
  # The most frequent calibration token; ties (none expected in 256 bytes) by lowest id.
  counts = np.bincount(calibration.ravel(), minlength=256)
  baseline = int(np.argmax(counts))
  assert counts[baseline] > np.partition(counts, -2)[-2]
  for name, record in records.items():
    truth = np.asarray(rundir.load_truth(rundir.resolve(str(run), record.truth_file)))
    np.testing.assert_array_equal(truth, docs)
    assert record.baseline_token == baseline
    pred = np.load(rundir.resolve(str(run), record.prediction_file))
    row = undefended["pooled"][name]
    assert row["token_recovery"] == pytest.approx((pred == docs).mean(), abs=1e-12)
    assert row["exact_doc_recovery"] == pytest.approx((pred == docs).all(axis=1).mean())
    assert row["baseline_p0"] == pytest.approx((docs == baseline).mean(), abs=1e-12)
    line = next(l for l in stdout.splitlines() if l.startswith(name + " "))
    assert f"{100 * (pred == docs).mean():.2f}%" in line
  capture_meta = json.loads((root / "out" / "capture" / "metadata.json").read_text())
  assert capture_meta["document_ids"] == doc_index.tolist()
  assert capture_meta["model"]["format"] == "gguf" and capture_meta["model"]["family"] == "llama"
  # The draws are pinned in E: the int32 bytes then the int64 shape (lla.data.passages).
  pinned = lambda a: hashlib.sha256(a.astype("<i4").tobytes() +
                                    np.asarray(a.shape, "<i8").tobytes()).hexdigest()
  assert dict(capture_meta["protocol"]["C"]["split_hashes"]) == {
      "documents": pinned(docs), "calibration": pinned(calibration)}


def text_bytes(ids) -> bytes:
  """The bytes that byte-level ids stand for."""
  byte_of = {symbol: b for b, symbol in _SYMBOL.items()}
  return bytes(byte_of[ALPHABET[i]] for i in ids)


def _text(ids) -> str:
  """The UTF-8 text of byte-level ids (a cut multi-byte character reads as U+FFFD)."""
  return text_bytes(ids).decode("utf-8", errors="replace")


def _rouge_l_words(pred: str, truth: str) -> float:
  """ROUGE-L F1 over lower-cased alphanumeric words (rouge-score's default tokenizer)."""
  a, b = (re.findall(r"[a-z0-9]+", t.lower()) for t in (pred, truth))
  lcs = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
  for i, x in enumerate(a):
    for j, y in enumerate(b):
      lcs[i + 1][j + 1] = lcs[i][j] + 1 if x == y else max(lcs[i][j + 1], lcs[i + 1][j])
  common = lcs[-1][-1]
  if not common:
    return 0.0
  precision, recall = common / len(a), common / len(b)
  return 2 * precision * recall / (precision + recall)


def test_text_rouge_decodes_with_the_models_tokenizer_pinned_in_the_study(finished, data_dir):
  """ROUGE-L on text decodes with the GGUF's own tokenizer, pinned in the study: the
  scorecard's figure against the text decoded here byte by byte, and a rescore from the
  study alone (no data directory) reproduces the scorecard."""
  root, _, _ = finished
  run = root / "out" / "run"
  card = json.loads((run / rundir.SCORECARD_JSON).read_text())
  assert card["similarity_note"] is None
  (undefended,) = card["undefended"]
  for record in rundir.load_records(str(run)):
    truth = np.asarray(rundir.load_truth(rundir.resolve(str(run), record.truth_file)))
    pred = np.load(rundir.resolve(str(run), record.prediction_file))
    expected = np.mean([_rouge_l_words(_text(p), _text(t)) for p, t in zip(pred, truth)])
    got = undefended["similarity"][record.attack]["rouge_l_text"]
    assert got == pytest.approx(expected, abs=1e-12), record.attack
  assert any(r["similarity"]["rouge_l_text"] > 0 for r in card["rows"])  # not all zero
  env = {k: v for k, v in os.environ.items() if k != "LLA_DATA_DIR"}
  proc = subprocess.run([sys.executable, "-m", "experiments.rescore", f"--workdir={run}"],
                        capture_output=True, text=True, cwd=REPO, timeout=600,
                        env=dict(env, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "byte for byte" in proc.stdout + proc.stderr


def test_a_second_run_resumes_and_changes_nothing(finished):
  root, path, _ = finished
  out = root / "out"
  # Every file, none filtered out: the lock file (RUN/.lock) is removed as it is released.
  before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
  proc = _run(out, path)
  assert proc.returncode == 0, proc.stderr[-3000:]
  after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
  assert after == before
  assert not any(p.name == rundir.LOCK for p in after)


def test_bad_inputs_are_one_line(finished, tmp_path):
  root, _, _ = finished
  cases = [(tmp_path / "absent.gguf", [], ["absent.gguf", "does not exist"]),
           (root / "tiny.gguf", ["--config.data.documents=100000"],
            ["documents (test split)", "100000 asked for"])]
  for path, extra, facts in cases:
    proc = _run(tmp_path / "out", path, *extra)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line, = proc.stderr.strip().splitlines()
    for fact in facts:
      assert fact in line, (fact, line)
  assert not (tmp_path / "out").exists()
