"""The paper main jobs (configs/main_table.py `paper`, `paper_qwen3`, `paper_llama32`) end to
end on CPU, each on a tiny random checkpoint of its family, so that an accelerator run meets
no code path the suite has not run.

Each base is a `save_pretrained` directory made here with transformers (8 layers, so that the
paper's cuts k = 3 and k = 6 leave server blocks): a GPT-2 without tokenizer files (its
tokenizer is the data directory's GPT-2), a Qwen3 and a Llama-3.2 (llama3 RoPE scaling) with
byte-level BPE tokenizers of their own (Qwen2's and Llama-3's pre-tokenizer regexes), Llama's
post-processor placing `<|begin_of_text|>`. Kept as the paper runs them: the variant's
settings ((3, 6) x (public, trained)), the base read from the directory with its tokenizer
and BOS, its fine-tuning learning rate, the decoy split on the job's own directory at k = 6
(`paper`), scoring and the report. Shrunk: documents (8 of T = 16), one fine-tuned model,
one attack seed, the attacks (ridge and the beam search at k = 6 public, ridge elsewhere) and
their budgets, the decoy split's steps. Off: the phases whose code does not depend on the
base or the variant (the published attacks, defenses, corpus study, frontier and active
tier: tests/test_e2e_main_table.py and tests/test_main_table_gguf.py run them).

The smoke command (marked slow: the three variants took 188 s and 276 s in two runs on 2 shared
CPU cores):

  LLA_DATA_DIR=DATA python -m pytest -q tests/test_paper_configs.py

Each variant also checks that every prediction regenerates from the study with the attacker
reloaded from its pinned source: a fine-tuned copy keeps its base's tokenizer, so the model
id it is reloaded under is the one the job recorded.
"""

import json
import pathlib

import pytest
import tokenizers
import torch
import transformers
from safetensors.numpy import load_file
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from configs import main_table as main_table_config
from lla.evidence import rundir
from lla.replay import regenerate
from lla.study import main_table, qualification

pytestmark = pytest.mark.slow

QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
               r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}"
                r"\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
VOCAB = 1024
SHRINK = {
    "data.seq_len": 16, "data.n_eval": 8, "data.n_calibration": 8, "data.n_train": 8,
    "finetune.num_models": 1, "finetune.num_epochs": 1, "finetune.batch_size": 4,
    "attack_seeds": (0,), "attacks": ("ridge", "activation"), "secondary_attacks": ("ridge",),
    "budget.candidates": 4, "budget.beam_width": 2, "capture_batch_size": 4,
    "published.attacks": (), "published.docs": 8, "defenses": (), "defense_finetune": (),
    "defense_docs": 8,
    "corpus_study.corpora": (), "frontier.enabled": False, "active.enabled": False,
    "decoy.num_seeds": 1, "decoy.protocol.steps": 32, "decoy.train.chunk": 32,
    "decoy.protocol.pool_size": 256, "decoy.eval.blocks": 16, "decoy.probe.steps": 10,
    "decoy.calibration.seeds": 0,
    "memory_budget_mb": 512,
}
_COMMON = dict(hidden_size=64, num_hidden_layers=8, intermediate_size=128,
               max_position_embeddings=128, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, tie_word_embeddings=True)


def _bpe(text: str, regex: str, specials: list[str]) -> tokenizers.Tokenizer:
  tokenizer = tokenizers.Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(tokenizers.Regex(regex), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.train_from_iterator(text.splitlines(keepends=True), trainers.BpeTrainer(
      vocab_size=VOCAB - len(specials), show_progress=False, special_tokens=specials,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  return tokenizer


def make_base(variant: str, directory: pathlib.Path, text: str) -> pathlib.Path:
  """A tiny random checkpoint of `variant`'s family, with its tokenizer, at `directory`."""
  torch.manual_seed(0)
  if variant == "paper":
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=50257, n_positions=64, n_embd=64, n_layer=8, n_head=4))
    model.save_pretrained(directory)
    return directory  # GPT-2's tokenizer: the data directory's
  if variant == "paper_qwen3":
    tokenizer = _bpe(text, QWEN2_REGEX, ["<|endoftext|>"])
    config = transformers.Qwen3Config(vocab_size=VOCAB, rope_theta=1e6, **_COMMON)
    model, tokenizer_config = transformers.Qwen3ForCausalLM(config), {
        "add_bos_token": False, "bos_token": None, "eos_token": "<|endoftext|>"}
  else:
    tokenizer = _bpe(text, LLAMA3_REGEX, ["<|begin_of_text|>", "<|end_of_text|>"])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)])
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, bos_token_id=0, eos_token_id=1, rms_norm_eps=1e-5,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0,
                             low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=64), **_COMMON)
    model, tokenizer_config = transformers.LlamaForCausalLM(config), {
        "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
  model.save_pretrained(directory)
  tokenizer.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
  return directory


def shrunk(variant: str, directory: pathlib.Path):
  config = main_table_config.get_config(variant)
  config.model.hf_dir = str(directory)
  for field, value in SHRINK.items():
    *parents, leaf = field.split(".")
    node = config
    for parent in parents:
      node = node[parent]
    node[leaf] = value
  return config


@pytest.mark.parametrize("variant, bos", [("paper", None), ("paper_qwen3", None),
                                          ("paper_llama32", 0)])
def test_paper_variant_end_to_end(variant, bos, tmp_path, data_dir, monkeypatch):
  monkeypatch.setenv("LLA_DATA_DIR", str(data_dir))
  monkeypatch.setenv("LLA_CACHE_DIR", str(tmp_path / "cache"))
  text = (data_dir / "wikitext-2" / "train.txt").read_text(encoding="utf-8")[:200_000]
  base = make_base(variant, tmp_path / "base", text)
  config = shrunk(variant, base)
  work = tmp_path / "work"
  report = main_table.run(config, str(work))
  assert not (work / "pretrain").exists()  # the directory is the base
  study = str(work / main_table.STUDY)
  assert rundir.verify(study) == []
  names = sorted(p.name for p in (work / main_table.CAPTURES).iterdir())
  assert names == ["k3_public_m0", "k3_trained_m0", "k6_public_m0", "k6_trained_m0"]
  tokens = load_file(str(work / main_table.CAPTURES / "k6_public_m0" / "truth.safetensors"))[
      "tokens"]
  metadata = json.loads((work / main_table.CAPTURES / "k6_public_m0" / "metadata.json")
                        .read_text())
  assert metadata["protocol"]["C"].get("known_prefix", []) == ([] if bos is None else [bos])
  if bos is not None:
    assert (tokens[:, 0] == bos).all() and (tokens[:, 1:] != bos).all()
  vocab = 50257 if variant == "paper" else VOCAB
  assert tokens.max() < vocab
  records = rundir.load_records(study)
  assert {r.run_id.split("/")[0] for r in records if not r.attack.startswith("decoy_")} == \
      set(names)
  assert all(r.scored_positions == ("after_bos" if bos is not None else r.scored_positions)
             for r in records if not r.attack.startswith("decoy_"))
  assert report.exists() and variant in report.read_text()
  # The checks started with the job were those of the modules it planned (not every
  # registered module's), and they held every measured module's.
  outcomes = qualification.recorded_outcomes(study)
  assert outcomes["recorded"].endswith("started before its phases")
  assert outcomes["modules"] == sorted({r.attack for r in records if r.status == "ok"})
  # Every attacker reloads from its pinned source with the id it was pinned under (a
  # fine-tuned copy keeps its base's tokenizer, so its id is the one the job recorded).
  regenerated = regenerate.check(study)
  assert regenerated.problems == [] and regenerated.regenerated
