"""Sweeps (experiments/sweep.py): a grid of replay cells over one target model.

Run (from the repository root, after the main job has fine-tuned its targets in runs/main):

  python -m experiments.sweep --config=configs/sweep.py:cpu --workdir=runs/sweep
  python -m experiments.sweep --config=configs/sweep.py:cpu --workdir=runs/sweep --backend=ray
  python -m experiments.sweep --config=configs/sweep.py:frontier_cpu --workdir=runs/frontier
  python -m experiments.sweep --config=configs/sweep.py:frontier --workdir=runs/frontier \
      --config.cell.target.checkpoint=DIR --backend=ray --ray_address=auto

Variants (`:ARG`):
  cpu           k in {3, 6} x C in {8, 16, 32} x 2 seeds, three beam-search attacks on the
                embedded target, 16 documents: 12 cells in 4 groups, for 2 CPU cores.
  frontier      every registered attack family at the primary setting (k = 6, public
                knowledge, undefended), each attack's knob ladder generated from the target's
                analytic costs and placed at FLOP levels derived from its attacks' floors
                (lla.sweep.ladders; 256 documents, up to FRONTIER_CALIBRATION calibration
                documents: for accelerators); then the FLOP-matched report (lla.sweep.frontier)
                in WORKDIR/frontier, which compares every pair of attacks at the levels they
                share and within each level's budget.
  frontier_cpu  the same on 16 documents (2 CPU cores; the main job runs it on 8).
  frontier_table, frontier_table_cpu
                the same with the fixed ladders of `FRONTIER_KNOBS` at the fixed levels of
                `FRONTIER_LEVELS` ("paper", "cpu"), tuned to one target (issue 23's frontier,
                kept for comparison).
  defenses_cpu  the token-level defenses of issue 47 that act on a fixed target (SanText,
                CusText, Split-and-Denoise), two strengths each, on the embedded target:
                `activation` beside each one's adaptive attack, and the undefended cell, on
                16 documents (2 CPU cores; mid and adversarial train, so they run in the
                main job's defense sweep instead).
  test          one tiny cell; tests point `cell.target.hf_dir` and `cell.data.*_npy` at
                their own files and set `grids`.

A grid axis is (path, values) with a path into `cell`; `grids` is a union of grids, each
the product of its axes (lla.sweep.cells). Budget paths may name any declared budget field.
"""

import ml_collections

from configs import models
from lla.attacks import registry
from lla.data import load as data_load
from lla.sweep import ladders as ladders_lib

def _series(low: int, high: int) -> tuple[int, ...]:
  """1, 2, 3, 4, 6, 8, 12, ... (powers of two and their halfway 3 * 2^k) in [low, high]:
  rungs about sqrt(2) apart, so that a cost linear in the knob lands within a factor 1.5 of
  any level in its range."""
  values = {v for k in range(40) for v in (1 << k, 3 << k)}
  return tuple(sorted(v for v in values if low <= v <= high))


def _together(paths: tuple[str, ...], cpu, paper) -> dict:
  """Knob ladders given as rungs (one value per path each), as FRONTIER_KNOBS holds them."""
  return {path: {"cpu": tuple(rung[i] for rung in cpu), "paper": tuple(rung[i] for rung in paper)}
          for i, path in enumerate(paths)}


# The frontier's budget knobs as a fixed table (the frontier_table variants; the frontier
# variants generate theirs from the target, lla.sweep.ladders, and take from this table
# only which attacks of a family run). Per attack family: the attacks it runs and, per
# attack, the config paths that buy it more work, each with a ladder of values per scale ("cpu": 2 CPU
# cores, the main job's 8 documents per cell; "paper": an accelerator, 256 documents). The
# paths of one attack move together (rung i takes value i of each). The sweep does not run
# every rung: it places each attack at the rung whose predicted FLOPs (its analytic model,
# lla.attacks.flops) land nearest each of FRONTIER_LEVELS, within FRONTIER_TOLERANCE
# (lla.sweep.isoflop). The ladders reach down (fewer candidates, steps, epochs and
# calibration documents) and up (more candidates and beams) so that the families' ranges
# overlap where the algorithms allow. An empty dict: a fixed-cost attack, one point. A
# registered family missing here runs its attacks once, at their default budgets; an
# attack named here that is not registered (yet) is left out.
_SIP_RUNGS = dict(
    cpu=((8, 1), (12, 1), (16, 1), (24, 1), (32, 1), (32, 2), (32, 3), (32, 4), (32, 6),
         (32, 8), (32, 12), (32, 16)),
    paper=((32, 1), (32, 3), (64, 3), (128, 3), (256, 3), (256, 8), (512, 8), (1024, 8),
           (1024, 15), (2048, 15), (4096, 15), (8192, 15), (16384, 15), (32768, 15)))
