"""The attack registry: each attack is one module that declares what it needs.

An attack declares the observations (O) and knowledge (K) of the protocol tuple it
requires. `check_compatible` refuses to run it on a capture that lacks them, naming the
missing piece, so adding an attack means writing one module and no driver changes.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib
import importlib.util
import sys
from typing import Any, Callable, Protocol

import jax
import ml_collections
import numpy as np

from lla.attacks import budget as budget_lib

# What crosses a boundary and is stored in a capture (O): a split LLM's per-document messages
# h and g; the decoy-row split's frames (rows of real and decoy documents, permuted) and
# their returned gradient rows, a kind of their own that no generic attack reads.
OBSERVATIONS = ("activations", "gradients", "decoy_forward", "decoy_gradients")
KNOWLEDGE = ("public", "trained", "none")
ROLES = ("attack", "negative_control", "baseline")
TIERS = ("passive", "active")


class IncompatibleCaptureError(ValueError):
  """An attack was asked to run on a capture that lacks an input it declares."""


@dataclasses.dataclass(frozen=True)
class AttackSpec:
  """What an attack is and what it needs.

  Attributes:
    name: registry key, also the predictions' file name.
    family: attack family; a defense's positive control must come from the same family.
    requires: observations it reads (subset of OBSERVATIONS).
    knowledge: knowledge settings it can run under (weights the attacker holds).
    needs_weights: whether it runs the attacker's copy of the model.
    budget_fields: names of the budget fields it reads (lla.attacks.budget); it sees no
      other field.
    scored_positions: "all" or "t>=1".
    role: "attack", "negative_control" or "baseline".
    description: one line for reports.
    reference: where the algorithm is pinned or published.
    defense_aware: fits its decoder on calibration passed through the defense's mechanism
      (with the attacker's own randomness); runs only with such a transform.
    reference_attack: the attack whose undefended run is this one's positive control
      ("" = itself).
    adapts_to: defense mechanisms (lla.defenses names) whose structure it exploits; it
      runs only on captures defended by one of them. Empty: a generic attack, which fits
      every capture that holds what it requires.
    threat_model: what it assumes the attacker knows and may do, in one or two sentences
      (an adaptive attack knows the mechanism's family and public parameters, never a
      secret).
    tier: "passive" (reads the messages) or "active" (the server wrote the messages it
      returned, e.g. crafted gradients).
    capabilities: what it claims to handle; the qualification matrix lists those no
      evidence exercises.
    checks: (kind, test id, what it was checked against) triples: the tests that qualify
      the module itself, kind in lla.scoring.qualification.KINDS ("reference_consistency",
      "adaptation", "real_model", "synthetic"). In the qualification matrix each is the
      test's recorded outcome (lla.study.qualification), `unmeasured` until it ran.
    validate_budget: optional check of relations between its budget fields, called with
      (budget dict, vocabulary size); raises budget.BudgetError naming the fields.
    revision: the algorithm's revision, raised by one with every change that alters its
      predictions on some input (a fix, a changed step). Each record stores the revision
      that made it; a finished record of another revision is never reused in place of a
      run of this one (lla.replay.driver), and regenerating it names the difference.
  """

  name: str
  family: str
  requires: tuple[str, ...]
  knowledge: tuple[str, ...] = ("public", "trained")
  needs_weights: bool = True
  budget_fields: tuple[str, ...] = ()
  scored_positions: str = "all"
  role: str = "attack"
  description: str = ""
  reference: str = "PROTOCOL.md section 4"
  defense_aware: bool = False
  reference_attack: str = ""
  adapts_to: tuple[str, ...] = ()
  threat_model: str = ""
  tier: str = "passive"
  capabilities: tuple[str, ...] = ()
  checks: tuple[tuple[str, str, str], ...] = ()
  validate_budget: Callable[[dict, int], None] | None = dataclasses.field(
      default=None, compare=False)
  revision: int = 1

  def to_dict(self) -> dict[str, Any]:
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
           if f.name != "validate_budget"}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


@dataclasses.dataclass(frozen=True)
class AttackResult:
  """predictions [B, T] int32, the attack's own analytic FLOPs (shared stages add theirs;
  XLA's count comes from the workspace meter) and JSON-ready statistics for its record."""

  predictions: np.ndarray
  flops_analytic: float
  details: dict = dataclasses.field(default_factory=dict)


class Attack(Protocol):
  spec: AttackSpec

  def __call__(self, workspace, budget, key: jax.Array) -> AttackResult:
    ...


_REGISTRY: dict[str, Attack] = {}
# Attack name -> {"module", "sha256"}: the module that registered it (or described it) and
# its code identity when it registered (`code_identity`), the version of the attack's code
# that a study's threat space and each record hold (lla.scoring.threat_space, gates).
_SOURCES: dict[str, dict[str, str | None]] = {}
_FILE_SHA256: dict[str, str | None] = {}
_IDENTITY: dict[str, str | None] = {}


def _file_sha256(path) -> str | None:
  if path not in _FILE_SHA256:
    try:
      with open(path, "rb") as f:
        _FILE_SHA256[path] = hashlib.sha256(f.read()).hexdigest()
    except (OSError, TypeError):
      _FILE_SHA256[path] = None
  return _FILE_SHA256[path]


def _lla_imports(path: str) -> set[str]:
  """The lla modules a source file imports (anywhere in it: a function-level import runs
  with the attack too), as dotted names; `from lla.x import y` names lla.x.y when that is
  a module and lla.x otherwise."""
  try:
    with open(path, "rb") as f:
      tree = ast.parse(f.read(), filename=path)
  except (OSError, SyntaxError, ValueError):
    return set()
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names if a.name.split(".")[0] == "lla")
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
        node.module.split(".")[0] == "lla"):
      out.add(node.module)
      for a in node.names:
        if _module_file(f"{node.module}.{a.name}") is not None:
          out.add(f"{node.module}.{a.name}")
  return out


