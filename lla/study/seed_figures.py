"""The seed's published figures (PROTOCOL section 8), printed beside ours in the report.

GPT-2 124M, WikiText-2, k = 6, public client layers, 256 evaluation documents.
"""

from lla.model import loading

TOKEN_RECOVERY = {
    "joint": 0.9738,
    "activation": 0.9420,
    "shuffled_gradients": 0.9391,
    "random_candidates": 0.9389,
    "gradient_only": 0.4998,
}
EXACT_DOCUMENT_RECOVERY = {"joint": 0.3777, "activation": 0.1371}
JOINT_GAIN_PP = (3.17, (2.72, 3.64))  # joint minus activation-only, 95% CI
# Linear inversion alone (k = 6 inference): (token recovery, frequency baseline).
CORPUS_STUDY = {
    "clinical": (1.0, 0.0625),
    "code": (0.6494, 0.2031),
    "wikitext2": (0.6325, 0.0264),
}
TUNED_BISR = 0.9321
SECRET_MIXUP_EXACT_DOC_MAX = 0.0148  # at +26.9-31.8% perplexity

def why_different(model) -> str:
  """Why this job's figures may differ from the seed's: its model (`model`, a
  configs/models.py config) against the seed's GPT-2 124M."""
  if loading.first_source(model) in ("gguf", "gguf_package"):
    what = (f"{model.name}, published weights read from a GGUF file (its own architecture and "
            "tokenizer), fine-tuned here briefly")
  elif model.name == "gpt2_124m":
    return ("The seed attacked GPT-2 124M, as this job does (from "
            f"{model.get('hf_dir') or model.get('hub')}); figures may still differ through "
            "the documents drawn, the fine-tuning and the budgets.")
  elif model.get("hf_dir") or model.get("hub"):
    what = f"{model.name}, loaded from {model.get('hf_dir') or model.get('hub')}"
  else:
    family = "GPT-2" if model.get("family", "gpt2") == "gpt2" else f"{model.family}-family"
    what = (f"a small {family} model (d = {model.n_embd}, {model.n_layer} layers) pre-trained "
            "here for minutes on WikiText-2")
  return ("Why our numbers may differ from the seed's: the seed attacked GPT-2 124M (d = 768, "
          f"12 layers, pre-trained on WebText); this job attacks {what}, whose residual stream "
          "and embeddings differ, with fewer models and documents.")


# Published figures of the published attacks, for the report's table beside ours. Each is
# (value, metric, setting, source); the settings differ from lla's (model, split, data,
# batch size), so they are context, not targets. From ../shared/notes/published-attacks.md.
_BISR_TABLE = ("ROUGE-L F", "GPT-2-large, split 6-27, LoRA fine-tuning, 5-dataset average",
               "Chen et al. CCS'24 (BiSR), SplitLLM collect_big_table.ipynb @ a2ad63c")
_BATCH_TABLE = ("ROUGE-L F", "GPT-2-large, piqa-mini, batch size 1",
                "Chen et al. CCS'24 (BiSR), SplitLLM collect_batch_size.ipynb @ a2ad63c")
PUBLISHED = {
    "sip": (0.8695, *_BISR_TABLE),
    "bisr_b": (0.9343, *_BISR_TABLE),
    "bisr_f": (0.9667, *_BISR_TABLE),
    "bisr": (0.9679, *_BISR_TABLE),
    "tag": (0.9643, *_BATCH_TABLE[:1], "GPT-2-large, piqa-mini, batch size 1, 600 steps",
            _BATCH_TABLE[2]),
    "eia": (0.5892, *_BATCH_TABLE[:1], "GPT-2-large, piqa-mini, batch size 1, 24,000 steps",
            _BATCH_TABLE[2]),
    "sipit": (1.0, "exact match", "GPT-2 hidden states, 'Hello world'",
              "Nikolaou et al. arXiv 2510.15511 (official tests)"),
    "activation": (TOKEN_RECOVERY["activation"], "token recovery", "GPT-2 124M, k = 6, public",
                   "seed protocol, PROTOCOL.md section 8"),
    "joint": (TOKEN_RECOVERY["joint"], "token recovery", "GPT-2 124M, k = 6, public",
              "seed protocol, PROTOCOL.md section 8"),
}
