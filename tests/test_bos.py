"""The BOS policy: a tokenizer that prepends BOS makes position 0 public.

Checked against what the text, the file and the arithmetic say: passages are the BOS and
then the stream's own windows; E records the prefix (and an E without one keeps its hash);
a capture refuses documents that do not start with it; the beam search starts after it
whatever its candidates say there; and a whole run on a tiny random Llama whose GGUF asks
for a BOS scores every attack on positions >= 1 only, with the frequency baseline of those
positions, SipIt exact from the BOS's cache, and the Haar-projection attack exact too.
"""

import hashlib
import json

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from configs import real_weights as real_weights_config
from lla import defenses
from lla.attacks import registry
from lla.attacks.published import bisr_f, eia
from lla.attacks.seed import beam
from lla.attacks.workspace import Workspace
from lla.capture import capture
from lla.data import load, tokenizer as tokenizer_lib
from lla.evidence import rundir
from lla.model import split
from lla.model.gpt2 import GPT2Config
from lla.model.loading import load_model
from lla.protocol import tuple as protocol
from lla.study import real_weights

from test_attacks_units import random_params
from test_real_weights import SEED, _ids, _paragraphs, gguf_file

BOS = 1  # tokenizer.ggml.bos_token_id of tests/test_model_gguf.write_gguf
T, DOCS, CAL = 16, 4, 16


def test_passages_are_the_bos_then_the_streams_windows(data_dir, tmp_path):
  gpt2 = tokenizer_lib.load_tokenizer(data_dir)
  with_bos = tokenizer_lib.wrap(gpt2.backend, gpt2.source, bos_id=50256)
  kwargs = dict(data_dir=data_dir, corpus="clinical", seq_len=8, n_calibration=4, n_train=4,
                n_eval=6, seed=3, cache_dir=tmp_path)
  splits = load.load_splits(**kwargs, tokenizer=with_bos)
  plain = load.load_splits(**kwargs)
  stream = load.make_corpus("clinical", data_dir, tmp_path, gpt2).tokens("test")
  assert splits.known_prefix == (50256,) and splits.text_len == 7 and plain.known_prefix == ()
  for row, doc in zip(splits.evaluation.tokens, splits.evaluation.document_ids):
    assert row[0] == 50256
    np.testing.assert_array_equal(row[1:], stream[doc * 7:(doc + 1) * 7])
  assert splits.to_json()["known_prefix"] == [50256] and "known_prefix" not in plain.to_json()
  with pytest.raises(ValueError, match="no text after"):
    load.load_splits(**{**kwargs, "seq_len": 1}, tokenizer=with_bos)


def test_e_records_the_prefix_and_an_e_without_one_keeps_its_hash():
  target = protocol.Target(model_id="m", cut=2)
  plain = protocol.make(T=target)
  with_bos = protocol.make(T=target, C=protocol.Corpora(known_prefix=(BOS,)))
  # E's JSON as written before the field existed: C held name, seq_len and split_hashes.
  before = plain.to_dict()
  assert set(before["C"]) == {"name", "seq_len", "split_hashes"}
  text = json.dumps(before, sort_keys=True, separators=(",", ":")) + "\n"
  assert hashlib.sha256(text.encode()).hexdigest() == plain.sha256()
  assert protocol.ProtocolTuple.from_dict(before) == plain
  assert with_bos.to_dict()["C"]["known_prefix"] == [BOS]
  assert protocol.ProtocolTuple.from_dict(with_bos.to_dict()) == with_bos
  assert with_bos.sha256() != plain.sha256()


def test_a_capture_refuses_documents_that_do_not_start_with_the_prefix():
  tokens = np.array([[BOS, 5, 6], [BOS, 7, 8], [4, 9, 10]], np.int32)
  with pytest.raises(capture.CaptureInputError, match="document 2 does not start"):
    capture.check_known_prefix(tokens, (BOS,))
  with pytest.raises(capture.CaptureInputError, match="one public token"):
    capture.check_known_prefix(tokens, (BOS, 5))
  with pytest.raises(capture.CaptureInputError, match="nothing after"):
    capture.check_known_prefix(tokens[:, :1], (BOS,))
  assert capture.check_known_prefix(tokens[:2], (BOS,)) == (BOS,)


