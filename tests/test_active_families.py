"""The active tier on the RoPE families (lla.active on a DecoderConfig).

Split training of a tiny random checkpoint of each family (the configs of
tests/test_attacks_families.py: llama with an untied head and GQA, qwen3's q/k-norm,
mistral's window shorter than the documents, qwen2's biases, gemma3's scaled embeddings, sandwich norms and two RoPEs)
with an honest server and a hijacking (FSHA) one, then `fsha_decode` replayed on the
hijacked capture. GPT-2's rows are tests/test_active_run.py. Checked against quantities
computed apart from the split code:

* the honest capture at step 0 (no server has changed the client yet): h is the base
  model's residual stream after k blocks (`split.hidden_states`, the whole model's forward),
  and the client's held-out task loss with the public tail is the whole model's loss;
* the hijacked client trained on the family (its h moved), its SplitGuard probe is the first
  block's q, k and v kernels;
* `fsha_decode`'s predictions are the stored decoder's argmax recomputed in float64 numpy.
"""

import jax
import numpy as np
import pytest

from lla.active import attack as fsha_attack
from lla.active import client, run
from lla.capture import store
from lla.evidence import rundir
from lla.model import decoder, hf_io, split
from lla.replay import driver as replay

from test_active_run import _setup
from test_attacks_families import CONFIGS

STEPS, SEED, CUT = 4, 10, 1
FAMILIES = [f for f in CONFIGS if f != "gpt2"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.slow
def test_split_training_and_fsha_decode(tmp_path, family):
  cfg = CONFIGS[family]
  setup = _setup(tmp_path, cfg, decoder.random_params(cfg, seed=3, std=0.05), STEPS)
  honest = run.simulate(setup, "honest", 0.0, SEED, tmp_path, (0, STEPS))
  hijacked = run.simulate(setup, "fsha", 0.0, SEED, tmp_path, (STEPS,))
  tokens = setup.eval_tokens

  # Step 0: the base model's h, and the whole model's held-out loss with the public tail.
  at_start = store.load_capture(tmp_path / "captures" / honest["name"] / "step_0")
  base_h = np.asarray(split.hidden_states(setup.base, cfg, tokens)[CUT])
  # Within 1e-5 of h's largest magnitude: Gemma-3's sandwich norms make h O(1), not O(std).
  np.testing.assert_allclose(at_start.activations, base_h, rtol=1e-5,
                             atol=1e-5 * np.abs(base_h).max())
  whole = float(split.lm_loss(setup.base, cfg, tokens))
  np.testing.assert_allclose(honest["public_tail_loss"]["0"], whole, rtol=1e-5)
  assert all(np.isfinite(s["g_row_norm"]) for s in honest["steps"] + hijacked["steps"])

  # The hijack trained the family's client: its messages moved away from the base model's.
  capture_dir = tmp_path / "captures" / hijacked["name"] / f"step_{STEPS}"
  hijacked_h = store.load_capture(capture_dir).activations
  assert np.abs(hijacked_h - base_h).max() > 1e-3
  # SplitGuard read the first block's q, k and v kernel gradients: d x (H + 2 H_kv) D.
  grads = jax.tree.map(np.zeros_like, client.init(setup.cspec, setup.base)["params"])
  assert client.probe_vector(grads).shape == (
      cfg.n_embd * (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim,)

  # fsha_decode through the replay driver on this family's attacker.
  study = tmp_path / "study"
  rundir.create_study(str(study), {"test": True})
  records = replay.replay(str(study), str(capture_dir), run._attacker(setup, "none"),  # pylint: disable=protected-access
                          ["fsha_decode"], {}, 0, run_prefix="x/")
  assert records[0].status == "ok", records[0].error
  predictions = rundir.load_predictions(rundir.resolve(str(study), records[0].prediction_file))
  stored, _ = fsha_attack.load_decoder(str(capture_dir))
  d = {k: np.asarray(v, np.float64) for k, v in stored.items()}
  scores = d["tau"] * (((hijacked_h - d["off"]) / d["scale"]) @ d["emb"].T) + d["bias"]
  np.testing.assert_array_equal(predictions, scores.argmax(-1))


def test_the_binary_refuses_a_vocabulary_the_documents_overflow(tmp_path, data_dir):
  """A Llama directory without a tokenizer is not cut with GPT-2's (one line); given GPT-2's
  tokenizer.json, WikiText-2's GPT-2 token ids on its 64-token vocabulary would be clamped by
  the embedding lookup: the binary refuses the pairing with one line, and trains nothing."""
  from test_cli_errors import _one_line, _run
  from lla.data import tokenizer as tokenizer_lib
  hf_io.save_hf_dir(decoder.random_params(CONFIGS["llama"], seed=2), CONFIGS["llama"],
                    tmp_path / "llama")
  run = lambda: _run("active_server", "--config=configs/active.py:tiny",
                     f"--config.model.hf_dir={tmp_path / 'llama'}",
                     f"--config.data.data_dir={data_dir}", f"--workdir={tmp_path / 'run'}")
  assert "without its tokenizer" in _one_line(run(), "tokenizer")
  tokenizer_lib.load_tokenizer(data_dir).backend.save(str(tmp_path / "llama" / "tokenizer.json"))
  proc = run()
  line = _one_line(proc, "vocabulary")
  prefix = "active_server: the documents hold token id "
  assert line.startswith(prefix), line
  largest = int(line[len(prefix):].split(",")[0])
  assert largest >= 64 and line.endswith(
      "beyond the model's vocabulary of 64: use a model with the data's tokenizer"), line
  assert not (tmp_path / "run" / "runs").exists()
