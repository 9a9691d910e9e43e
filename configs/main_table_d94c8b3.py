"""The `cpu` main job doing exactly the attack and defense work of commit d94c8b3's.

Issue 14 asked for the attack and defense phases before and after its work, like for like.
Since d94c8b3 the `cpu` job does more (adaptive and published attacks on defended captures,
fewer strengths, new phases); this config puts back d94c8b3's sweep and turns the rest off,
so that its phase times (timing.json, the report's phase table) compare with that commit's
`configs/main_table.py:cpu` run from its own clone. Run:

  python -m experiments.main_table --config=configs/main_table_d94c8b3.py --workdir=runs/d94c8b3_work

Pre-training and fine-tuning are those of `cpu` (copy a `cpu` run's `pretrain/` and
`finetune/k*_public`, `finetune/k6_trained` into the workdir to reuse them: the job checks
their configs and reuses them; never copy the defended fine-tunes `finetune/def_*`, which
belong to the defense phase being timed).
"""

import ml_collections

from configs import main_table
from lla.attacks import registry

# What d94c8b3's defense phase ran on every defended capture: its `defense_attacks` and, where
# the mechanism acts on activations, its `defense_aware_attacks`.
D94C8B3_DEFENSE_ATTACKS = ("activation", "joint", "activation_defense_aware")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  del arg  # One variant: `cpu`'s model, data, budgets and attack phase.
  config = main_table.get_config("cpu")
  # d94c8b3's `cpu` sweep: three Gaussian strengths and mixup m = 2 and 4.
  config.defenses = (
      ("gaussian", "sigma", (0.3, 1.0, 3.0)),
      ("topk", "sparsity", (0.75, 0.9)),
      ("quantize", "bits", (4, 2)),
      ("mixup", "m", (2, 4)),
      ("projection", "enabled", (True,)),
      ("gradient_clip_noise", "clip_norm", (0.01,)),
      ("nopeek", "alpha", (1.0,)),
  )
  registry.load_builtin()
  # Every other fitting attack skipped on defended captures (verdicts here are not the
  # point: they cannot PASS).
  config.defense_skip_attacks = tuple(n for n in registry.names()
                                      if n not in D94C8B3_DEFENSE_ATTACKS)
  config.published.attacks = ()  # Phases d94c8b3 did not have.
  config.frontier.enabled = False
  config.active.enabled = False
  return config
