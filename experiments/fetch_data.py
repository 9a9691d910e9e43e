r"""Downloads WikiText-2 and GPT-2's tokenizer files into a data directory, verified.

  python -m experiments.fetch_data [--out DIR]

DIR defaults to $LLA_DATA_DIR if set, else ./data. Files come from the Hugging Face hub at
pinned commits (lla/data/fetch.py; $HF_ENDPOINT names another hub) and are checked against
recorded sums; files already there that verify are kept, so on a directory that holds a
recognised copy (e.g. a read-only ../shared/data) it downloads nothing and says which copy
it is. Any failure is one line and a non-zero exit. Then run lla with LLA_DATA_DIR=DIR.
"""

import os

from absl import app
from absl import flags
from absl import logging
from huggingface_hub.utils import logging as hub_logging

from experiments import cli
from lla.data import fetch
from lla.data import paths

_OUT = flags.DEFINE_string("out", None, f"Data directory to fill; default ${paths.ENV_VAR} if set, "
                           "else ./data.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  out = _OUT.value or os.environ.get(paths.ENV_VAR) or "data"
  # absl shows INFO records of every library, the hub client logs each HTTP request and
  # each retry on its own handler too: this binary says what it did itself, one line per
  # file, and keeps stderr for its one-line error.
  logging.set_verbosity(logging.WARNING)
  hub_logging.set_verbosity_error()
  with cli.one_line_errors(fetch.FetchError):
    result = fetch.fetch(out, log=print)
  print(f"{result.out}: the {result.copy} copy of WikiText-2 and GPT-2's tokenizer, every file "
        f"verified ({len(result.downloaded)} downloaded, {len(result.kept)} already there). "
        f"Use it with {paths.ENV_VAR}={result.out.resolve()}")


if __name__ == "__main__":
  app.run(main)