def _module_file(name: str) -> str | None:
  """The source file of module `name`, without importing it (None: not a module)."""
  try:
    spec = importlib.util.find_spec(name)
  except (ImportError, ValueError, AttributeError):
    return None
  return spec.origin if spec is not None and spec.has_location else None


def code_identity(path: str | None) -> str | None:
  """The sha256 of the code an attack defined in source file `path` runs: the file and
  every lla module it imports, transitively (with each package's __init__ on the way), as
  the sorted lines "<module> <sha256 of its file>". A change to shared code the attack
  runs (a beam search, the workspace) changes it, not only a change to the registering
  file. None without a source file (a module typed into an interpreter)."""
  if path is None or _file_sha256(path) is None:
    return None
  if path not in _IDENTITY:
    seen: dict[str, str] = {}
    todo = sorted(_lla_imports(path))
    while todo:
      name = todo.pop()
      parts = name.split(".")
      for i in range(1, len(parts) + 1):  # a module's packages run their __init__ too
        prefix = ".".join(parts[:i])
        if prefix in seen:
          continue
        origin = _module_file(prefix)
        if origin is None:
          continue
        seen[prefix] = str(_file_sha256(origin))
        todo.extend(sorted(_lla_imports(origin) - set(seen)))
    lines = [f"<attack> {_file_sha256(path)}"] + [f"{n} {h}" for n, h in sorted(seen.items())]
    _IDENTITY[path] = hashlib.sha256("\n".join(lines).encode()).hexdigest()
  return _IDENTITY[path]


def _caller_source(depth: int = 2) -> dict[str, str | None]:
  """The module `depth` frames up (the one calling `register` / `describe`) and its code
  identity (`code_identity`)."""
  caller = sys._getframe(depth).f_globals  # pylint: disable=protected-access
  return {"module": str(caller.get("__name__")),
          "sha256": code_identity(caller.get("__file__"))}


def source(name: str) -> dict[str, str | None] | None:
  """{"module", "sha256"} of the module that registered (or described) attack `name`."""
  return _SOURCES.get(name)


def register(attack: Attack) -> Attack:
  """Adds an attack instance to the registry; checks its declaration first."""
  spec = attack.spec
  name = spec.name
  if name in _REGISTRY:
    raise ValueError(f"attack {name!r} is registered twice")
  problems = []
  if set(spec.requires) - set(OBSERVATIONS):
    problems.append(f"requires unknown observations {sorted(set(spec.requires) - set(OBSERVATIONS))}")
  if set(spec.knowledge) - set(KNOWLEDGE):
    problems.append(f"unknown knowledge {sorted(set(spec.knowledge) - set(KNOWLEDGE))}")
  if spec.role not in ROLES:
    problems.append(f"role {spec.role!r} not in {ROLES}")
  if spec.tier not in TIERS:
    problems.append(f"tier {spec.tier!r} not in {TIERS}")
  if not isinstance(spec.revision, int) or spec.revision < 1:
    problems.append(f"revision {spec.revision!r} is not a positive integer")
  undeclared = [f for f in spec.budget_fields if f not in budget_lib.fields()]
  if undeclared:
    problems.append(f"reads undeclared budget fields {undeclared} (declare them with "
                    "lla.attacks.budget.declare)")
  if problems:
    raise ValueError(f"attack {name!r}: " + "; ".join(problems))
  _REGISTRY[name] = attack
  _SOURCES[name] = _caller_source()
  return attack


