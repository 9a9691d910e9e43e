r"""Prints the scales a defense's parameters are set from, for one model at one cut.

  python -m experiments.defense_scales --model_dir=runs/main/pretrain/checkpoint/hf --cut=6

The median input-row norm r over the tokens of the passages (d_chi noise: E||z|| = d /
epsilon, so epsilon = d / (c r) puts the noise at c times r) and the median per-passage
||h||_F at the cut (DP-Forward's clip C). The passages are the first --passages of the
corpus's calibration split (`lla.data.load`, seed 0, as the main job cuts them), tokenised
with the model's own tokenizer (GPT-2's from the data directory for a GPT-2-vocabulary
model); a model without a tokenizer is refused. `lla.defenses.scales` computes; --out
writes the JSON.
"""

import json

from absl import flags

from experiments import cli

_MODEL_DIR = flags.DEFINE_string("model_dir", None, "A model directory (HF safetensors or an "
                                 "lla checkpoint).", required=True)
_CUT = flags.DEFINE_integer("cut", None, "The cut k (client blocks 0..k-1).", required=True)
_PASSAGES = flags.DEFINE_integer("passages", 32, "Calibration passages measured.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 32, "Tokens per passage.")
_DATA_DIR = flags.DEFINE_string("data_dir", None, "Data directory (default $LLA_DATA_DIR).")
_OUT = flags.DEFINE_string("out", None, "Also write the figures here as JSON.")


def main(_):
  with cli.one_line_errors(ValueError, prefix="defense_scales"):
    from lla.data import load
    from lla.defenses import scales
    from lla.model import loading
    model = loading.load_model({"hf_dir": _MODEL_DIR.value})
    tokenizer = model.text_tokenizer("no token-file flag here: measure on a model with one")
    splits = load.load_splits(_DATA_DIR.value, seq_len=_SEQ_LEN.value,
                              n_calibration=_PASSAGES.value, n_train=1, n_eval=1,
                              tokenizer=tokenizer)
    figures = scales.summary(model.params, model.cfg, splits.calibration.tokens, _CUT.value)
  print(json.dumps(figures, indent=1))
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(figures, f, indent=1)


if __name__ == "__main__":
  cli.run(main)