FRONTIER_KNOBS = {
    "ridge": {
        "ridge": {"data.n_calibration": {"cpu": (8, 16, 32, 64, 128, 192, 256, 384, 512, 768,
                                                 1024, 1536),
                                         "paper": (32, 64, 128, 256, 512, 1024, 2048, 4096,
                                                   8192, 16384)}},
    },
    "beam_inversion": {
        # The cheapest rungs fit the ridge decoder on fewer calibration documents.
        "activation": _together(
            ("data.n_calibration", "budget.candidates"),
            cpu=((8, 1), (16, 1)) + tuple((32, c) for c in _series(1, 512)),
            paper=tuple((32, c) for c in _series(1, 3072))),
        "joint": {path: {"cpu": _series(1, 256), "paper": _series(1, 1536)}
                  for path in ("budget.c_a", "budget.c_g")},
    },
    "gradient_heuristic": {"gradient_only": {}},
    "learned_inversion": {
        "sip": _together(("data.n_calibration", "budget.sip_epochs"), **_SIP_RUNGS),
    },
    "embedding_inversion": {
        "bisr_f": _together(
            ("data.n_calibration", "budget.sip_epochs", "budget.bisr_f_steps"),
            cpu=((8, 1, 1), (8, 1, 4), (8, 1, 8), (16, 1, 8), (16, 1, 16), (24, 1, 24),
                 (32, 1, 32), (32, 2, 48), (32, 3, 64), (32, 4, 96), (32, 6, 128),
                 (32, 8, 192), (32, 12, 256)),
            paper=((32, 1, 1), (32, 1, 4), (32, 1, 8), (32, 3, 16), (32, 3, 32), (64, 3, 64),
                   (128, 3, 128), (256, 3, 256), (256, 8, 512), (512, 8, 1024),
                   (1024, 15, 2048), (2048, 15, 4096), (4096, 15, 8192))),
        "eia": {"budget.eia_steps": {"cpu": _series(1, 128), "paper": _series(1, 3072)}},
    },
    "gradient_matching": {
        "tag": {"budget.tag_steps": {"cpu": _series(1, 128), "paper": _series(1, 1536)}},
        "bisr_b": _together(
            ("data.n_calibration", "budget.sip_epochs", "budget.bisr_b_steps"),
            cpu=((8, 1, 1), (8, 1, 2), (8, 1, 4), (16, 1, 4), (16, 1, 8), (24, 1, 8), (32, 1, 8),
                 (32, 1, 16), (32, 2, 16), (32, 2, 24), (32, 3, 32), (32, 4, 48), (32, 6, 64)),
            paper=((32, 1, 1), (32, 1, 2), (32, 1, 4), (32, 1, 8), (32, 3, 16), (64, 3, 32),
                   (128, 3, 64), (256, 3, 128), (256, 8, 256), (512, 8, 512),
                   (1024, 15, 1024))),
        # The cheapest rungs score fewer permutation candidates per phase.
        "lamp": _together(
            ("budget.lamp_steps", "budget.lamp_candidates"),
            cpu=((1, 2), (1, 4), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16), (12, 16), (16, 16),
                 (24, 16), (32, 16), (48, 16), (64, 16), (96, 16)),
            paper=((1, 2), (1, 4), (2, 8), (4, 16), (8, 32), (16, 32), (32, 64), (64, 100),
                   (128, 100), (256, 100), (512, 100), (1024, 100))),
    },
}
# FLOP levels, per evaluation document (a cell of B documents aims at level * B): about two
# apart, from about the cheapest attack (the gradient-only heuristic: 2 T V d per document,
# one vocabulary ranking) up. With a factor-1.5 tolerance both ways every cost in the range
# lies within tolerance of some level, so a fixed-cost attack (gradient_only, SipIt) is
# compared with whatever landed at its level.
FRONTIER_LEVELS = {
    "cpu": tuple(5e8 * 2**i for i in range(8)),     # 4e9 .. 5.1e11 FLOPs on 8 documents
    "paper": tuple(3e9 * 2**i for i in range(13)),  # 7.7e11 .. 3.1e15 on 256 documents
}
FRONTIER_TOLERANCE = 1.5
# The calibration documents a target-placed frontier may draw from lla.data (its ladders'
# cap: the "given" data; the table's ridge ladders reach as far). A sweep whose calibration
# documents come from a .npy is capped by its rows.
FRONTIER_CALIBRATION = {"cpu": 1536, "paper": 16384}
PRIMARY = dict(cut=6, knowledge="public")  # The pre-registered primary setting.