def get(name: str) -> Attack:
  load_builtin()
  if name not in _REGISTRY:
    raise KeyError(f"no attack named {name!r}; registered: {', '.join(sorted(_REGISTRY))}")
  return _REGISTRY[name]


def get_unloaded(name: str) -> Attack:
  """An already registered attack, without triggering the built-in imports (for modules
  that derive variants while they are being imported)."""
  return _REGISTRY[name]


def names() -> list[str]:
  load_builtin()
  return sorted(_REGISTRY)


def specs() -> list[AttackSpec]:
  return [get(n).spec for n in names()]


def execute(name: str, ws, budget, key: jax.Array):
  """Runs attack `name` on a workspace, metered: (AttackResult, workspace.Charge).

  `budget` holds at least the fields the attack declares (a dict, ConfigDict or the
  validated budget of a replay); the attack sees only those.
  """
  attack = get(name)
  values = {**budget_lib.defaults(), **budget_lib.as_dict(budget)}
  view = budget_lib.View(values, attack.spec.budget_fields, name)
  with ws.attack_scope(name):
    result = attack(ws, view, key)
    return result, ws.charge(result.flops_analytic)


_EXTERNAL: dict[str, AttackSpec] = {}


def describe(spec: AttackSpec) -> AttackSpec:
  """Lists a module that runs in its own driver (not on a replay Workspace, e.g. the
  decoy-row attacks of lla.decoy, which write their own records): coverage and
  qualification know it; replay, `get` and `names` do not."""
  if spec.name in _REGISTRY or _EXTERNAL.get(spec.name, spec) != spec:
    raise ValueError(f"attack {spec.name!r} is registered twice")
  if spec.name not in _EXTERNAL:
    _SOURCES[spec.name] = _caller_source()
  _EXTERNAL[spec.name] = spec
  return spec


def defense_facts() -> dict[str, str]:
  """Defense name -> what it acts on ("activations", "gradients", "embeddings",
  "training"), for every mechanism registered in this process (lla.defenses and plugins):
  the facts a gate needs to know which defense-aware baselines a defended capture requires."""
  from lla import defenses  # pylint: disable=g-import-not-at-top
  return {n: defenses.get(n).acts_on for n in defenses.names()}


def module_entry(spec: AttackSpec) -> dict[str, Any]:
  """`spec` as the scoring layer's module entry (coverage, gates, qualification), with
  `source`: the module that registered it and its code identity (`code_identity`). A
  defense-aware entry also holds `defenses` (`defense_facts`): it runs only where the
  defense transforms the forward message, and scoring reads which defenses do from the
  study's threat space, never from the live defense registry."""
  entry = {**spec.to_dict(), "observations": list(spec.requires),
           "source": _SOURCES.get(spec.name)}
  if spec.defense_aware:
    entry["defenses"] = defense_facts()
  return entry


def module_entries() -> list[dict[str, Any]]:
  """Every attack module, replayable or run in its own driver, as the scoring layer's
  module entry (coverage, qualification). A study records them as its threat space
  (lla.scoring.threat_space, written by lla.replay.driver.record_threat_space); scoring
  reads them from there, never from here."""
  everything = specs() + [_EXTERNAL[n] for n in sorted(_EXTERNAL)]
  return sorted((module_entry(s) for s in everything), key=lambda m: m["name"])


# Attacks checked on the RoPE decoder families (lla.model.decoder: llama, mistral, qwen2,
# qwen3, gemma) by tests/test_attacks_families.py. Every other attack, a plugin's included,
# runs on GPT-2 only until it is added there: `check_family` refuses it on another family.
ROPE_FAMILIES_VERIFIED = frozenset({
    "ridge", "activation", "activation_flop_matched", "joint", "random_candidates",
    "shuffled_gradients", "gradient_only", "gradient_only_t1", "sipit", "sip", "sip_linear",
    "bisr_f", "bisr_b", "bisr", "eia", "tag", "lamp",
    "gaussian_adaptive", "mixup_adaptive", "nopeek_adaptive", "projection_adaptive",
    "quantize_adaptive", "topk_adaptive", "dp_forward_adaptive", "dx_privacy_adaptive",
    "sanitise_adaptive", "mid_adaptive", "adversarial_adaptive",
    "activation_defense_aware",
    "joint_defense_aware",
    "fsha_decode"})


