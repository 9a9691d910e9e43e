"""The seed attacks on a real pre-trained model: capture, replay, score (resumed if done).

  python -m experiments.real_weights --config=configs/real_weights.py --workdir=runs/real_smollm2

Writes WORKDIR/capture and the sealed run WORKDIR/run with its scorecard; prints each
attack's token and exact-document recovery against the frequency baseline of the model's
own tokenizer. lla.study.real_weights says what the cell runs and why.
"""

from absl import flags
from ml_collections import config_flags

from experiments import cli
from lla import runtime
from lla.attacks import budget
from lla.capture import store
from lla.data import paths
from lla.evidence import rundir
from lla.model import gguf_io, loading
from lla.replay import driver as replay
from lla.study import real_weights

_CONFIG = config_flags.DEFINE_config_file("config", "configs/real_weights.py",
                                          "Real-weights config.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (resumed if it exists).",
                               required=True)
_INPUT_ERRORS = (real_weights.RealWeightsError, loading.ModelLoadError,
                 gguf_io.GGUFError, store.CaptureError,
                 replay.ReplayInputError, budget.BudgetError, rundir.RunLockedError,
                 paths.DataNotFoundError)


def main(argv):
  del argv
  runtime.configure()
  with cli.one_line_errors(*_INPUT_ERRORS, workdir=_WORKDIR.value):
    card = real_weights.run(_CONFIG.value, _WORKDIR.value)
  (undefended,) = card["undefended"]  # One capture, no defense: one configuration.
  print(f"{'attack':20s} {'token rec.':>10s} {'exact docs':>10s} {'baseline p0':>11s} "
        f"{'excess pp':>9s}")
  for name, row in undefended["pooled"].items():
    print(f"{name:20s} {100 * row['token_recovery']:9.2f}% "
          f"{100 * row['exact_doc_recovery']:9.2f}% {100 * row['baseline_p0']:10.2f}% "
          f"{row['excess_pp']:9.2f}")
  print(f"scorecard: {_WORKDIR.value}/{real_weights.RUN}/{rundir.SCORECARD_JSON}")

if __name__ == "__main__":
  cli.run(main)
