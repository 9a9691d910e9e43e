r"""Training-time split with decoy rows (PROTOCOL section 7): the returned-gradient leak.

Run (CPU default, WikiText-2 from $LLA_DATA_DIR or --config.data.data_dir):

  python experiments/decoy_leak.py --config=configs/decoy_leak.py:cpu \
      --workdir=/tmp/decoy_leak

Variants: `cpu` (default; random-init small GPT-2 until a pretrained checkpoint is named
in --config.model.hf_dir) and `tiny` (synthetic tokens, a 2-layer model: the tests).
Paper scale: --config.num_seeds=9 --config.model.hf_dir=/path/to/gpt2 --config.model.cut=6.
"""

import ml_collections


def get_config(arg: str = "cpu") -> ml_collections.ConfigDict:
  if arg not in ("cpu", "tiny"):
    raise ValueError(f"config variant {arg!r}: expected 'cpu' or 'tiny'")
  tiny = arg == "tiny"
  c = ml_collections.ConfigDict()
  # Independent seeds 0..N-1 (model init, data order, secrets). Paper: 9. Measured on 2
  # shared CPU cores: 16 min for seed 0 (2 x 2048 steps + 72 probes incl. calibration), about
  # 12 min for each further seed, so one seed fits in ~20 min.
  c.num_seeds = 1
  c.policy = "decoy-gate.v1"  # lla/decoy/policies/<policy>.json: thresholds, doses; hashed.

  c.model = ml_collections.ConfigDict()
  # An HF save_pretrained directory of any family (GPT-2, Llama, Qwen2/3, Mistral, Gemma);
  # empty: a seeded random init of the GPT-2 below.
  c.model.hf_dir = ""
  c.model.cut = 1 if tiny else 2  # k: the TLN prefix is embed + blocks[0:k].
  c.model.n_layer = 2 if tiny else 4  # Random-init shape (ignored with hf_dir).
  c.model.n_embd = 32 if tiny else 128
  c.model.n_head = 2 if tiny else 4
  c.model.n_positions = 64  # Only 32 positions are ever used.

  c.data = ml_collections.ConfigDict()
  c.data.source = "synthetic" if tiny else "wikitext"  # "wikitext" or "synthetic".
  c.data.data_dir = ""  # WikiText-2 + tokenizer directory; empty: $LLA_DATA_DIR.
  c.data.synthetic_vocab = 64  # Synthetic Markov stream: vocabulary,
  c.data.synthetic_tokens = 40_000  # length,
  c.data.synthetic_seed = 0  # and seed (fixed across experiment seeds: one corpus).

  c.protocol = ml_collections.ConfigDict()
  c.protocol.steps = 512 if tiny else 2048  # S: training steps = frames captured (paper 4096).
  c.protocol.n_real = 32  # Real rows per frame: one 32-token block.
  c.protocol.n_decoy = 48  # Decoy rows per frame.
  c.protocol.width = 16 if tiny else 64  # D: wire width of the private encoder.
  c.protocol.pool_size = 256 if tiny else 8192  # Decoy pool: the last P real rows sent.
  c.protocol.fwd_clip = 1.0  # C: L2 clip of every real row sent.
  c.protocol.fwd_noise = 0.02  # Per-coordinate Gaussian std of forward noise, units of C.

  c.ucn = ml_collections.ConfigDict()
  c.ucn.hidden = 32  # Width of the UCN's radial scalar MLP phi(||x||).

  c.train = ml_collections.ConfigDict()
  # TLN trains its model's prefix and tail too (else only the codec). Off on CPU: AdamW
  # over the 50k x d embedding doubles the step time (0.2 s vs 0.1 s at d = 128).
  c.train.train_model = tiny
  c.train.lr_tln = 1e-3  # AdamW learning rate of the TLN.
  c.train.lr_ucn = 1e-3  # AdamW learning rate of the UCN.
  c.train.weight_decay = 0.01  # AdamW weight decay of both nodes.
  c.train.chunk = 256  # Steps per compiled scan call (memory of stacked frames).

  c.mitigation = ml_collections.ConfigDict()
  c.mitigation.grad_clip = 0.01  # C_g: L2 clip of every returned-gradient row, decoys too.
  c.mitigation.grad_noise = 0.35  # Per-coordinate noise std in units of C_g.

  c.eval = ml_collections.ConfigDict()
  c.eval.blocks = 64 if tiny else 256  # Held-out blocks for the CE (utility) measurement.

  c.probe = ml_collections.ConfigDict()
  c.probe.classifiers = ("linear", "mlp")  # Each (features, classifier) pair is one arm.
  c.probe.label = "input"  # Row label: "input" (its own token) or "target" (next token).
  c.probe.max_classes = 512  # Probe head: the most frequent training tokens + "other".
  c.probe.mlp_hidden = 128  # Hidden width of the MLP probe.
  c.probe.steps = 300 if tiny else 1500  # AdamW steps (random minibatches of the train half).
  c.probe.batch = 512  # Minibatch rows.
  c.probe.lr = 1e-2  # Peak AdamW learning rate of the probe (cosine decay to 0).
  c.probe.weight_decay = 1e-4  # AdamW weight decay of the probe.

  c.calibration = ml_collections.ConfigDict()
  c.calibration.seeds = 1  # Seeds 0..n-1 get the leak-injection dose response.
  return c
