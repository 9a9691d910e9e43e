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
  frontier      every registered attack family at 3 or more budgets at the primary setting
                (k = 6, public knowledge, undefended), the budgets of `FRONTIER_KNOBS`
                ("paper" levels, 256 documents: for accelerators); then the FLOP-matched
                report (lla.sweep.frontier) in WORKDIR/frontier.
  frontier_cpu  the same at the "cpu" levels on 16 documents (2 CPU cores).
  test          one tiny cell; tests point `cell.target.hf_dir` and `cell.data.*_npy` at
                their own files and set `grids`.

A grid axis is (path, values) with a path into `cell`; `grids` is a union of grids, each
the product of its axes (lla.sweep.cells). Budget paths may name any declared budget field.
"""

import ml_collections

from configs import models
from lla.attacks import registry
from lla.data import load as data_load

# The frontier's budget knobs. Per attack family: the attacks it runs and, per attack, the
# config paths that buy it more work, each with its levels ("cpu": 2 CPU cores, 16
# documents; "paper": an accelerator, 256 documents). The paths of one attack move together
# (level i takes value i of each). An empty dict: a fixed-cost attack, one point. A
# registered family missing here runs its attacks once, at their default budgets; an
# attack named here that is not registered (yet) is left out.
FRONTIER_KNOBS = {
    "ridge": {
        "ridge": {"data.n_calibration": {"cpu": (8, 16, 32), "paper": (64, 256, 1024)}},
    },
    "beam_inversion": {
        "activation": {"budget.candidates": {"cpu": (2, 4, 8, 16, 32),
                                             "paper": (8, 32, 128, 512)}},
        "joint": {"budget.c_a": {"cpu": (1, 2, 4, 8, 16), "paper": (4, 16, 64, 256)},
                  "budget.c_g": {"cpu": (1, 2, 4, 8, 16), "paper": (4, 16, 64, 256)}},
    },
    "gradient_heuristic": {"gradient_only": {}},
    "learned_inversion": {
        "sip": {"budget.sip_epochs": {"cpu": (1, 3, 9), "paper": (3, 15, 45)}},
    },
    "embedding_inversion": {
        "bisr_f": {"budget.bisr_f_steps": {"cpu": (25, 100, 400), "paper": (200, 800, 3200)}},
        "eia": {"budget.eia_steps": {"cpu": (25, 50, 100), "paper": (3000, 12000, 24000)}},
    },
    "gradient_matching": {
        "tag": {"budget.tag_steps": {"cpu": (10, 30, 100), "paper": (150, 600, 2400)}},
        "bisr_b": {"budget.bisr_b_steps": {"cpu": (4, 16, 64), "paper": (8, 32, 128)}},
        "lamp": {"budget.lamp_steps": {"cpu": (10, 30, 100), "paper": (200, 800, 3200)}},
    },
}
PRIMARY = dict(cut=6, knowledge="public")  # The pre-registered primary setting.


def frontier_grids(scale: str) -> tuple[tuple, tuple[str, ...]]:
  """(grids, attacks run at their defaults because their family has no knobs here) for
  every registered attack that fits the primary setting's capture: a passive attack
  (not a control, not defense-aware, not adaptive) on activations and gradients."""
  grids, untabled = [], []
  for spec in registry.specs():
    if (spec.role != "attack" or spec.tier != "passive" or spec.defense_aware
        or not registry.fits(spec, {"activations", "gradients"}, PRIMARY["knowledge"], "none")):
      continue
    family = FRONTIER_KNOBS.get(spec.family)
    if family is not None and spec.name not in family:
      continue
    knobs = {} if family is None else family[spec.name]
    if family is None:
      untabled.append(spec.name)
    levels = {len(values[scale]) for values in knobs.values()} or {1}
    if len(levels) != 1:
      raise ValueError(f"FRONTIER_KNOBS[{spec.family!r}][{spec.name!r}]: paths have different "
                       "numbers of levels")
    for level in range(levels.pop()):
      grids.append((("attacks", ((spec.name,),)),)
                   + tuple((path, (values[scale][level],)) for path, values in knobs.items()))
  return tuple(grids), tuple(untabled)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  variant = arg or "cpu"
  if variant not in ("cpu", "frontier", "frontier_cpu", "test"):
    raise ValueError(f"unknown variant {variant!r}: cpu, frontier, frontier_cpu or test")
  paper, test = variant == "frontier", variant == "test"
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
  # is undefended. The target is fixed (no fine-tuning with the defense in the loop).
  cell.defense = ml_collections.ConfigDict(dict(name="none", param="", strength=0.0))
  cell.capture_batch_size = 32  # Documents per training batch at capture (g's loss).
  cell.attacks = ("activation",)  # Registered attack names run on the cell's capture.
  # Budget fields (lla.attacks.budget), at their defaults; a cell's identity holds only
  # those it changes. A field that none of the cell's attacks reads must stay at default.
  cell.budget = registry.budget_config()
  cell.plugins = ""  # Modules outside lla that register attacks ("pkg.module,...").
  cell.seed = 0  # Attack seed: every attack's randomness derives from it.
  cell.model_seed = 0  # Which fine-tuned target this is (defense secrets derive from it).
  cell.memory_budget_mb = 1024  # Per-chunk working set of an attack.
  # The grid: a union of grids, each a tuple of (path in `cell`, (values...)) axes whose
  # product gives cells. Empty: the base cell alone.
  config.grids = ()
  config.frontier = ml_collections.ConfigDict()
  config.frontier.enabled = False  # Write the FLOP-matched report to WORKDIR/frontier.
  config.frontier.untabled = ()  # Attacks run at defaults: their family has no knobs.
  if variant == "cpu":
    cell.attacks = ("ridge", "activation", "random_candidates")
    cell.budget.c_a, cell.budget.c_g = 4, 4
    config.grids = ((("cut", (3, 6)), ("budget.candidates", (8, 16, 32)), ("seed", (0, 1))),)
  elif variant in ("frontier", "frontier_cpu"):
    config.grids, config.frontier.untabled = frontier_grids("paper" if paper else "cpu")
    config.frontier.enabled = True
  return config