def supports_family(name: str, family: str) -> bool:
  """Whether attack `name` runs on a model of `family` (a config's `family`)."""
  return family == "gpt2" or name in ROPE_FAMILIES_VERIFIED


def check_family(spec: AttackSpec, cfg) -> None:
  """Raises IncompatibleCaptureError if the attack has not been made to work on the
  attacker's model family yet."""
  family = getattr(cfg, "family", "gpt2")
  if not supports_family(spec.name, family):
    raise IncompatibleCaptureError(f"attack {spec.name} does not support family {family} yet")


def check_compatible(spec: AttackSpec, observed: set[str] | frozenset[str], knowledge: str,
                     capture_name: str = "capture", defense: str = "none") -> None:
  """Raises IncompatibleCaptureError naming what the capture or attacker lacks."""
  missing = [o for o in spec.requires if o not in observed]
  if missing:
    raise IncompatibleCaptureError(
        f"attack {spec.name!r} needs {', '.join(missing)}, which {capture_name} does not hold "
        f"(it holds: {', '.join(sorted(observed)) or 'nothing'})")
  if knowledge not in spec.knowledge:
    raise IncompatibleCaptureError(
        f"attack {spec.name!r} runs under knowledge {spec.knowledge}, not {knowledge!r}")
  if spec.adapts_to and defense not in spec.adapts_to:
    raise IncompatibleCaptureError(
        f"attack {spec.name!r} adapts to {', '.join(spec.adapts_to)}; {capture_name} is "
        f"defended by {defense!r}")


def fits(spec: AttackSpec, observed, knowledge: str, defense: str) -> bool:
  """Whether `spec` fits a capture: the envelope of PROTOCOL section 5a runs over these."""
  try:
    check_compatible(spec, observed, knowledge, defense=defense)
  except IncompatibleCaptureError:
    return False
  return True


BUILTIN_MODULES = (
    "lla.attacks.seed.beam_attacks", "lla.attacks.seed.heuristics",
    "lla.attacks.published.sipit", "lla.attacks.published.sip", "lla.attacks.published.bisr_f",
    "lla.attacks.published.eia", "lla.attacks.published.gradmatch", "lla.attacks.published.lamp",
    "lla.attacks.adaptive.projection_adaptive", "lla.attacks.adaptive.mixup_adaptive",
    "lla.attacks.adaptive.likelihood_beam", "lla.attacks.adaptive.nopeek_adaptive",
    "lla.attacks.adaptive.mid_adaptive", "lla.attacks.adaptive.adversarial_adaptive",
    "lla.attacks.adaptive.sanitise_adaptive",
    "lla.attacks.adaptive.dx_privacy_adaptive",
    "lla.decoy.modules", "lla.active.attack")


def load_builtin() -> None:
  """Imports the built-in attack modules for their registration side effect (lazily, so
  that importing the registry alone compiles nothing)."""
  for module in BUILTIN_MODULES:
    importlib.import_module(module)


class PluginError(ImportError):
  """A plugin module named on the command line that cannot be imported."""


def load_plugins(modules) -> list[str]:
  """Imports user modules that register attacks ("pkg.module" names, or a comma-separated
  string); returns the attack names they added."""
  if isinstance(modules, str):
    modules = [m.strip() for m in modules.split(",") if m.strip()]
  load_builtin()
  before = set(_REGISTRY)
  for module in modules:
    try:
      importlib.import_module(module)
    except Exception as e:  # Any failure inside a user's module is reported the same way.
      raise PluginError(f"plugin {module!r} could not be imported: {type(e).__name__}: {e}") from e
  return sorted(set(_REGISTRY) - before)


def relevant_budget(budget, attacks) -> dict[str, Any]:
  """The fields of `budget` that at least one of `attacks` (names) declares: what a caller
  holding one budget for many attacks passes to a replay of some of them."""
  read = {f for name in attacks for f in get(name).spec.budget_fields}
  return {k: v for k, v in budget_lib.as_dict(budget).items() if k in read}


def budget_config(names=None) -> ml_collections.ConfigDict:
  """A ConfigDict of the declared budget fields' defaults (all of them, or `names`), after
  the built-in attacks have declared theirs."""
  load_builtin()
  chosen = sorted(budget_lib.fields()) if names is None else list(names)
  return ml_collections.ConfigDict({n: budget_lib.get(n).default for n in chosen})