def test_the_beam_search_starts_after_the_prefix_whatever_its_candidates_there():
  cfg = GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_head=2, n_layer=3)
  params = random_params(cfg, seed=2, std=0.05)
  rng = np.random.default_rng(2)
  truth = rng.integers(0, 64, (3, 8)).astype(np.int32)
  truth[:, 0] = BOS
  h = np.asarray(split.client(params, cfg, jnp.asarray(truth), 2))
  # The true token at a random rank among 6 at every position, except position 0, whose
  # candidates do not hold the BOS at all.
  candidates = np.stack([np.stack([rng.permutation(row) for row in doc]) for doc in
                         np.concatenate([truth[:, :, None], rng.integers(2, 64, (3, 8, 5))],
                                        -1)]).astype(np.int32)
  candidates[:, 0] = 7
  tokens, score = beam.search(params, cfg, 2, h, candidates, 3, prefix=(BOS,))
  np.testing.assert_array_equal(np.asarray(tokens), truth)
  assert np.asarray(score).max() < 1e-6 * float(np.sum(h**2))
  blind, _ = beam.search(params, cfg, 2, h, candidates, 3)
  assert (np.asarray(blind)[:, 0] == 7).all()  # without the prefix it could not find BOS
  # W C steps at each open position, W at the known one.
  assert beam.analytic_flops(cfg, 2, 3, 3, 6, 8, prefix=1) == pytest.approx(
      beam.analytic_flops(cfg, 2, 3, 3, 6, 8) * (7 * 6 + 1) / (8 * 6))


@pytest.fixture(scope="module")
def bos_run(tmp_path_factory, data_dir):
  root = tmp_path_factory.mktemp("bos")
  path = gguf_file(root / "bos.gguf", add_bos=True)
  config = real_weights_config.get_config("tiny")
  config.model.gguf = str(path)
  config.data.data_dir = str(data_dir)
  config.data.seq_len = T
  config.cut = 2
  config.attacks = ("activation", "ridge", "sipit", "gradient_only_t1")
  card = real_weights.run(config, str(root / "out"))
  return root, path, card


def _drawn(texts, n, seed):
  """real_weights' draw of paragraphs with T - 1 tokens of text, each after the BOS."""
  eligible = [i for i, t in enumerate(texts) if len(_ids(t)) >= T - 1]
  chosen = np.sort(np.random.default_rng(seed).choice(eligible, n, replace=False))
  return np.asarray([[BOS] + _ids(texts[i])[:T - 1] for i in chosen], np.int32)


@pytest.mark.slow
def test_every_attack_is_scored_after_the_bos(bos_run, data_dir):
  root, _, card = bos_run
  docs = _drawn(_paragraphs(data_dir, "test"), DOCS, SEED)
  calibration = _drawn(_paragraphs(data_dir, "train"), CAL, SEED + 1)
  run = root / "out" / "run"
  assert rundir.verify(str(run)) == []
  meta = json.loads((root / "out" / "capture" / "metadata.json").read_text())
  assert meta["protocol"]["C"]["known_prefix"] == [BOS]
  baseline = int(np.argmax(np.bincount(calibration[:, 1:].ravel(), minlength=256)))
  (undefended,) = card["undefended"]
  records = {r.attack: r for r in rundir.load_records(str(run))}
  assert sorted(records) == ["activation", "gradient_only_t1", "ridge", "sipit"]
  for name, record in records.items():
    truth = np.asarray(rundir.load_truth(rundir.resolve(str(run), record.truth_file)))
    np.testing.assert_array_equal(truth, docs)
    assert record.scored_positions == "after_bos" and record.baseline_token == baseline
    pred = np.load(rundir.resolve(str(run), record.prediction_file))
    row = undefended["pooled"][name]  # one key per attack: no "[t>=1]" mark after a BOS
    assert row["n"] == DOCS * (T - 1)
    assert row["token_recovery"] == pytest.approx((pred[:, 1:] == docs[:, 1:]).mean())
    assert row["exact_doc_recovery"] == pytest.approx(
        (pred[:, 1:] == docs[:, 1:]).all(axis=1).mean())
    assert row["baseline_p0"] == pytest.approx((docs[:, 1:] == baseline).mean())
  # With the file's own weights: SipIt exact, started from the BOS's cache in every document.
  sipit = records["sipit"]
  np.testing.assert_array_equal(np.load(rundir.resolve(str(run), sipit.prediction_file)), docs)
  assert sipit.details["resolved_by_stage"]["known_prefix"] == DOCS
  assert sipit.details["resolved_by_stage"]["shared_position0"] == 0
  assert np.load(rundir.resolve(str(run), records["activation"].prediction_file))[:, 0].tolist() \
      == [BOS] * DOCS


