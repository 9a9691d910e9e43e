"""Versioned scoring policies: loaded, validated and identified by sha256.

A policy is fixed before the runs it judges. The scorecard records the hash of
the policy it applied and flags (i) a run that recorded a different policy hash
and (ii) a policy whose `created` date is after the run started: thresholds
chosen after seeing results are not evidence, so such a PASS is withheld.
"""

import dataclasses
import datetime
import json
import os
import re

from lla.evidence import files

POLICY_DIR = os.path.join(os.path.dirname(__file__), "policies")
DEFAULT_POLICY = "scorecard-policy.v3"
# A policy name: a file of POLICY_DIR, never a path.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_REQUIRED = ("policy_id", "created", "threshold_pp", "wilson_z", "min_seeds",
             "seed_fields", "reference_rule", "bootstrap", "primary_test")


@dataclasses.dataclass(frozen=True)
class Policy:
  """A loaded policy; `sha256` is the hash of the file's exact bytes."""
  policy_id: str
  created: datetime.date
  threshold_pp: float
  wilson_z: float
  min_seeds: int
  seed_fields: tuple[str, ...]
  positive_control_pp: float
  implicit_matching: bool
  bootstrap: dict
  primary_test: dict
  raw: dict
  sha256: str
  path: str


def policy_path(name: str) -> str:
  """policies/<name>.json for a policy name; a path (or '..') is refused, so that a name
  read from a capture or a record cannot point outside the policy directory."""
  if not isinstance(name, str) or not _NAME.match(name) or name.endswith(".json") \
      or ".." in name:
    raise ValueError(f"policy name {name!r}: expected a policy name under {POLICY_DIR} "
                     "(letters, digits, '.', '_', '-'), not a path")
  return os.path.join(POLICY_DIR, name + ".json")


def load_named_policy(name: str) -> Policy:
  """Loads the policy called `name` (see `policy_path`); for names taken from data."""
  return load_policy(policy_path(name))


def load_policy(name_or_path: str = DEFAULT_POLICY) -> Policy:
  """Loads `policies/<name>.json` or an explicit `.json` path given by the user,
  validating fields."""
  path = (name_or_path if name_or_path.endswith(".json") else policy_path(name_or_path))
  try:
    with open(path, "rb") as f:
      data = f.read()
  except FileNotFoundError:
    raise FileNotFoundError(f"{path}: policy file not found") from None
  try:
    raw = json.loads(data)
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: policy is not valid JSON ({e})") from None
  missing = [k for k in _REQUIRED if k not in raw]
  if missing:
    raise ValueError(f"{path}: policy lacks fields {missing}")
  try:
    created = datetime.date.fromisoformat(raw["created"])
  except ValueError:
    raise ValueError(f"{path}: created {raw['created']!r} is not YYYY-MM-DD"
                     ) from None
  if not os.path.basename(path).startswith(raw["policy_id"]):
    raise ValueError(f"{path}: file name does not match policy_id "
                     f"{raw['policy_id']!r}")
  if raw["threshold_pp"] <= 0 or raw["wilson_z"] <= 0 or raw["min_seeds"] < 1:
    raise ValueError(f"{path}: threshold_pp, wilson_z and min_seeds must be "
                     "positive")
  rule = raw["reference_rule"]
  return Policy(
      policy_id=raw["policy_id"], created=created,
      threshold_pp=float(raw["threshold_pp"]), wilson_z=float(raw["wilson_z"]),
      min_seeds=int(raw["min_seeds"]), seed_fields=tuple(raw["seed_fields"]),
      positive_control_pp=float(rule["positive_control_pp"]),
      implicit_matching=bool(rule["implicit_matching"]),
      bootstrap=dict(raw["bootstrap"]), primary_test=dict(raw["primary_test"]),
      raw=raw, sha256=files.sha256_bytes(data), path=path)


def recorded_policy_hash(protocol: dict) -> str | None:
  """The policy hash a run recorded in its protocol tuple E.

  Looked up as E["G"]["policy_sha256"] (the controls and decision rules
  component), falling back to a top-level "policy_sha256".
  """
  g = protocol.get("G")
  if isinstance(g, dict) and "policy_sha256" in g:
    return g["policy_sha256"]
  return protocol.get("policy_sha256")


def check(policy: Policy, recorded_hash: str | None,
          run_started: datetime.date | None) -> list[str]:
  """Flags that make the policy's verdicts on this run provisional."""
  flags = []
  if recorded_hash is None:
    flags.append("the run did not record a policy hash")
  elif recorded_hash != policy.sha256:
    flags.append(f"the run recorded policy {recorded_hash[:12]}..., "
                 f"scored with {policy.sha256[:12]}...")
  if run_started is None:
    flags.append("run start date unknown: cannot show the policy predates it")
  elif policy.created > run_started:
    flags.append(f"policy {policy.policy_id} created {policy.created} after "
                 f"the run started {run_started}")
  return flags


def summary(policy: Policy) -> dict:
  """The policy facts a scorecard records (no absolute paths)."""
  return {"policy_id": policy.policy_id, "sha256": policy.sha256,
          "created": policy.created.isoformat(),
          "threshold_pp": policy.threshold_pp, "wilson_z": policy.wilson_z,
          "min_seeds": policy.min_seeds, "seed_fields": list(policy.seed_fields)}
