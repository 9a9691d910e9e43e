"""The main job on a model that brings its own weights and tokenizer: a GGUF file.

The tiny random Llama of test_real_weights (a byte-level vocabulary of 256 ids, written as a
float32 GGUF file whose tokenizer prepends a BOS, id 1) is the base of
`configs/main_table.py:tiny` through `--config.model.gguf`, with the phases that do not
depend on where the base comes from turned off, and the FLOP-matched frontier and the active
tier on. Checked against what the file and the text say, not against lla: no pre-training
ran; every evaluation and calibration passage is the BOS and then a run of WikiText-2 bytes
(the model's own tokens, where GPT-2's ids would not even fit its vocabulary); the public
target's captured h is transformers' hidden state of the model written to the file; every
attack is scored after the BOS; the trained-knowledge attacker reloads the GGUF, and every
prediction regenerates bit for bit from the study. One job serves every test: the same file
without a BOS is the base of test_real_weights.
"""
import json
import pathlib
import shutil

import numpy as np
import pytest
import tokenizers
import torch
from safetensors.numpy import load_file

from configs import main_table as main_table_config
from lla.evidence import rundir
from lla.replay import regenerate
from lla.scoring import scorecard
from lla.study import bridge
from lla.study import main_table
from lla.sweep import frontier as flops_frontier
from test_real_weights import ALPHABET, gguf_file, text_bytes, tiny_llama

# Off: phases whose inputs are the same whatever the base (tests/test_e2e_main_table.py runs
# them); the corpus study also needs an end-of-text token the byte vocabulary lacks.
FAST = {"published.attacks": (), "defenses": (), "corpus_study.corpora": (),
        "frontier.enabled": False, "active.enabled": False,
        # The decoy split keeps its own random model; one short seed, no dose response.
        # Its records share the study with the file's, scored with the file's tokenizer.
        "decoy.protocol.steps": 64, "decoy.train.chunk": 64, "decoy.probe.steps": 20,
        "decoy.calibration.seeds": 0,
        # The active tier's probe of the decoy split trains a model of its own and writes
        # no record; the rest of the tier runs on the file's model.
        "active.decoy_probe.enabled": False}


def _config(path: pathlib.Path):
  config = main_table_config.get_config("tiny")
  config.model.gguf = str(path)
  for field, value in FAST.items():
    *parents, leaf = field.split(".")
    node = config
    for parent in parents:
      node = node[parent]
    node[leaf] = value
  return config


