r"""How many mixed rows `mixup_adaptive` unmixes on a real model's passages, and what it recovers.

The main job's mixup captures come from a model fine-tuned with mixup in the loop; this
binary isolates the attack: the base model's client rows of the evaluation passages at one
cut, mixed as `lla.defenses.SecretMixup` mixes them within capture batches, under explicit
secrets, then `mixup_adaptive` with the attacker holding the same weights ("public"
knowledge). Per secret it prints the rows it unmixed (linked across rows by their first
tokens), the first tokens several documents share, and the token recovery against each
row's own document and against its heaviest partner (the most attribution can give
without the secret partners), and per document (lla.scoring.per_document: each document
against the attack's claim paired with it).

  LLA_DATA_DIR=../shared/data python -m experiments.mixup_linking \
      --config=configs/main_table.py:cpu_smollm2 --docs=48 --secrets=0 --secrets=1 --secrets=2 \
      --out_json=/tmp/mixup_linking.json
"""

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from experiments import cli
from lla import data, defenses, runtime
from lla.attacks import registry
from lla.attacks.workspace import Workspace
from lla.scoring import per_document
from lla.model import gguf_io, split
from lla.model import loading

_CONFIG = config_flags.DEFINE_config_file("config", "configs/main_table.py:cpu_smollm2",
                                          "Main-table config: the model, data and budget.")
_DOCS = flags.DEFINE_integer("docs", 48, "Evaluation passages mixed and attacked.",
                             lower_bound=1)
_CUT = flags.DEFINE_integer("cut", 6, "Client layers k.", lower_bound=1)
_M = flags.DEFINE_integer("m", 2, "Documents per mixed row.", lower_bound=1)
_SECRETS = flags.DEFINE_multi_integer("secrets", [0, 1, 2],
                                      "Explicit secret seeds, one run each.")
_OUT_JSON = flags.DEFINE_string("out_json", "", "Write the figures here as JSON.")


def main(argv):
  del argv
  runtime.configure()
  config = _CONFIG.value
  batch = int(config.capture_batch_size)
  if _M.value > min(batch, _DOCS.value - (_DOCS.value - 1) // batch * batch):
    raise SystemExit(f"error: --m={_M.value}: every capture batch needs at least m documents "
                     f"(--docs={_DOCS.value} in batches of {batch})")
  with cli.one_line_errors(gguf_io.GGUFError, FileNotFoundError, loading.ModelLoadError):
    model = loading.load_model(config.model)
    splits = data.load_splits(**{**config.data.to_dict(), "n_eval": _DOCS.value},
                              tokenizer=model.text_tokenizer("token files, which this "
                                                             "experiment does not take"))
  tokens = np.asarray(splits.evaluation.tokens)
  h = np.concatenate([np.asarray(split.client(model.params, model.cfg,
                                              jnp.asarray(tokens[i:i + batch]), _CUT.value))
                      for i in range(0, len(tokens), batch)])
  batch_docs = np.concatenate([np.full(len(tokens[i:i + batch]), len(tokens[i:i + batch]))
                               for i in range(0, len(tokens), batch)])
  mixup = defenses.make("mixup", m=_M.value)
  budget = config.budget  # the job's (every declared field)
  print(f"revision {registry.get('mixup_adaptive').spec.revision}; {len(tokens)} documents in "
        f"batches of {batch}, k = {_CUT.value}, m = {_M.value}")
  runs = []
  for seed in _SECRETS.value:
    secret = defenses.Secret.explicit(seed)
    mixed, owners = [], []
    for step, start in enumerate(range(0, len(tokens), batch)):
      y, lam, partners = mixup.mix(jnp.asarray(h[start:start + batch]),
                                   secret.keys("mixup", step).step)
      mixed.append(np.asarray(y))
      owners.append(start + np.asarray(partners)[np.arange(len(y)), np.asarray(lam).argmax(1)])
    ws = Workspace(np.concatenate(mixed), None, model.params, model.cfg, _CUT.value,
                   np.asarray(splits.calibration.tokens), batch_docs=batch_docs,
                   defense={"name": "mixup", "params": mixup.params()},
                   known_prefix=tuple(splits.known_prefix))
    start_s = time.time()
    result, _ = registry.execute("mixup_adaptive", ws, budget, jax.random.key(0))
    wall = time.time() - start_s
    scored = slice(len(splits.known_prefix), None)
    own = float(np.mean(result.predictions[:, scored] == tokens[:, scored]))
    heaviest = float(np.mean(result.predictions[:, scored] ==
                             tokens[np.concatenate(owners)][:, scored]))
    counts = per_document.count(result.details, tokens, 0,
                                "after_bos" if splits.known_prefix else "all", "mixup_adaptive")
    by_document = counts.hits / counts.n
    # Revision 1 did not record the splits decided by decoding.
    details = {k: result.details.get(k) for k in (
        "rows_unmixed", "ambiguous_first_tokens", "splits_decided_by_decoding")}
    runs.append({"secret": seed, "own_document": own, "heaviest_partner": heaviest,
                 "per_document": by_document,
                 "exact_documents_per_document": counts.docs_exact / counts.docs,
                 "wall_s": wall, **details})
    print(f"secret {seed}: {details}; tokens of the row's own document {100 * own:.2f}%, "
          f"of its heaviest partner {100 * heaviest:.2f}%, per document "
          f"{100 * by_document:.2f}% ({counts.docs_exact} of {counts.docs} documents "
          f"exact); {wall:.0f} s")
  if _OUT_JSON.value:
    with open(_OUT_JSON.value, "w") as f:
      json.dump({"revision": registry.get("mixup_adaptive").spec.revision, "docs": len(tokens),
                 "cut": _CUT.value, "m": _M.value, "runs": runs}, f, indent=2)
    print(f"wrote {_OUT_JSON.value}")


if __name__ == "__main__":
  app.run(main)