@pytest.fixture(scope="module")
def bos_case(bos_run, data_dir):
  """The GGUF's model, 8 documents after the BOS, calibration passages and h at k = 2."""
  model = load_model(ml_collections.ConfigDict({"gguf": str(bos_run[1])}))
  truth = _drawn(_paragraphs(data_dir, "test"), 8, SEED + 5)
  calibration = _drawn(_paragraphs(data_dir, "train"), CAL, SEED + 1)
  h = np.asarray(split.client(model.params, model.cfg, jnp.asarray(truth), 2))
  return model, truth, calibration, h


@pytest.mark.slow
def test_the_haar_projection_attack_after_a_bos(bos_case):
  model, truth, calibration, h = bos_case
  keys = defenses.Secret.explicit(0).keys("projection")
  y = np.asarray(defenses.apply(defenses.make("projection", kind="haar"), jnp.asarray(h), keys))
  ws = Workspace(y, None, model.params, model.cfg, 2, calibration, known_prefix=(BOS,),
                 defense={"name": "projection", "params": {"kind": "haar", "enabled": True}})
  result, _ = registry.execute("projection_adaptive", ws, registry.budget_config(),
                               jax.random.key(0))
  np.testing.assert_array_equal(result.predictions, truth)
  assert result.details["exact"], result.details


@pytest.mark.slow
def test_mixup_adaptive_unmixes_from_the_first_position_after_the_bos(bos_case):
  model, truth, calibration, h = bos_case
  mixed, lam, partners = defenses.make("mixup", m=2).mix(jnp.asarray(h), jax.random.key(11))
  lam, partners = np.asarray(lam), np.asarray(partners)
  # Every document's row 0 is the BOS's: the mixture there says nothing about the partners.
  np.testing.assert_allclose(np.asarray(mixed)[:, 0], np.broadcast_to(h[0, 0], h[:, 0].shape),
                             rtol=1e-5, atol=1e-5 * np.abs(h[0, 0]).max())
  ws = Workspace(np.asarray(mixed), None, model.params, model.cfg, 2, calibration,
                 known_prefix=(BOS,), defense={"name": "mixup", "params": {"m": 2, "alpha": 1.0}})
  # Every token a candidate of the unmixed rows' beam: its output is then the heaviest
  # partner's text exactly when the unmixing is right.
  budget = registry.budget_config()
  budget.mixup_candidates = model.cfg.vocab_size
  result, _ = registry.execute("mixup_adaptive", ws, budget, jax.random.key(0))
  heaviest = truth[partners[np.arange(len(truth)), lam.argmax(1)]]
  np.testing.assert_array_equal(result.predictions, heaviest)
  # Documents 2 and 5 (rows of other partners) share tokens 1-3: every split of their
  # slots unmixes the same rows at position 2, and float rounding chose among the tied
  # splits until decoding decided them (document 0's token 6 was then wrong on two hosts).
  np.testing.assert_array_equal(truth[2, :4], truth[5, :4])
  assert result.details["ambiguous_first_tokens"] == 1
  assert result.details["splits_decided_by_decoding"] == 1
  assert result.details["first_position"] == 1 and result.details["rows_unmixed"] == 8
  assert result.details["first_row_residual_median"] < 1e-5


@pytest.mark.slow
def test_the_quantisation_likelihood_beam_and_tag_after_a_bos(bos_case):
  """The likelihood beam runs the BOS as its first step and inverts 4-bit quantisation
  exactly with every token a candidate; TAG (gradient matching, 3 steps here) takes the BOS
  as its position 0 instead of searching for it, and says so."""
  model, truth, calibration, h = bos_case
  defense = defenses.make("quantize", bits=4)
  y = np.asarray(defenses.apply(defense, jnp.asarray(h), None))
  ws = Workspace(y, None, model.params, model.cfg, 2, calibration, known_prefix=(BOS,),
                 defense={"name": "quantize", "params": {"bits": 4}})
  budget = registry.budget_config()
  budget.likelihood_candidates = model.cfg.vocab_size
  result, _ = registry.execute("quantize_adaptive", ws, budget, jax.random.key(0))
  np.testing.assert_array_equal(result.predictions, truth)
  _, g = split.boundary_messages(model.params, model.cfg, jnp.asarray(truth), 2)
  ws = Workspace(h, np.asarray(g), model.params, model.cfg, 2, calibration, known_prefix=(BOS,))
  budget = registry.budget_config()
  budget.tag_steps = 3
  result, _ = registry.execute("tag", ws, budget, jax.random.key(0))
  assert (result.predictions[:, 0] == BOS).all()
  assert result.details["position0"] == "the public BOS"



