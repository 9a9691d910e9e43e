"""The scorecard of a run directory: JSON (schema `lla.scorecard.v1`) + Markdown.

`build(run_dir, ...)` recomputes every number from the predictions and the
ground truth; the JSON is canonical (sorted keys, no timestamps, no absolute
paths), so re-scoring an unchanged run reproduces it byte for byte. The
attack modules come from the study's own threat space file (inputs/threat_space.json,
lla.scoring.threat_space: the registry the study was built with), never from the live
registry: scoring imports nothing from lla.attacks. The tokenizer that text ROUGE-L
decodes with is pinned in the study (inputs/tokenizer.json). The declared inputs that
are not files of the run (the coverage grid, qualification evidence, secondary contrasts)
are embedded under "inputs", with the threat space file's sha256, so `rescore` rebuilds
from the study alone.
"""

import collections
import json
import os

import numpy as np

from lla.evidence import files
from lla.evidence import manifest
from lla.evidence import rundir
from lla.scoring import bootstrap
from lla.scoring import coverage as coverage_lib
from lla.scoring import gates
from lla.scoring import metrics
from lla.scoring import per_document
from lla.scoring import policy as policy_lib
from lla.scoring import qualification as qualification_lib
from lla.scoring import similarity
from lla.scoring import threat_space as threat_space_lib

SCHEMA = "lla.scorecard.v1"
# `modules` of `build`: read them from the study's threat space file.
STUDY = "study"
# The tokenizer text ROUGE-L decodes with, pinned in the study: its definition
# (tokenizers' JSON), whose sha256 is the tokenizer's fingerprint.
TOKENIZER_FILE = f"{rundir.INPUTS}/tokenizer.json"


def score_records(run_dir: str, records, tokenizer=None
                  ) -> tuple[list[gates.Scored], dict, dict]:
  """Counts for every measured record; per-document hits for the bootstrap; the papers'
  similarity metrics (lla.scoring.similarity).

  Returns:
    (scored, per_doc, similar) with per_doc[run_id] = [B] int hits per document and
    similar[run_id] = similarity.Sums.
  Raises:
    ValueError naming the file when a prediction's hash or shape is wrong.
  """
  # Every file of the run that scoring reads (protocol.json, protocols/ which set each
  # capture's observations, inputs/ with the threat space and the tokenizer, predictions/,
  # records/) against the log; the scorecard itself is what scoring writes.
  tampered = [p for p in rundir.check_against_log(run_dir)
              if p.split(":")[0] not in (rundir.SCORECARD_JSON, rundir.SCORECARD_MD)]
  if tampered:
    raise ValueError(f"{run_dir}: " + "; ".join(tampered) + "; run verify")
  truths, scored, per_doc, similar = {}, [], {}, {}
  for r in records:
    if r.status != "ok":
      scored.append(gates.Scored(r, None))
      continue
    pred_path = rundir.resolve(run_dir, r.prediction_file)
    if files.sha256_file(pred_path) != r.prediction_sha256:
      raise ValueError(f"{pred_path}: sha256 differs from record "
                       f"{r.run_id!r}; run verify")
    truth_path = rundir.resolve(run_dir, r.truth_file)
    if truth_path not in truths:
      check_truth(run_dir, r)
      truths[truth_path] = rundir.load_truth(truth_path)
    truth, pred = truths[truth_path], rundir.load_predictions(pred_path)
    if pred.shape != truth.shape:
      raise ValueError(f"{pred_path}: shape {pred.shape} != truth "
                       f"{truth.shape} ({truth_path})")
    scored.append(gates.Scored(r, metrics.count(
        pred, truth, r.baseline_token, r.scored_positions)))
    per_doc[r.run_id] = metrics.per_document_hits(pred, truth,
                                                  r.scored_positions)
    similar[r.run_id] = similarity.document_sums(pred, truth, r.scored_positions,
                                                 tokenizer)
  return scored, per_doc, similar


def per_document_counts(run_dir: str, scored) -> dict:
  """Run id -> the per-document counts (lla.scoring.per_document) of every measured record
  whose attack committed per-document claims; read after `score_records` checked the
  truth and the records against the log."""
  truths, out = {}, {}
  for s in scored:
    r = s.record
    if s.counts is None or per_document.FIELD not in (r.details or {}):
      continue
    path = rundir.resolve(run_dir, r.truth_file)
    if path not in truths:
      truths[path] = rundir.load_truth(path)
    out[r.run_id] = per_document.count(r.details, truths[path], r.baseline_token,
                                       r.scored_positions, f"record {r.run_id!r}")
  return out


