r"""The active-server tier (lla.active): FSHA and a mixed variant against split fine-tuning,
the client's detectors, and replays of the hijacked captures.

  python -m experiments.active_server --config=configs/active.py:cpu \
      --config.model.checkpoint=RUN/pretrain/checkpoint --workdir=runs/active

Variants (`:ARG`):
  cpu   the main job's section: the embedded 8-layer d = 128 GPT-2 pre-trained by the main
        job (its checkpoint in --config.model.checkpoint), k = 6, 3 calibration + 3 judged
        seeds per server, B = 8, N up to 30 hijacked steps, the cheap passive attacks
        (ridge; beam search on honest captures): a few minutes on 2 CPU cores.
  full  the same with B = 16, N up to 40 and the beam-search attacks (activation, joint)
        on every capture.
  tiny  a randomly initialised 4-layer d = 32 model, a handful of steps: the tests.

Any family: --config.model.hf_dir=DIR (or --config.model.gguf=FILE) runs the tier on that
checkpoint, its architecture its own (GPT-2, Llama, Mistral, Qwen2/3, Gemma). Its own
tokenizer (the GGUF's, the directory's tokenizer.json) cuts the documents and the public
windows, its BOS first and unscored; without one, the data directory's GPT-2 tokenizer
does, and the model's vocabulary must hold its ids.
"""

import ml_collections