@pytest.mark.slow
def test_the_gaussian_projection_estimate_pairs_the_bos_row_once(bos_case):
  """The estimate route takes the BOS's row as every document's first row without a search:
  one (h, y) pair, the BOS's client row against the message every document shares there.
  (At d = 64 a Gaussian R distorts inner products by about 1/8, so the route recovers
  little here either way; docs/benchmarks.md section 12.)"""
  model, truth, calibration, h = bos_case
  projection = defenses.make("projection", kind="gaussian")
  keys = defenses.Secret.explicit(0).keys("projection")
  y = np.asarray(defenses.apply(projection, jnp.asarray(h), keys))
  defense = {"name": "projection", "params": {"kind": "gaussian", "enabled": True}}
  blind = Workspace(y, None, model.params, model.cfg, 2, calibration, defense=defense)
  ws = Workspace(y, None, model.params, model.cfg, 2, calibration, known_prefix=(BOS,),
                 defense=defense)
  budget = registry.budget_config()
  budget.projection_refits = 0
  result, _ = registry.execute("projection_adaptive", ws, budget, jax.random.key(0))
  unknown, _ = registry.execute("projection_adaptive", blind, budget, jax.random.key(0))
  assert result.details["route"] == "estimate"
  assert result.details["position0_pairs"] == 1
  assert unknown.details["position0_pairs"] == len(truth)  # each document matched its own
  assert (result.predictions[:, 0] == BOS).all()


@pytest.mark.slow
def test_forward_matching_holds_the_bos_at_its_embedding(bos_case):
  """EIA and BiSR(f) hold position 0 at the BOS's input embedding. From the true text with
  a wrong position 0 (token 7), the client reproduces h exactly when the BOS is known; the
  blind workspace's wrong first token moves every later row (the attention sink)."""
  model, truth, calibration, h = bos_case
  wrong = truth.copy()
  wrong[:, 0] = 7
  known = Workspace(h, None, model.params, model.cfg, 2, calibration, known_prefix=(BOS,))
  blind = Workspace(h, None, model.params, model.cfg, 2, calibration)
  budget = registry.budget_config()
  budget.bisr_f_steps, budget.bisr_f_decode, budget.bisr_f_loss = 0, "nearest", "mse"
  index = np.arange(len(truth))
  tokens, _, final = bisr_f.refine_chunk(known, budget, h, wrong, index)
  _, _, final_blind = bisr_f.refine_chunk(blind, budget, h, wrong, index)
  np.testing.assert_array_equal(tokens, truth)
  scale = np.mean(h.astype(np.float64) ** 2, axis=(1, 2))
  assert (final < 1e-9 * scale).all() and (final_blind > 1e-4 * scale).all()
  # EIA's relaxed tokens at a near one-hot Z of the same text: summed squared error.
  z = 50.0 * jax.nn.one_hot(wrong, model.cfg.vocab_size)
  held = np.asarray(eia._losses(model.params, model.cfg, 2, z, jnp.asarray(h), 0.3, (BOS,)))
  moved = np.asarray(eia._losses(model.params, model.cfg, 2, z, jnp.asarray(h), 0.3, ()))
  total = np.sum(h.astype(np.float64) ** 2, axis=(1, 2))
  assert (held < 1e-9 * total).all() and (moved > 1e-4 * total).all()


@pytest.mark.slow
def test_learned_and_chained_attacks_return_the_bos(bos_case):
  """SIP, EIA, BiSR(f), BiSR(b) and BiSR(b+f), a few steps each: position 0 is the BOS
  whatever their inverters or variables say there, and BiSR(b) says where it came from."""
  model, truth, calibration, h = bos_case
  _, g = split.boundary_messages(model.params, model.cfg, jnp.asarray(truth), 2)
  ws = Workspace(h, np.asarray(g), model.params, model.cfg, 2, calibration, known_prefix=(BOS,))
  budget = registry.budget_config()
  for field, value in dict(sip_epochs=2, sip_hidden=16, bisr_f_steps=2, eia_steps=2,
                           eia_mapper_epochs=1, bisr_b_steps=2).items():
    budget[field] = value
  for name in ("sip", "eia", "bisr_f", "bisr_b", "bisr"):
    result, _ = registry.execute(name, ws, budget, jax.random.key(0))
    assert (result.predictions[:, 0] == BOS).all(), name
  assert result.details["bisr_b"]["position0"] == "the public BOS"
