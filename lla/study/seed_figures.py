"""The seed's published figures (PROTOCOL section 8), printed beside ours in the report.

GPT-2 124M, WikiText-2, k = 6, public client layers, 256 evaluation documents.
"""

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

WHY_DIFFERENT = (
    "Why our numbers may differ from the seed's: the seed attacked GPT-2 124M (d = 768, 12 "
    "layers, pre-trained on WebText); the CPU default attacks a small GPT-2 (d = 128, 8 layers) "
    "pre-trained here for minutes on WikiText-2, whose residual stream and embeddings differ, "
    "with fewer models and documents.")