from configs import decoy_leak, finetune, models, scoring
from lla import data


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  variant = arg or "cpu"
  if variant not in ("cpu", "full", "tiny"):
    raise ValueError(f"unknown variant {variant!r}: cpu, full or tiny")
  tiny, full = variant == "tiny", variant == "full"
  c = ml_collections.ConfigDict()
  c.variant = variant  # Recorded with every run.
  # The base model: the client's starting point (knowledge `trained`: all its layers train).
  c.model = models.get_config("tiny" if tiny else "embedded")
  c.model.checkpoint = ""  # lla checkpoint of the pre-trained base; required for cpu.
  c.model.init_seed = 0 if tiny else -1  # Without a checkpoint: seeded random init (tiny only).
  # The client's documents: training batches and the evaluation documents that every
  # capture holds (the same documents for every server, step and seed).
  c.data = data.get_config()
  c.data.n_calibration = 16 if tiny else 32  # The passive attacker's public calibration.
  c.data.n_train = 32 if tiny else 128  # Fine-tuning documents.
  c.data.n_eval = 8 if tiny else 32  # Documents captured and attacked at each step N.
  c.cut = 2 if tiny else 6  # k; the main job's `trained` targets are at k = 6.
  c.batch_size = 16 if full else 8  # B, client and public batches alike.
  # Split fine-tuning steps per run (fake batches included) and the steps N at which the
  # evaluation documents are captured and the task loss measured.
  c.num_steps = 40 if full else (16 if tiny else 30)
  c.capture_steps = (0, 10, 20, 40) if full else ((0, 16) if tiny else (0, 10, 30))
  # The client's optimiser: the fine-tune AdamW of configs/finetune.py (per-party clip 1.0,
  # lr 3e-4, cosine over num_steps); the server does not choose it.
  c.client_optimizer = finetune.get_config("tiny" if tiny else "embedded").optimizer
  c.server_optimizer = finetune.get_config("tiny" if tiny else "embedded").optimizer  # Tails.
  # The server's public text: WikiText-2 train windows disjoint from the client's.
  c.public = ml_collections.ConfigDict()
  c.public.n_docs = 200 if tiny else 2000  # Windows of T tokens (notes 4.8: 2,000).
  c.public.seed = 0  # Which windows.
  # FSHA (lla.active.fsha); official values from pasquini-dario/SplitNN_FSHA notebooks.
  c.fsha = ml_collections.ConfigDict()
  c.fsha.critic_hidden = 32 if tiny else 256  # Critic MLP width (notes 4.8: 256).
  c.fsha.gp_weight = 500.0  # WGAN-GP weight (official 500).
  c.fsha.lr_pilot = 1e-5  # Pilot/decoder Adam lr during the hijack (official lr_tilde).
  # Critic Adam lr: official lr_D = 1e-4 is 10x the official client lr (1e-5); here the
  # client fine-tunes at 3e-4, and with 1e-4 the client outruns the critic (its score
  # falls without bound), so the official ratio is kept: 3e-3, 5 updates per step.
  c.fsha.lr_critic = 3e-3
  c.fsha.critic_steps = 5  # Critic updates per client step (official 1; see lr_critic).
  # Keep training pilot/decoder during the hijack (official). At d = 128 random unit-RMS
  # rows already decode exactly (L_ae = 0 in float32, so its gradient is 0): off on CPU.
  c.fsha.train_pilot = tiny
  c.fsha.alpha = 1.0  # Scale of the returned gradient (official 1).
  c.fsha.stats_steps = 1  # First steps whose h fix the per-dimension statistics.
  c.fsha.zero_last_row = True  # Return g[:, T-1] = 0 like an honest server.
  c.fsha.pilot_seed = 0  # Init and batches of the pilot pre-training.
  # Pilot/decoder pre-training (notes 4.8: 200); at d = 128 L_ae is 0 from the start.
  c.fsha.pretrain_steps = 20
  c.fsha.pretrain_lr = 1e-3  # Its Adam lr (notes 4.8; SplitLLM's fit_auto_encoder).
  # Malicious servers run beside the honest one: (kind, beta); "fsha" is the published
  # attack, ("mixed", beta) returns (1-beta) g_task + beta |g_task|/|g_adv| g_adv per row.
  c.attacks = (("fsha", 1.0), ("mixed", 0.2))
  c.seeds = (0, 1, 2) if not tiny else (0,)  # Judged runs: one per server per seed.
  c.calibration_seeds = (100, 101, 102) if not tiny else (100,)  # Honest runs fixing thresholds.
  c.detectors = ml_collections.ConfigDict()
  # SplitGuard (official N = 20, p_fake = 0.1); on the CPU runs' 30-40 steps a warm-up of 5
  # and p_fake = 0.25 give 6-9 fake batches per run instead of 1-2.
  c.detectors.splitguard_warmup = 1 if tiny else 5
  c.detectors.p_fake = 0.4 if tiny else 0.25
  c.detectors.mult = 5.0  # Official squashing: sigmoid(mult x)^exp.
  c.detectors.exp = 2.0
  c.detectors.reference_every = 2 if tiny else 5  # Reference-cosine check every n batches.
  # Gradients Scrutinizer: a score every n steps (official 50 of 10,000; the CPU runs have
  # 30-40 steps, and its fits need 3 earlier steps).
  c.detectors.scrutinizer_every = 2 if tiny else 5
  # SplitOut: the honest simulation's steps (its LOF takes n - 1 neighbours) and the
  # majority-vote window w (official w in {1, 10}; 5 gives the CPU runs 5-7 windows each).
  c.detectors.splitout_honest_steps = 6 if tiny else 16
  c.detectors.splitout_window = 2 if tiny else 5
  c.detectors.quantile = 0.99  # Threshold: this quantile of calibration alarm scores.
  c.detectors.wilson_z = 1.6449  # One-sided 95% Wilson bound on detection / false-alarm rates.
  # Replays of every capture (lla.replay.driver): honest runs get the passive attacks under
  # `trained` knowledge, hijacked runs fsha_decode (knowledge none) and passive attacks on
  # the same documents. Beam search costs ~10 s per capture on 2 cores: cpu runs it on the
  # honest captures only.
  c.replay = ml_collections.ConfigDict()
  c.replay.honest = ("activation", "joint") if full else ("ridge", "activation")
  c.replay.hijacked = ("fsha_decode", "activation") if full else ("fsha_decode", "ridge")
  c.replay.budget = ml_collections.ConfigDict()
  c.replay.budget.candidates = 32  # C (PROTOCOL section 4).
  c.replay.budget.beam_width = 2  # W.
  c.replay.budget.c_a = 16  # Joint: activation candidates.
  c.replay.budget.c_g = 16  # Joint: gradient candidates.
  c.replay.budget.ridge_alpha = 1e-3  # Ridge strength.
  c.replay.memory_budget_mb = 1024  # Per-chunk attack working set.
  # Scoring of this experiment's own study (configs/scoring.py with the threat space of
  # these replays): the coverage report and qualification matrix show the active tier.
  c.scoring = scoring.get_config()
  c.scoring.threat_space.families = ("ridge", "beam_inversion", "active_hijack")
  c.scoring.threat_space.observations = ("activations", "activations+gradients")
  c.scoring.threat_space.knowledge = ("trained", "none")
  c.scoring.threat_space.defenses = ("none",)
  c.scoring.threat_space.out_of_scope = (
      {"family": "ridge", "knowledge": "none",
       "reason": "passive inversion runs the attacker's copy of the client layers"},
      {"family": "ridge", "observation": "activations+gradients",
       "reason": "ridge inversion reads activations only"},
      {"family": "beam_inversion", "knowledge": "none",
       "reason": "passive inversion runs the attacker's copy of the client layers"},
      {"family": "active_hijack", "knowledge": "trained",
       "reason": "FSHA as published holds no client weights"},
      {"family": "active_hijack", "observation": "activations+gradients",
       "reason": "fsha_decode reads the forward messages only"},
  )
  c.scoring.secondary = ()  # No primary-test setting (k = 6 public) in this study.
  # The second active attack: the cloud's probe of the decoy-row split (lla.active.decoy_probe).
  c.decoy_probe = ml_collections.ConfigDict()
  c.decoy_probe.enabled = True  # Run it in this experiment.
  # The split itself: the main job's decoy variant (synthetic tokens, a 2-layer model).
  c.decoy_probe.system = decoy_leak.get_config("tiny")
  c.decoy_probe.seeds = (0,) if tiny else (0, 1, 2)  # Independent systems (init, data, secrets).
  c.decoy_probe.steps = 32 if tiny else 256  # Training steps = probed frames per run.
  c.decoy_probe.amplitudes = (0.3,) if tiny else (0.1, 0.3, 1.0)  # a; a = 0 always runs too.
  return c