def frontier_plan(scale: str, ladders: str = "table") -> tuple[tuple, tuple, tuple[str, ...],
                                                                 tuple[str, ...]]:
  """(grids of the attacks that run once, knob ladders of those placed at FLOP levels
  (config.frontier.knobs), attacks run at their defaults because their family has no knobs
  here, attacks that run once at a fixed cost (config.frontier.fixed)) for every registered
  attack that fits the primary setting's capture: a passive attack (not a control, not
  defense-aware, not adaptive) on activations and gradients. `ladders` "table": the
  FRONTIER_KNOBS ladders at `scale`; "target": every attack lla.sweep.ladders knows gets an
  empty entry, its ladder generated from the target when the sweep is placed."""
  grids, knobs, untabled, fixed = [], [], [], []
  for spec in registry.specs():
    if (spec.role != "attack" or spec.tier != "passive" or spec.defense_aware
        or not registry.fits(spec, {"activations", "gradients"}, PRIMARY["knowledge"], "none")):
      continue
    family = FRONTIER_KNOBS.get(spec.family)
    if family is not None and spec.name not in family:
      continue  # a variant the table leaves out (the same attacks in both modes)
    if ladders == "target":
      if spec.name not in ladders_lib.knobs():
        untabled.append(spec.name)
      if ladders_lib.knobs().get(spec.name):
        knobs.append((spec.name, ()))
      else:
        grids.append((("attacks", ((spec.name,),)),))
        fixed.append(spec.name)
      continue
    if family is None:
      untabled.append(spec.name)
    table = {} if family is None else family[spec.name]
    if not table:
      grids.append((("attacks", ((spec.name,),)),))
      fixed.append(spec.name)
      continue
    if len({len(values[scale]) for values in table.values()}) != 1:
      raise ValueError(f"FRONTIER_KNOBS[{spec.family!r}][{spec.name!r}]: ladders of different "
                       "lengths (the paths move together)")
    knobs.append((spec.name, tuple((path, tuple(values[scale]))
                                   for path, values in table.items())))
  return tuple(grids), tuple(knobs), tuple(untabled), tuple(fixed)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  variant = arg or "cpu"
  variants = ("cpu", "frontier", "frontier_cpu", "frontier_table", "frontier_table_cpu",
              "defenses_cpu", "test")
  if variant not in variants:
    raise ValueError(f"unknown variant {variant!r}: {', '.join(variants)}")
  paper, test = variant in ("frontier", "frontier_table"), variant == "test"
  config = ml_collections.ConfigDict()
  config.name = variant  # Recorded in the study's header.
  config.policy = "scorecard-policy.v3"  # Scoring policy named in the study's header (G).
  cell = config.cell = ml_collections.ConfigDict()
  # The target: the model whose client sends the captured messages (configs/models.py:
  # checkpoint, hf_dir or hub). Default: the main job's first fine-tuned k = 6 target.
  cell.target = models.get_config("tiny" if test else
                                  ("gpt2_124m" if paper else "embedded"))
  cell.target.checkpoint = "" if (test or paper) else "runs/main/finetune/k6_public/seed_0"
  # The attacker's weights under "trained" knowledge: the pre-trained base.
  cell.pretrained = models.get_config("tiny" if test else ("gpt2_124m" if paper else "embedded"))
  cell.pretrained.checkpoint = "" if (test or paper) else "runs/main/pretrain/checkpoint"
  # Documents: lla.data's splits (evaluation documents are captured, calibration documents
  # are the attacker's), or [B, T] / [N, T] token .npy files when `tokens_npy` is set.
  cell.data = data_load.get_config()
  cell.data.n_eval = 256 if paper else 16
  cell.data.tokens_npy = ""  # Evaluation documents as a .npy (then calibration_npy too).
  cell.data.calibration_npy = ""  # The attacker's calibration documents as a .npy.
  cell.cut = PRIMARY["cut"] if not test else 2  # k: the client runs blocks 0..k-1.
  cell.knowledge = PRIMARY["knowledge"]  # "public" (exact client weights) or "trained".
  # The target's defense at capture time (lla.defenses name, parameter, strength); "none"
  # is undefended. The target is fixed (no fine-tuning with the defense in the loop), so a
  # defense that acts through fine-tuning (nopeek) cannot be captured here. A defense that
  # draws secrets gets the defender's own: 128 bits from the OS, drawn when its capture is
  # first made and kept in WORKDIR/defender/secrets.json (outside the captures and the
  # study, which record its hash alone), never derived from a public value. `strength` is
  # the value of `param` (an epsilon for dx_privacy); `fixed` ((parameter, value), ...) the
  # defense's other public parameters (dp_forward's delta and clip_norm, custext's top_k),
  # as the main job's config.defenses holds them; empty leaves a cell's id as before it.
  cell.defense = ml_collections.ConfigDict(dict(name="none", param="", strength=0.0,
                                                fixed=()))
  cell.capture_batch_size = 32  # Documents per training batch at capture (g's loss).
  cell.attacks = ("activation",)  # Registered attack names run on the cell's capture.
  # Budget fields (lla.attacks.budget), at their defaults; a cell's identity holds only
  # those it changes. A field that none of the cell's attacks reads must stay at default.
  cell.budget = registry.budget_config()
  cell.plugins = ""  # Modules outside lla that register attacks ("pkg.module,...").
  cell.seed = 0  # Attack seed: every attack's randomness derives from it.
  cell.model_seed = 0  # Which fine-tuned target this is (recorded; the gates' seed).
  cell.memory_budget_mb = 1024  # Per-chunk working set of an attack.
  # The grid: a union of grids, each a tuple of (path in `cell`, (values...)) axes whose
  # product gives cells. Empty: the base cell alone.
  config.grids = ()
  config.frontier = ml_collections.ConfigDict()
  config.frontier.enabled = False  # Write the FLOP-matched report to WORKDIR/frontier.
  config.frontier.untabled = ()  # Attacks run at defaults: their family has no knobs.
  # Iso-FLOP placement (lla.sweep.isoflop): FLOP levels per evaluation document (empty: the
  # grids alone), the factor within which a run counts at a level, and per attack its knob
  # ladders ((attack, ((path, ladder), ...)), ...), placed at the levels before the cells
  # expand. The report compares attacks at these levels (lla.sweep.frontier).
  config.frontier.levels = ()
  config.frontier.tolerance = FRONTIER_TOLERANCE
  config.frontier.knobs = ()
  # "target": the knobbed attacks' ladders (their empty knobs) generated from the target's
  # analytic costs, and empty levels derived from the attacks' floors (lla.sweep.ladders);
  # "table": the knobs and levels as given.
  config.frontier.ladders = "table"
  config.frontier.fixed = ()  # Attacks that run once (their floors count for the levels).
  if variant == "cpu":
    cell.attacks = ("ridge", "activation", "random_candidates")
    cell.budget.c_a, cell.budget.c_g = 4, 4
    config.grids = ((("cut", (3, 6)), ("budget.candidates", (8, 16, 32)), ("seed", (0, 1))),)
  elif variant == "defenses_cpu":
    # Epsilons on the embedded base (d = 128, median input-row norm r = 0.88 over document
    # tokens, experiments.defense_scales). SanText's P(y | x) ~ exp(-epsilon d(x, y) / 2):
    # at 80 and 40 it replaced no token that changed `activation`'s recovery (81.64% and
    # 78.91% against 81.64% undefended, 16 documents, 2026-12-06), so it runs at 10 and 5.
    # CusText's utility scores lie in [0, 1] whatever the scale, so its epsilons are
    # bench_sanitise's; SnD's noise is dx_privacy's at the main job's cpu epsilons
    # (E||z|| = 0.36 r and 3.6 r).
    def defended(name, strengths, attacks, fixed=()):
      return (("defense.name", (name,)), ("defense.param", ("epsilon",)),
              ("defense.strength", strengths), ("defense.fixed", (fixed,)),
              ("attacks", (attacks,)))
    config.grids = ((("attacks", (("activation",),)),),
                    defended("santext", (10.0, 5.0), ("activation", "sanitise_adaptive")),
                    defended("custext", (20.0, 5.0), ("activation", "sanitise_adaptive"),
                             (("top_k", 20),)),
                    defended("snd", (400.0, 40.0), ("activation", "dx_privacy_adaptive")))
  elif variant.startswith("frontier"):
    scale = "paper" if paper else "cpu"
    config.frontier.ladders = "table" if "table" in variant else "target"
    if config.frontier.ladders == "table":
      config.frontier.levels = FRONTIER_LEVELS[scale]
    else:
      cell.data.n_calibration = FRONTIER_CALIBRATION[scale]
    (config.grids, config.frontier.knobs, config.frontier.untabled,
     config.frontier.fixed) = frontier_plan(scale, config.frontier.ladders)
    config.frontier.enabled = True
  return config
