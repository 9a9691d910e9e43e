r"""santext / custext on the main job's tiny model: keep rate, attacks and utility cost.

  LLA_DATA_DIR=/work/shared/data python -m experiments.bench_sanitise --workdir=runs/bench_sanitise

Pre-trains the `tiny` base (configs/pretrain.py:tiny, `--pretrain_steps` steps; cached in
WORKDIR), draws the protocol's WikiText-2 splits (T = 32), sanitises the evaluation documents
at each epsilon, and on the captured h = client(y) (k = 2, public knowledge) runs `activation`
(the undefended beam; under a token replacement it is the best non-adaptive attack, which
recovers y) and `sanitise_adaptive`, both scored against the original tokens. Utility: the
held-out CE increase of the defended client at inference (no fine-tuning with the defense),
on the training split's documents. One JSON line per (defense, epsilon).
"""

import json

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from configs import pretrain as pretrain_config
from lla import data
from lla import defenses
from lla.attacks import registry
from lla.attacks.workspace import Workspace
from lla.defenses import utility
from lla.model import split
from lla.train import pretrain

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (pre-training cache).",
                               required=True)
_STEPS = flags.DEFINE_integer("pretrain_steps", 200, "Pre-training steps of the tiny base.")
_N_EVAL = flags.DEFINE_integer("n_eval", 48, "Evaluation documents attacked.")
_SANTEXT = flags.DEFINE_list("santext", ["200", "400"], "SanText epsilons.")
_CUSTEXT = flags.DEFINE_list("custext", ["5", "20"], "CusText epsilons (K = --top_k).")
_TOP_K = flags.DEFINE_integer("top_k", 20, "CusText's K.")
_CUT = 2
_SEED = 0  # the defender's explicit secret


def main(argv):
  del argv
  config = pretrain_config.get_config("tiny")
  config.num_steps = _STEPS.value
  checkpoint = pretrain.pretrain(config, _WORKDIR.value)
  params, cfg = checkpoint.params, checkpoint.cfg
  splits = data.load_splits(seq_len=32, n_calibration=16, n_train=48, n_eval=_N_EVAL.value)
  truth, calibration = splits.evaluation.tokens, splits.calibration.tokens
  table = split.input_table(params)
  budget = ml_collections.ConfigDict(dict(candidates=16, beam_width=4, ridge_alpha=1e-3,
                                          likelihood_prior_weight=1.0))
  print(json.dumps({"valid_ce": checkpoint.metadata["valid"]["ce"],
                    "pretrain_steps": _STEPS.value}), flush=True)
  runs = [("santext", dict(epsilon=float(e))) for e in _SANTEXT.value]
  runs += [("custext", dict(epsilon=float(e), top_k=_TOP_K.value)) for e in _CUSTEXT.value]
  for name, public in runs:
    defense, secret = defenses.make(name, **public), defenses.Secret.explicit(_SEED)
    y = np.concatenate([np.asarray(defense.sanitise(table, jnp.asarray(truth[i:i + 16]),
                                                    secret.keys(name, i // 16)))
                        for i in range(0, len(truth), 16)])
    h = np.asarray(split.client(params, cfg, jnp.asarray(y), _CUT))
    ws = Workspace(h, None, params, cfg, _CUT, calibration, defense={"name": name,
                                                                     "params": public})
    scores = {}
    for attack in ("activation", "sanitise_adaptive"):
      result, _ = registry.execute(attack, ws, budget, jax.random.key(0))
      scores[attack] = float(np.mean(result.predictions[:, 1:] == truth[:, 1:]))
    cost = utility.heldout_utility(params, cfg, splits.training.tokens, _CUT, defense, secret,
                                   n_boot=1000)
    print(json.dumps({"defense": name, **public,
                      "kept": float(np.mean(y[:, 1:] == truth[:, 1:])), **scores,
                      "ce_increase": cost["cross_entropy_increase"]}), flush=True)


if __name__ == "__main__":
  app.run(main)
