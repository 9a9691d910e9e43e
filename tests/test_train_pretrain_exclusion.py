"""Pre-training never sees the main job's fine-tuning or evaluation passages (configs `tiny`).

The main job draws its own splits (config.data: 16 calibration, 16 training, 8 evaluation
passages in `tiny`); pre-training must cut out that draw's training passages, not those
of the pre-training config's default draw (128 training passages at other positions).
Checked by searching every training passage, token for token, in the pre-training stream.
"""

import numpy as np

from configs import main_table as main_table_config
from lla import data
from lla.train import pretrain


def _occurs(stream: np.ndarray, passage: np.ndarray) -> bool:
  starts = np.flatnonzero(stream[:len(stream) - len(passage) + 1] == passage[0])
  return any(np.array_equal(stream[s:s + len(passage)], passage) for s in starts)


def test_tiny_pretraining_excludes_the_main_jobs_training_passages(data_dir, monkeypatch):
  monkeypatch.setenv("LLA_DATA_DIR", str(data_dir))
  config = main_table_config.get_config("tiny")
  splits = data.load_splits(**config.data.to_dict())
  assert splits.training.source == "train"
  train_windows, _ = pretrain.load_pretraining_data(config.pretrain, exclude=splits)
  stream = train_windows.reshape(-1)
  assert not any(_occurs(stream, p) for p in splits.training.tokens)
  # The draw that pre-training excludes by default is the main job's own (one ConfigDict).
  default_windows, _ = pretrain.load_pretraining_data(config.pretrain)
  assert np.array_equal(default_windows, train_windows)
  # Control: the same search finds the passages in the unfiltered stream.
  full = data.pretraining_tokens(config.data.data_dir, "train",
                                 cache_dir=config.data.cache_dir)
  assert all(_occurs(full, p) for p in splits.training.tokens)