def _per_document_section(run_dir, scored, groups, by_document, pol, flags, modules) -> dict:
  """The scorecard's "per_document" entry: each claiming record's per-document metrics,
  and the gate of every defended configuration holding one, with those counts in place
  of the per-row ones (the other attacks' counts unchanged)."""
  swap = lambda ss: [gates.Scored(s.record, by_document.get(s.record.run_id, s.counts))
                     for s in ss]
  everything = swap(scored)
  return {
      "rule": ("each original document against the claim of the attack paired with it: "
               "claims name the rows they were unmixed from, one claim per document, the "
               "pairing with the most correct tokens (lla.scoring.per_document)"),
      "rows": {run_id: metrics.summarize(c, pol.wilson_z)
               for run_id, c in sorted(by_document.items())},
      "gates": [gates.gate(swap(groups[key]), everything, pol, flags, modules,
                           gates.observations(run_dir, groups[key]))
                for key in sorted(groups) if groups[key][0].record.defense != "none" and
                any(s.record.run_id in by_document for s in groups[key])],
  }


def check_truth(run_dir: str, record) -> None:
  """Refuses a truth file that is not the one the (logged) record was made against: its
  capture's manifest must hash to the record's capture_sha256 and list the truth file
  with its bytes' sha256.

  Raises:
    ValueError naming the file.
  """
  capture = rundir.resolve(run_dir, record.capture_dir)
  listed = os.path.join(capture, manifest.MANIFEST_NAME)
  truth = rundir.resolve(run_dir, record.truth_file)
  if not os.path.exists(listed) or files.sha256_file(listed) != record.capture_sha256:
    raise ValueError(f"{listed}: missing or not the capture manifest record "
                     f"{record.run_id!r} names (capture_sha256); run verify --check_capture")
  rel = os.path.relpath(truth, capture).replace(os.sep, "/")
  expected = manifest.read_manifest(listed)[0].get(rel)
  if expected is None or not os.path.exists(truth) or files.sha256_file(truth) != expected:
    raise ValueError(f"{truth}: truth file missing, unlisted or changed since its capture's "
                     "manifest was written; run verify --check_capture")


def stale(run_dir: str, card: dict) -> list[str]:
  """What the study holds that scorecard `card` (the study's scorecard.json) does not
  reflect: the files of predictions/ and records/ written or removed since it was logged
  (a later replay's), and the threat space when it was rewritten since."""
  out = rundir.written_since(run_dir, rundir.SCORECARD_JSON)
  recorded = (card.get("inputs") or {}).get("modules_file")
  if recorded is not None:
    now = threat_space_lib.read(run_dir)
    if recorded["sha256"] != (now.sha256 if now else None):
      out.insert(0, threat_space_lib.FILE)
  return out


def stale_line(run_dir: str, changed: list[str]) -> str:
  """One line saying that the scorecard is stale and how to rebuild it."""
  return (f"{run_dir}/{rundir.SCORECARD_JSON} is stale: {len(changed)} file(s) of the study "
          f"written since it ({', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''}); "
          f"rebuild it with python -m experiments.rescore --workdir={run_dir}")