@pytest.fixture(scope="module")
def job(tmp_path_factory, data_dir, monkeypatch_module):
  monkeypatch_module.setenv("LLA_DATA_DIR", str(data_dir))
  monkeypatch_module.setenv("LLA_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
  root = tmp_path_factory.mktemp("gguf_job")
  path = gguf_file(root / "bos.gguf", add_bos=True)
  config = _config(path)
  # The active tier and the frontier on the file's model, their documents cut by its
  # tokenizer.
  config.active.enabled = config.frontier.enabled = True
  report = main_table.run(config, str(root / "work"))
  return config, path, root / "work", report


@pytest.fixture(scope="module")
def monkeypatch_module():
  with pytest.MonkeyPatch.context() as mp:
    yield mp


@pytest.mark.slow
def test_no_pretraining_and_the_report_names_the_file(job):
  config, path, work, report = job
  assert not (work / "pretrain").exists()
  text = report.read_text()
  assert f"GGUF file {path}" in text
  assert "this job attacks tiny, published weights read from a GGUF file" in text
  study = str(work / main_table.STUDY)
  assert rundir.verify(study) == []
  manifests = sorted((work / "finetune").glob("k*/models.json"))
  assert [m.parent.name for m in manifests] == ["k2_public", "k2_trained"]
  for manifest in manifests:
    for entry in json.loads(manifest.read_text()):
      assert json.loads((pathlib.Path(entry["path"]) / "metadata.json").read_text())[
          "base"]["source"] == f"gguf:{path}"


@pytest.mark.slow
def test_passages_are_the_models_own_tokens(job, data_dir):
  """Each evaluation document and calibration passage is the BOS, then a run of bytes of
  the WikiText-2 text of its split; the study pins the byte-level tokenizer."""
  _, _, work, _ = job
  text = {split: (data_dir / "wikitext-2" / f"{split}.txt").read_bytes()
          for split in ("test", "train")}
  truth = load_file(str(work / main_table.CAPTURES / "k2_public_m0" / "truth.safetensors"))
  documents = truth["tokens"]
  assert documents.shape == (48, 32) and documents.max() < 256 and (documents[:, 0] == 1).all()
  for row in documents:
    assert text_bytes(row[1:]) in text["test"]
  calibration, = (work / main_table.STUDY / "inputs").glob("calibration_*.npy")
  passages = np.load(calibration)
  assert passages.shape == (16, 32) and (passages[:, 0] == 1).all()
  for row in passages:
    assert text_bytes(row[1:]) in text["train"]
  pinned = tokenizers.Tokenizer.from_file(str(work / main_table.STUDY / "inputs" /
                                              "tokenizer.json"))
  assert pinned.get_vocab() == {symbol: i for i, symbol in enumerate(ALPHABET)}


@pytest.mark.slow
def test_public_capture_is_the_files_model(job):
  """Public knowledge freezes the client layers, so the target's h at k = 2 is the hidden
  state after 2 blocks of the model written to the file (transformers, float32); the
  trained target's client moved away from it."""
  _, _, work, _ = job
  captures = work / main_table.CAPTURES
  tokens = load_file(str(captures / "k2_public_m0" / "truth.safetensors"))["tokens"]
  with torch.no_grad():
    out = tiny_llama()(torch.as_tensor(tokens.astype(np.int64)), output_hidden_states=True)
  expected = out.hidden_states[2].numpy()
  scale = np.abs(expected).max()
  for seed in range(3):
    h = load_file(str(captures / f"k2_public_m{seed}" / "messages.safetensors"))["activations"]
    assert np.abs(h - expected).max() / scale < 1e-5
  trained = load_file(str(captures / "k2_trained_m0" / "messages.safetensors"))["activations"]
  assert np.abs(trained - expected).max() / scale > 1e-3


@pytest.mark.slow
def test_trained_knowledge_attacker_reloads_the_file(job):
  """The trained-knowledge attacker holds the base, located as the GGUF file; regenerating
  every prediction (the attacker reloaded from the pinned locations) reproduces each."""
  _, path, work, _ = job
  study = str(work / main_table.STUDY)
  records = rundir.load_records(study)
  trained = [r for r in records if r.run_id.startswith("k2_trained")]
  assert len(trained) == 12  # 4 secondary attacks x 3 models
  for record in trained:
    pinned = json.loads((work / main_table.STUDY / "inputs" / f"{record.e_hash}.json")
                        .read_text())
    assert pinned["attacker_source"] == {"gguf": str(path)}
  result = regenerate.check(study)
  assert result.problems == []
  # The decoy split's records come from its own driver and model, not this base.
  assert sorted(result.regenerated) == sorted(
      r.run_id for r in records if r.status == "ok" and not r.attack.startswith("decoy_"))
  assert len(result.regenerated) == 36  # (8 primary + 4 secondary attacks) x 3 models


def _check_bos_captures(captures, data_dir) -> None:
  """Every capture under `captures` records the BOS (id 1) as E's known prefix and holds the
  file's model's documents: the BOS, then a run of bytes of the test text."""
  text = (data_dir / "wikitext-2" / "test.txt").read_bytes()
  metadata = sorted(captures.rglob("metadata.json"))
  assert metadata
  for path in metadata:
    assert json.loads(path.read_text())["protocol"]["C"]["known_prefix"] == [1]
    tokens = load_file(str(path.parent / "truth.safetensors"))["tokens"]
    assert (tokens[:, 0] == 1).all() and tokens.max() < 256
    for row in tokens:
      assert text_bytes(row[1:]) in text


@pytest.mark.slow
def test_the_frontier_cuts_its_documents_with_the_models_tokenizer(job, data_dir):
  """The FLOP-matched frontier's cells capture the file's model's documents (the BOS, then
  bytes of the test text: GPT-2's ids would overflow its 256-token vocabulary), record the
  BOS in E, and every point is scored after it: its recovery is the stored predictions'
  hits on positions 1..31."""
  frontier = job[2] / main_table.FRONTIER
  _check_bos_captures(frontier / "captures", data_dir)
  study = frontier / "study"
  assert rundir.verify(str(study)) == []
  points = flops_frontier.points(str(study))
  assert {p.attack for p in points} == {"ridge", "activation", "gradient_only"}
  records = {r.run_id: r for r in rundir.load_records(str(study))}
  assert {r.scored_positions for r in records.values()} == {"after_bos"}
  for cell in sorted((study / "cells").iterdir()):
    entry = json.loads(cell.read_text())
    for attack in entry["attacks"]:
      record = records[attack["run_id"]]
      truth = np.asarray(rundir.load_truth(rundir.resolve(str(study), record.truth_file)))
      pred = np.load(study / attack["predictions"])
      point, = [p for p in points if p.cell_id == entry["cell_id"]
                and p.attack == attack["attack"]]
      assert point.recovery == pytest.approx((pred[:, 1:] == truth[:, 1:]).mean())


@pytest.mark.slow
def test_the_bridge_reads_the_sealed_study_and_refuses_a_tampered_copy(job, tmp_path):
  _, _, work, report = job
  column = bridge.read(work)
  assert (column.model, column.variant, column.n_eval, column.num_models) == ("tiny", "tiny",
                                                                              48, 3)
  assert f"Seal: `{column.seal}`" in report.read_text()
  activation = bridge.recoveries(column)[(2, "public", "activation")]
  card = json.loads((work / main_table.STUDY / "scorecard.json").read_text())
  assert activation == card["undefended"][0]["pooled"]["activation"]
  copy = tmp_path / "copy"
  shutil.copytree(work / main_table.STUDY, copy / main_table.STUDY)
  scorecard = copy / main_table.STUDY / "scorecard.json"
  tampered = json.loads(scorecard.read_text())
  tampered["undefended"][0]["pooled"]["activation"]["token_recovery"] /= 2
  scorecard.write_text(json.dumps(tampered))
  with pytest.raises(bridge.BridgeError, match="fails verification"):
    bridge.read(copy)


@pytest.mark.slow
def test_with_a_bos_no_attack_is_scored_there(job):
  """Every record is scored after the BOS; the paired difference the primary test
  bootstraps is, per model and document, the joint minus activation hits over positions
  1..31 of the stored predictions, in pp of 31 positions. (Every prediction, the attacker
  reloading the known prefix too, regenerates: test_trained_knowledge_attacker_...)"""
  work = job[2]
  study = work / main_table.STUDY
  assert rundir.verify(str(study)) == []
  documents = load_file(str(work / main_table.CAPTURES / "k2_public_m0" /
                            "truth.safetensors"))["tokens"]
  records = [r for r in rundir.load_records(str(study)) if not r.attack.startswith("decoy_")]
  assert records and {r.scored_positions for r in records} == {"after_bos"}
  hits = {}
  for r in records:
    if (r.cut, r.knowledge, r.defense) == (2, "public", "none"):
      pred = np.load(rundir.resolve(str(study), r.prediction_file))
      hits[r.attack, r.model_seed] = (pred[:, 1:] == documents[:, 1:]).sum(1)
  seeds = sorted({m for _, m in hits})
  assert len(seeds) == 3
  expected = np.stack([hits["joint", m] - hits["activation", m] for m in seeds])
  scored, per_doc, _ = scorecard.score_records(str(study), rundir.load_records(str(study)))
  d, scale = scorecard.difference_matrix(scored, per_doc, "joint", "activation", 2, "public",
                                         "wikitext2")
  np.testing.assert_array_equal(d, expected)
  assert scale == pytest.approx(100 / 31)
  card = json.loads((study / "scorecard.json").read_text())
  assert card["undefended"][0]["pooled"]["activation"]["n"] == 3 * 48 * 31


def test_paper_runs_the_decoy_split_on_its_own_base_directory():
  """`paper`'s decoy split reads the job's base directory at the job's cut: an override of
  --config.model.hf_dir (set after the config is built, as the flag does) reaches it."""
  config = main_table_config.get_config("paper")
  assert config.decoy.model.hf_dir == ""  # the hub's GPT-2: the decoy's own random one
  config.model.hf_dir = "/models/gpt2"
  assert (config.decoy.model.hf_dir, config.decoy.model.cut) == ("/models/gpt2", 6)
  assert json.loads(config.to_json())["decoy"]["model"]["hf_dir"] == "/models/gpt2"
  for variant in ("cpu", "paper_qwen3"):
    other = main_table_config.get_config(variant)
    other.model.hf_dir = "/models/x"
    assert other.decoy.model.hf_dir == ""


@pytest.mark.slow
def test_the_active_tier_runs_on_the_files_model_and_its_bos(job, data_dir):
  """Every active-tier capture holds the file's model's documents (the BOS, then bytes of
  the test text), records the BOS as E's known prefix, and its records are scored after
  it, as its scorecard's rows say."""
  active = job[2] / main_table.ACTIVE
  _check_bos_captures(active / "captures", data_dir)
  records = rundir.load_records(str(active / "study"))
  assert records and {r.scored_positions for r in records} == {"after_bos"}
  card = json.loads((active / "study" / "scorecard.json").read_text())
  assert {row["scored_positions"] for row in card["rows"]} == {"after_bos"}
