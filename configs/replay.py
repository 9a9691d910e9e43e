"""Replay registered attacks on a stored capture (lla.replay.driver).

Run:

  python -m experiments.replay --config=configs/replay.py --config.capture_dir=OUT \
      --config.attacker.hf_dir=DIR --config.calibration.tokens_npy=CAL.npy \
      --config.attacks=activation,joint,gradient_only,shuffled_gradients,random_candidates \
      --workdir=RUN

With no attacker weights given, the attacker uses the embedded default (configs/models.py);
with no calibration .npy, the calibration split of lla.data.
"""

import ml_collections
from ml_collections import config_dict

from configs import models
from lla.attacks import registry
from lla.data import load as data_load


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.capture_dir = ""  # The capture to replay (experiments/capture.py's --workdir).
  # The attacker's model (its copy of the client layers): checkpoint / hf_dir / hub.
  config.attacker = models.get_config(arg or "embedded")
  # "public": the attacker holds the target's exact client weights; "trained": only the
  # pre-trained ones while the target fine-tuned its client layers (PROTOCOL section 1).
  config.knowledge = "public"
  # Calibration documents: the corpus's calibration split, or a [N, T] .npy of token ids.
  config.calibration = data_load.get_config()
  config.calibration.tokens_npy = ""
  # Comma-separated registered attack names (lla.attacks.registry.names()).
  config.attacks = "activation,joint,gradient_only,gradient_only_t1,shuffled_gradients,random_candidates"
  # Every declared budget field at its default (lla.attacks.budget: the published values;
  # `python -c "from lla.attacks import registry; print(registry.budget_config())"` lists them). A
  # field changed here must be read by one of the requested attacks.
  config.budget = registry.budget_config()
  # Modules outside lla that register attacks, comma-separated ("pkg.module,..."), and
  # their budget fields as "name=value,..." (declared by the plugin, so not in `budget`).
  config.plugins = ""
  config.plugin_budget = ""
  config.seed = 0  # Attack seed: every attack's randomness derives from it.
  config.model_seed = 0  # Which fine-tuned target this capture came from (for the bootstrap).
  # Defended captures: run_id prefix of the linked undefended reference run; each attack
  # links prefix + its name.
  config.reference_prefix = ""
  # Defense-aware attacks (e.g. activation_defense_aware): the attacker's own seed for passing
  # its calibration through the capture's defense mechanism (public parameters, read from the
  # capture). Required for those attacks and refused for the others; recorded in E.K.
  config.calibration_defense_seed = config_dict.placeholder(int)
  config.run_prefix = ""  # Prefix of each record's run_id.
  # Per-chunk working set on CPU; documents are chunked to fit. On GPU and TPU chunks are
  # sized from the devices' free memory instead (lla.attacks.memory.chunk_budget_bytes).
  config.memory_budget_mb = 2048
  # How the attacks' model calls run the layers: "auto" (unrolled on CPU, scanned on GPU
  # and TPU), "scanned" (compile flat in the depth and the cut) or "unrolled"
  # (lla.attacks.workspace.LAYER_FORMS; the same predictions and FLOPs in each).
  config.layer_form = "auto"
  return config
