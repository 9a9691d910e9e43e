"""The bridge table: finished main jobs of several models side by side (lla.study.bridge).

  python -m experiments.bridge --workdirs=runs/main,runs/main_llama,runs/main_smollm2 \
      --out=runs/bridge

Each workdir's study is verified before it is read. Prints the markdown table and the
conclusions (whether each holds on every model) and writes them to OUT/bridge.md and
OUT/bridge.json.
"""

import json
import os

from absl import flags

from experiments import cli
from lla.study import bridge

_WORKDIRS = flags.DEFINE_list("workdirs", None, "Main-job workdirs, one column each.",
                              required=True)
_OUT = flags.DEFINE_string("out", "", "Directory for bridge.md and bridge.json (empty: print only).")


def main(argv):
  del argv
  with cli.one_line_errors(bridge.BridgeError):
    columns = [bridge.read(workdir) for workdir in _WORKDIRS.value]
  text = "\n".join(bridge.markdown(columns)) + "\n"
  print(text, end="")
  if _OUT.value:
    os.makedirs(_OUT.value, exist_ok=True)
    with open(os.path.join(_OUT.value, "bridge.md"), "w") as f:
      f.write(text)
    with open(os.path.join(_OUT.value, "bridge.json"), "w") as f:
      json.dump(bridge.to_json(columns), f, indent=1, sort_keys=True)


if __name__ == "__main__":
  cli.run(main)