def difference_matrix(scored, per_doc, treatment: str, control: str, cut: int,
                      knowledge: str, corpus: str) -> tuple[np.ndarray, float]:
  """D [M, N] integer hit differences and the scale to percentage points.

  Rows are models (model_seed), columns documents; an entry sums
  treatment - control hits over the attack seeds run for both on that model.
  Every model needs the same number of paired seeds, so the scale
  100 / (seeds * scored positions) turns the mean of D into pp.
  """
  rows = collections.defaultdict(dict)
  positions = set()
  for s in scored:
    r = s.record
    if (s.counts is None or r.defense != "none" or r.cut != cut or
        r.knowledge != knowledge or r.corpus != corpus or
        r.scored_positions == "t>=1" or r.attack not in (treatment, control)):
      continue
    key = (r.attack, r.seed)
    if key in rows[r.model_seed]:
      raise ValueError(f"two records for {r.attack} seed {r.seed} on model "
                       f"seed {r.model_seed}: {r.run_id}")
    rows[r.model_seed][key] = per_doc[r.run_id]
    positions.add(s.counts.n // s.counts.docs)
  mats, n_pairs = [], set()
  for model in sorted(rows):
    seeds = sorted({sd for a, sd in rows[model] if a == treatment} &
                   {sd for a, sd in rows[model] if a == control})
    if not seeds:
      raise ValueError(f"model seed {model}: no attack seed has both "
                       f"{treatment} and {control}")
    n_pairs.add(len(seeds))
    mats.append(sum(rows[model][(treatment, sd)] - rows[model][(control, sd)]
                    for sd in seeds))
  if not mats:
    raise ValueError(f"no measured {treatment}/{control} records at cut {cut}, "
                     f"{knowledge}, {corpus}")
  if len(n_pairs) != 1 or len(positions) != 1:
    raise ValueError(f"models have unequal paired seeds {sorted(n_pairs)} or "
                     f"positions {sorted(positions)}")
  if len({m.shape for m in mats}) != 1:
    raise ValueError("models were evaluated on different document counts")
  return np.stack(mats).astype(np.float64), 100.0 / (
      n_pairs.pop() * positions.pop())


def _contrasts(scored, per_doc, pol, secondary) -> dict:
  test = bootstrap.PrimaryTest.from_policy(pol.primary_test,
                                           pol.bootstrap["confidence"])
  reps, seed = pol.bootstrap["replicates"], pol.bootstrap["seed"]
  corpora = sorted({s.record.corpus for s in scored if s.counts is not None and
                    s.record.cut == test.cut and
                    s.record.knowledge == test.knowledge and
                    s.record.attack in (test.treatment, test.control)})
  primary, secondaries = [], []
  for corpus in corpora:
    try:
      d, scale = difference_matrix(scored, per_doc, test.treatment,
                                   test.control, test.cut, test.knowledge,
                                   corpus)
    except ValueError as e:
      primary.append({"corpus": corpus, "evaluated": False, "reason": str(e)})
      continue
    res = bootstrap.evaluate_primary(test, d, reps, seed, scale)
    primary.append(dict(res, corpus=corpus, evaluated=True,
                        models=d.shape[0], documents=d.shape[1]))
    mats, skipped = {}, []
    for t, c in secondary:
      try:
        mats[f"{t}-{c}"] = difference_matrix(scored, per_doc, t, c, test.cut,
                                             test.knowledge, corpus)
      except ValueError as e:
        skipped.append({"contrast": f"{t}-{c}", "reason": str(e)})
    level = 1 - (1 - test.confidence) / max(len(secondary), 1)
    for name, (dm, sc) in sorted(mats.items()):
      secondaries.append(dict(bootstrap.interval(dm, level, reps, seed, sc),
                              contrast=name, corpus=corpus,
                              bonferroni_k=len(secondary)))
    secondaries += [dict(s, corpus=corpus, evaluated=False) for s in skipped]
  if not corpora:
    primary.append({"evaluated": False, "reason":
                    f"no measured {test.treatment}/{test.control} records at "
                    f"cut {test.cut}, {test.knowledge} knowledge"})
  return {"test": dict(vars(test)), "primary": primary,
          "secondary": secondaries}


def build(run_dir: str, policy: policy_lib.Policy | None = None,
          threat_space: coverage_lib.ThreatSpace | None = None,
          modules: list[dict] | str | None = STUDY,
          qualification_evidence: list[dict] | None = None,
          secondary: list[tuple[str, str]] = (),
          contrasts: bool = True, tokenizer=None,
          text_unavailable: str | None = None) -> dict:
  """Scores a run directory. This is the function the main job calls.

  Args:
    run_dir: a run directory (docs/run_format.md) with protocol.json,
      records/, predictions/ and a log.
    policy: the policy to apply (default scorecard-policy.v3).
    threat_space: the declared threat space for the coverage report.
    modules: STUDY (the default): the module entries of the study's threat space file
      (lla.scoring.threat_space; none if the run records none, which withholds every
      PASS); or entries given here {"name", "family", "observations", "capabilities"}
      (synthetic runs, tests, `rescore --against=current`), embedded in "inputs"; None:
      no modules. For coverage, gates and qualification.
    qualification_evidence: see `qualification.matrix`.
    secondary: (treatment, control) secondary contrasts, Bonferroni-corrected.
    contrasts: False skips the bootstrap (gates only; recorded in "inputs").
    tokenizer: the tokenizer (lla.data.tokenizer) text ROUGE-L decodes with; None
      leaves that metric out, and the scorecard says so.
    text_unavailable: why text metrics are unavailable (with tokenizer None), said in the
      scorecard's note and kept in its inputs, so that a rebuild says it again.
  Returns:
    The scorecard as a JSON-ready dict (schema lla.scorecard.v1).
  """
  pol = policy or policy_lib.load_policy()
  protocol = files.read_json(os.path.join(run_dir, rundir.PROTOCOL))
  records = rundir.load_records(run_dir)
  scored, per_doc, similar = score_records(run_dir, records, tokenizer)
  modules_file = None
  if isinstance(modules, str):
    if modules != STUDY:
      raise ValueError(f"modules must be a list of entries, None or {STUDY!r}, got "
                       f"{modules!r}")
    recorded = threat_space_lib.read(run_dir)
    modules = recorded.modules if recorded else None
    modules_file = {"file": threat_space_lib.FILE,
                    "sha256": recorded.sha256 if recorded else None}
  flags = policy_lib.check(pol, policy_lib.recorded_policy_hash(protocol),
                           rundir.run_started(run_dir))
  rows = []
  for s in scored:
    r = s.record
    row = {k: getattr(r, k) for k in (
        "run_id", "attack", "family", "status", "error", "defense", "cut",
        "knowledge", "corpus", "model_seed", "seed", "scored_positions",
        "flops", "flops_source", "wall_s")}
    row["metrics"] = metrics.summarize(s.counts, pol.wilson_z) if s.counts else None
    row["similarity"] = similar[r.run_id].means() if s.counts else None
    rows.append(row)
  groups = collections.defaultdict(list)
  for s in scored:
    groups[gates.config_key(s.record)].append(s)
  configs, gate_list = [], []
  for key in sorted(groups):
    g = groups[key]
    if g[0].record.defense == "none":
      measured = [s for s in g if s.counts is not None]
      pooled = gates.pool(measured, pol.wilson_z)
      configs.append({"config": {f: getattr(g[0].record, f)
                                 for f in gates.CONFIG_FIELDS},
                      "pooled": pooled,
                      "similarity": _pooled_similarity(measured, similar),
                      "envelope": metrics.envelope(pooled) if pooled else None,
                      "unmeasured": sorted(s.record.run_id for s in g
                                           if s.counts is None)})
    else:
      gate_list.append(gates.gate(g, scored, pol, flags, modules,
                                  gates.observations(run_dir, g)))
  by_document = per_document_counts(run_dir, scored)
  known = [r for r in (s.record for s in scored) if r.flops is not None]
  cov = (coverage_lib.report(records, threat_space, modules or [],
                             pol.seed_fields, pol.min_seeds)
         if threat_space else None)
  return {
      "schema": SCHEMA,
      "e_hash": rundir.e_hash(protocol),
      "policy": dict(policy_lib.summary(pol), flags=flags),
      "unmeasured_share": cov["unmeasured_share"] if cov else None,
      "coverage": cov,
      "rows": rows,
      "undefended": configs,
      "gates": gate_list,
      "contrasts": (_contrasts(scored, per_doc, pol, list(secondary))
                    if contrasts else None),
      # Only where an attack made per-document claims: earlier scorecards rebuild byte for
      # byte.
      **({"per_document": _per_document_section(run_dir, scored, groups, by_document, pol,
                                                flags, modules)} if by_document else {}),
      "cost": {"flops_total": sum(r.flops for r in known),
               "flops_unknown": sorted(r.run_id for r in records
                                       if r.flops is None),
               "wall_s_total": sum(r.wall_s or 0.0 for r in records)},
      # The wording predates other models' tokenizers; kept, as sealed scorecards carry it
      # and rescore reproduces them byte for byte.
      "similarity_note": (None if tokenizer is not None else text_unavailable or
                          "rouge_l_text not computed: no GPT-2 tokenizer was given"),
      "qualification": (qualification_lib.matrix(
          modules or [], qualification_evidence or [])
                        if qualification_evidence is not None else None),
      "inputs": {
          "threat_space": _space_json(threat_space),
          "modules": modules,
          "qualification_evidence": qualification_evidence,
          "modules_file": modules_file,
          "secondary": [list(p) for p in secondary],
          "contrasts": contrasts,
          "tokenizer_sha256": None if tokenizer is None else tokenizer.sha256,
          # Only where said: scorecards from before the field rebuild byte for byte.
          **({"text_unavailable": text_unavailable}
             if tokenizer is None and text_unavailable else {}),
      },
  }


def _pooled_similarity(measured, similar) -> dict:
  """Attack key -> similarity means over every document of its measured records."""
  sums = {}
  for s in measured:
    key = gates.attack_key(s.record)
    sums[key] = sums[key] + similar[s.record.run_id] if key in sums else similar[s.record.run_id]
  return {k: v.means() for k, v in sorted(sums.items())}


def _space_json(space):
  if space is None:
    return None
  return {"families": list(space.families),
          "observations": list(space.observations),
          "knowledge": list(space.knowledge), "defenses": list(space.defenses),
          "out_of_scope": list(space.out_of_scope),
          "declared_unmeasured": [list(x) for x in space.declared_unmeasured]}


def space_from_json(d: dict | None) -> coverage_lib.ThreatSpace | None:
  if d is None:
    return None
  return coverage_lib.ThreatSpace(
      tuple(d["families"]), tuple(d["observations"]), tuple(d["knowledge"]),
      tuple(d["defenses"]), tuple(d["out_of_scope"]),
      tuple(tuple(x) for x in d["declared_unmeasured"]))


def pinned_tokenizer(run_dir: str):
  """The tokenizer pinned in the study (TOKENIZER_FILE), checked against its own hash, or
  None if the study pins none."""
  path = os.path.join(run_dir, TOKENIZER_FILE)
  if not os.path.exists(path):
    return None
  from lla.data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  with open(path, "rb") as f:
    data = f.read()
  try:
    tokenizer = tokenizer_lib.from_definition(data.decode("utf-8"), TOKENIZER_FILE)
  except Exception as e:  # tokenizers raises its own exception types.
    raise ValueError(f"{path}: not a readable tokenizer definition ({e})") from None
  if tokenizer.sha256 != files.sha256_bytes(data):
    raise ValueError(f"{path}: its sha256 is not the fingerprint of the tokenizer it defines")
  return tokenizer


def pin_tokenizer(run_dir: str, tokenizer) -> None:
  """Writes `tokenizer`'s definition into the study (logged) unless it pins it already.

  Raises:
    ValueError: the study pins another tokenizer.
  """
  path = os.path.join(run_dir, TOKENIZER_FILE)
  if os.path.exists(path):
    logged = rundir.logged_files(run_dir).get(TOKENIZER_FILE)
    if logged is not None and logged[0] != tokenizer.sha256:
      raise ValueError(f"{path}: the study pins another tokenizer ({logged[0][:12]}...) than "
                       f"{tokenizer.source} ({tokenizer.sha256[:12]}...)")
    if logged is not None and files.sha256_file(path) == tokenizer.sha256:
      return
    # Written but never logged (a writer stopped between the two): written again, logged.
    # Changed after it was logged: refused (as scoring and verify refuse it).
    if logged is not None:
      raise ValueError(f"{path}: differs from the sha256 the log recorded; run verify")
  from lla.data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  data = tokenizer_lib.definition(tokenizer).encode("utf-8")
  if files.sha256_bytes(data) != tokenizer.sha256:
    raise ValueError(f"tokenizer {tokenizer.source}: its definition does not hash to its "
                     "fingerprint")
  rundir.save_file(run_dir, TOKENIZER_FILE, data, "input_file", overwrite=True)


def tokenizer_for(run_dir: str, sha256: str | None):
  """The tokenizer a scorecard was built with, checked by hash: the one pinned in the
  study; for a study that pins none (made before studies pinned theirs), the GPT-2
  tokenizer of $LLA_DATA_DIR."""
  if sha256 is None:
    return None
  tokenizer = pinned_tokenizer(run_dir)
  where = TOKENIZER_FILE
  if tokenizer is None:
    from lla.data.tokenizer import load_tokenizer  # pylint: disable=g-import-not-at-top
    tokenizer, where = load_tokenizer(), "the tokenizer found"
  if tokenizer.sha256 != sha256:
    raise ValueError(f"{where} ({tokenizer.sha256[:12]}...) is not the tokenizer the "
                     f"scorecard was built with ({sha256[:12]}...)")
  return tokenizer


def build_from_inputs(run_dir: str, inputs: dict,
                      policy: policy_lib.Policy | None = None,
                      refresh: bool = False) -> dict:
  """Rebuilds a scorecard from the "inputs" section of an earlier one.

  A scorecard whose modules came from the study's threat space file reads that file
  again: it must be the file the scorecard was built from (its sha256), unless `refresh`
  (the study was extended since: rebuild with what it holds now).

  Raises:
    ValueError: the threat space file changed since (without `refresh`).
  """
  modules_file = inputs.get("modules_file")
  modules = STUDY if modules_file is not None else inputs.get("modules")
  card = build(run_dir, policy, space_from_json(inputs.get("threat_space")),
               modules, inputs.get("qualification_evidence"),
               [tuple(p) for p in inputs.get("secondary", [])],
               inputs.get("contrasts", True),
               tokenizer_for(run_dir, inputs.get("tokenizer_sha256")),
               inputs.get("text_unavailable"))
  now = card["inputs"]["modules_file"]
  if modules_file is not None and not refresh and now != modules_file:
    raise ValueError(f"{threat_space_lib.FILE}: not the threat space the scorecard was "
                     f"built from (sha256 {str(now['sha256'])[:12]}... != "
                     f"{str(modules_file['sha256'])[:12]}...); the study was extended since: "
                     "rescore it")
  return card


def to_bytes(card: dict) -> bytes:
  return files.canonical_json(card)


def write(run_dir: str, card: dict, overwrite: bool = False) -> None:
  """Writes scorecard.json and scorecard.md atomically, each logged with its sha256."""
  rundir.save_file(run_dir, rundir.SCORECARD_JSON, to_bytes(card), "scorecard", overwrite)
  rundir.save_file(run_dir, rundir.SCORECARD_MD, markdown(card).encode("utf-8"), "scorecard",
                   overwrite)


def diff(a, b, path: str = "") -> list[str]:
  """JSON paths where two scorecards differ (first 50)."""
  out = []
  if isinstance(a, dict) and isinstance(b, dict):
    for k in sorted(set(a) | set(b)):
      if k not in a or k not in b:
        out.append(f"{path}/{k}: only in {'new' if k in b else 'old'}")
      else:
        out += diff(a[k], b[k], f"{path}/{k}")
  elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
    for i, (x, y) in enumerate(zip(a, b)):
      out += diff(x, y, f"{path}/{i}")
  elif a != b:
    out.append(f"{path or '/'}: {a!r} != {b!r}"[:300])
  return out[:50]


def _pct(x):
  return "n/a" if x is None else f"{100 * x:.2f}%"


def _pp(x):
  return "n/a" if x is None else f"{x:+.3f}"


def _per_document_markdown(card: dict) -> list[str]:
  """The per-document section: each claiming record's per-row and per-document figures,
  and each defended configuration's verdict under both."""
  section = card.get("per_document")
  if not section:
    return []
  rows = {r["run_id"]: r["metrics"] for r in card["rows"]}
  out = ["", "## Mixed rows scored per document", "",
         f"Rule: {section['rule']}. The gates above score per row (the row's own "
         "document); docs/attacks.md says why.", "",
         "| run | per row: token rec. | exact doc | excess pp | per document: token rec. "
         "| exact doc | excess pp |", "|---" * 7 + "|"]
  for run_id, m in section["rows"].items():
    r = rows[run_id]
    out.append(f"| {run_id} | {_pct(r['token_recovery'])} | "
               f"{_pct(r['exact_doc_recovery'])} | {_pp(r['excess_pp'])} | "
               f"{_pct(m['token_recovery'])} | {_pct(m['exact_doc_recovery'])} | "
               f"{_pp(m['excess_pp'])} |")
  per_row = {json.dumps(g["config"], sort_keys=True): g for g in card["gates"]}
  out += ["", "| defense | cut | knowledge | corpus | per row: decision | envelope pp (set by) "
          "| per document: decision | envelope pp (set by) |", "|---" * 8 + "|"]
  for g in section["gates"]:
    c, row = g["config"], per_row[json.dumps(g["config"], sort_keys=True)]
    params = f" {c['defense_params']}" if c["defense_params"] else ""
    out.append(f"| {c['defense']}{params} | {c['cut']} | {c['knowledge']} | {c['corpus']} | "
               + " | ".join(f"**{x['decision']}** | {_pp((x['envelope'] or {}).get('envelope_pp'))}"
                            f" ({(x['envelope'] or {}).get('argmax', '-')})" for x in (row, g))
               + " |")
  return out


def markdown(card: dict) -> str:
  """Human-readable rendering of a scorecard dict (derived from the JSON)."""
  pol, cov = card["policy"], card["coverage"]
  out = [f"# Scorecard `{card['e_hash'][:16]}`", ""]
  if cov:
    c = cov["counts"]
    out.append(f"**Unmeasured share of the declared threat space: "
               f"{c['unmeasured']}/{cov['in_scope']} in-scope cells "
               f"({100 * cov['unmeasured_share']:.1f}%)**; partial "
               f"{c['partial']}, covered {c['covered']}, out of scope "
               f"{c['out of scope']}; plus {len(cov['declared_unmeasured'])} "
               "declared-unmeasured threat classes"
               + (f"; **{len(cov['unplaced'])} record(s) placed in no cell** (listed "
                  "under Coverage)." if cov["unplaced"] else "."))
  else:
    out.append("**Unmeasured share: no threat space declared.**")
  out += ["", f"Policy `{pol['policy_id']}` sha256 `{pol['sha256'][:16]}...`, "
          f"threshold {pol['threshold_pp']} pp, z = {pol['wilson_z']}, "
          f"min seeds {pol['min_seeds']} ({', '.join(pol['seed_fields'])})."]
  out += [f"- FLAG: {f}" for f in pol["flags"]]
  modules_file = (card.get("inputs") or {}).get("modules_file")
  if modules_file is not None:
    out += ["", (f"Attack modules: the {len(card['inputs']['modules'])} of the study's threat "
                 f"space `{modules_file['file']}` (sha256 `{modules_file['sha256'][:16]}...`)."
                 if modules_file["sha256"] else
                 f"Attack modules: none (the study records no threat space "
                 f"`{modules_file['file']}`).")]
  out += ["", "## Gates", "", "| defense | cut | knowledge | corpus | decision "
          "| envelope pp | floor pp | seeds | reasons |", "|---" * 9 + "|"]
  for g in card["gates"]:
    c, e = g["config"], g["envelope"] or {}
    params = f" {c['defense_params']}" if c["defense_params"] else ""
    out.append(f"| {c['defense']}{params} | {c['cut']} | "
               f"{c['knowledge']} | {c['corpus']} | **{g['decision']}** | "
               f"{_pp(e.get('envelope_pp'))} | {_pp(e.get('floor_pp'))} | "
               f"{g['n_seeds']} | {'; '.join(g['reasons'])} |")
  for g in card["gates"]:
    c = g["config"]
    out += ["", f"### {c['defense']} (cut {c['cut']}, {c['knowledge']}, "
            f"{c['corpus']})", "", f"Sensitivity: {g['sensitivity']['line']}.",
            "Per-seed envelopes: " + ", ".join(
                f"{p['seed']}: {p['envelope_pp']:+.3f} pp"
                for p in g["per_seed"])]
    for l in g["links"]:
      out.append(f"- {l['run_id']}: {l['kind']} -> "
                 f"{', '.join(l['references']) or 'none'}"
                 + (f" ({'; '.join(l['problems'])})" if l["problems"] else ""))
    for fam, pc in g["positive_controls"].items():
      out.append(f"- positive control {fam}: max excess "
                 f"{_pp(pc['max_excess_pp'])} pp, {'ok' if pc['ok'] else 'missing'}")
  out += ["", "## Attacks", "", "| run | status | defense | positions | token "
          "rec. | exact doc | baseline p0 | n | U (Wilson) | excess pp | "
          "floor pp | ROUGE-L tokens | ROUGE-L text | token-set F1 | FLOPs | wall s |",
          "|---" * 16 + "|"]
  if card.get("similarity_note"):
    out += ["", f"Note: {card['similarity_note']}.", ""]
  for r in card["rows"]:
    m, sim = r["metrics"], r.get("similarity") or {}
    if m is None:
      cells = ["unmeasured: " + str(r["error"])] + ["-"] * 9
    else:
      cells = [_pct(m["token_recovery"]), _pct(m["exact_doc_recovery"]),
               _pct(m["baseline_p0"]), str(m["n"]), _pct(m["wilson_upper"]),
               _pp(m["excess_pp"]), _pp(m["floor_pp"])] + [
                   _pct(sim.get(k)) for k in similarity.NAMES]
    flops = "n/a" if r["flops"] is None else f"{r['flops']:.3g} ({r['flops_source']})"
    wall = "n/a" if r["wall_s"] is None else f"{r['wall_s']:.1f}"
    out.append(f"| {r['run_id']} | {r['status']} | {r['defense']} | "
               f"{r['scored_positions']} | " + " | ".join(cells) +
               f" | {flops} | {wall} |")
  out += _per_document_markdown(card)
  out += ["", "## Undefended envelopes", ""]
  for u in card["undefended"]:
    c, e = u["config"], u["envelope"]
    env = (f"{e['envelope_pp']:+.3f} pp ({e['argmax']}), floor "
           f"{e['floor_pp']:+.3f} pp" if e else "no measured attack")
    out.append(f"- cut {c['cut']}, {c['knowledge']}, {c['corpus']}: {env}")
  ct = card["contrasts"] or {"primary": [], "secondary": []}
  out += ["", "## Bootstrap contrasts", ""]
  if card["contrasts"] is None:
    out.append("- not computed for this scorecard")
  for p in ct["primary"] + ct["secondary"]:
    name = p.get("name") or p.get("contrast")
    if p.get("evaluated", True):
      out.append(f"- {name} ({p['corpus']}): {p['estimate']:+.3f} pp, "
                 f"{100 * p['confidence']:.2f}% CI [{p['lo']:+.3f}, "
                 f"{p['hi']:+.3f}]" + (f", passed={p['passed']}"
                                       if "passed" in p else ""))
    else:
      out.append(f"- {name or 'primary'}: not evaluated ({p['reason']})")
  cost = card["cost"]
  out += ["", f"Total FLOPs {cost['flops_total']:.3g} (unknown for "
          f"{len(cost['flops_unknown'])} runs), wall time "
          f"{cost['wall_s_total']:.1f} s."]
  if cov:
    out += ["", "## Coverage"]
    # Each tier on its own (cards scored before tiers existed are all passive).
    for tier in sorted({c.get("tier", "passive") for c in cov["cells"]}, reverse=True):
      cells = [c for c in cov["cells"] if c.get("tier", "passive") == tier]
      n = {s: sum(c["status"] == s for c in cells)
           for s in ("covered", "partial", "unmeasured", "out of scope")}
      out += ["", f"### {tier.capitalize()} tier: covered {n['covered']}, partial "
              f"{n['partial']}, unmeasured {n['unmeasured']}, out of scope "
              f"{n['out of scope']}", "", "| family | observation | knowledge | "
              "defense | status | reason |", "|---" * 6 + "|"]
      out += [f"| {c['family']} | {c['observation']} | {c['knowledge']} | "
              f"{c['defense']} | {c['status']} | {c['reason']} |" for c in cells]
    out += ["", "Declared unmeasured: " + "; ".join(
        d["class"] for d in cov["declared_unmeasured"])]
    if cov["unplaced"]:
      out += ["", "Unplaced records (they ran, but no cell of the declared threat space "
              "holds them; they count toward no cell):", ""]
      out += [f"- {u['run_id']}: {u['reason']}" for u in cov["unplaced"]]
  if card["qualification"] is not None:
    out += ["", "## Qualification (separate from attack results)", "",
            "| module | tier | " + " | ".join(qualification_lib.KINDS) +
            " | untested |", "|---" * (len(qualification_lib.KINDS) + 3) + "|"]
    # Passive modules first, then the active tier's.
    for name, q in sorted(card["qualification"].items(),
                          key=lambda kv: (kv[1].get("tier", "passive") != "passive", kv[0])):
      out.append(f"| {name} | {q.get('tier', 'passive')} | " + " | ".join(
          qualification_lib.cell_text(q[k]) for k in qualification_lib.KINDS) +
                 f" | {', '.join(q['untested_capabilities']) or '-'} |")
  return "\n".join(out) + "\n"


def threat_space_from_config(cfg) -> coverage_lib.ThreatSpace:
  """ThreatSpace from a configs/scoring.py `threat_space` ConfigDict."""
  t = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
  return coverage_lib.ThreatSpace(
      tuple(t["families"]), tuple(t["observations"]), tuple(t["knowledge"]),
      tuple(t["defenses"]), tuple(dict(r) for r in t["out_of_scope"]),
      tuple(tuple(x) for x in t["declared_unmeasured"]))


# Why a study scored from its files alone has no text metrics.
NO_PINNED_TOKENIZER = ("rouge_l_text unavailable: the study pins no tokenizer "
                       f"({TOKENIZER_FILE}); token metrics are complete, text metrics need "
                       "the tokenizer of the study's model pinned by whoever made it")


def score_run(run_dir: str, cfg, modules: list[dict] | str | None = STUDY,
              qualification_evidence: list[dict] | None = None,
              overwrite: bool = False, study_alone: bool = False) -> dict:
  """Builds and writes scorecard.json / scorecard.md for a finished run.

  The main job calls this after the last record, then `rundir.finalize`.

  Args:
    run_dir: the run directory.
    cfg: configs/scoring.py config (policy, threat_space, secondary).
    modules: STUDY (the default): the study's threat space file (recorded by whoever
      built the study: lla.replay.driver.record_threat_space); or entries given here, as
      in `build`.
    qualification_evidence: see `qualification.matrix`.
    overwrite: replace an existing scorecard (otherwise FileExistsError).
    study_alone: score from the study's files alone (`rescore`): a study that pins no
      tokenizer gets no text metrics, marked unavailable with the reason
      (NO_PINNED_TOKENIZER), never GPT-2's tokenizer from $LLA_DATA_DIR, which may not be
      the study's model's and needs a directory outside the study.
  """
  tokenizer = text_unavailable = None
  if cfg.text_rouge:
    # The study's own tokenizer (a model with its own pins it before scoring); otherwise
    # the main job's first scoring pins the GPT-2 tokenizer of $LLA_DATA_DIR (the models it
    # trains are GPT-2's), so that every rescore after it needs nothing outside the study.
    tokenizer = pinned_tokenizer(run_dir)
    if tokenizer is None and study_alone:
      text_unavailable = NO_PINNED_TOKENIZER
    else:
      if tokenizer is None:
        from lla.data.tokenizer import load_tokenizer  # pylint: disable=g-import-not-at-top
        tokenizer = load_tokenizer()
      pin_tokenizer(run_dir, tokenizer)
  card = build(run_dir, policy_lib.load_policy(cfg.policy),
               threat_space_from_config(cfg.threat_space), modules,
               qualification_evidence, [tuple(p) for p in cfg.secondary],
               tokenizer=tokenizer, text_unavailable=text_unavailable)
  write(run_dir, card, overwrite)
  return card
