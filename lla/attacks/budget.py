"""Budget fields: every knob an attack reads, declared once with its default and range.

A budget field is part of the protocol tuple's B. Each one is declared here (built-in
attacks) or by the module that registers an attack (plugins), with its type, default
(the published value where one exists), allowed range and a one-line description:

    budget.declare("eia_steps", 24_000, int, low=1, doc="EIA optimisation steps",
                   source="SplitLLM [CR] gpt2-large")

Replay validates a whole budget before anything runs (`validate`): an unknown field, a
value outside its range, or a field changed from its default that none of the requested
attacks reads is refused with one line naming it. An attack sees only the fields it
declares (`View`), so what it read is exactly what its record says it used.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import ml_collections

# Upper bounds that depend on the attacker's model, resolved at validation time.
VOCAB = "vocab_size"


class BudgetError(ValueError):
  """A budget that cannot run; the message names the field and the allowed range."""


@dataclasses.dataclass(frozen=True)
class Field:
  """One budget knob.

  Attributes:
    name: the config key (`--config.budget.<name>`).
    default: the value used unless the run sets another; the published one where known.
    kind: int, float, bool or str.
    low, high: inclusive bounds for numbers; `high` may be VOCAB (the model's vocabulary).
    strict_low: the lower bound is exclusive (e.g. a learning rate > 0).
    choices: allowed values for strings.
    doc: one line for docs and error messages.
    source: where the default comes from (paper, code, or "lla").
  """

  name: str
  default: Any
  kind: type
  low: float | None = None
  high: float | str | None = None
  strict_low: bool = False
  choices: tuple[str, ...] = ()
  doc: str = ""
  source: str = "lla"

  def range_text(self) -> str:
    if self.kind is bool:
      return "True or False"
    if self.choices:
      return "one of " + ", ".join(self.choices)
    if self.kind is str:
      return "a string"
    low = "-inf" if self.low is None else f"{self.low:g}"
    high = "inf" if self.high is None else (self.high if isinstance(self.high, str)
                                            else f"{self.high:g}")
    return f"{'(' if self.strict_low else '['}{low}, {high}] ({self.kind.__name__})"

  def check(self, value, vocab_size: int | None) -> None:
    """Raises BudgetError naming the field if `value` is not allowed."""
    bad = lambda: BudgetError(f"budget field {self.name}={value!r} is not allowed: expected "
                              f"{self.range_text()} ({self.doc})")
    if self.kind is bool:
      if not isinstance(value, bool):
        raise bad()
      return
    if self.kind is str:
      if not isinstance(value, str) or (self.choices and value not in self.choices):
        raise bad()
      return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise bad()
    if self.kind is int and not float(value).is_integer():
      raise bad()
    if not math.isfinite(value):
      raise bad()
    if self.low is not None and (value < self.low or (self.strict_low and value == self.low)):
      raise bad()
    high = vocab_size if self.high == VOCAB else self.high
    if high is not None and value > high:
      raise bad()


_FIELDS: dict[str, Field] = {}


def declare(name: str, default, kind: type, **kwargs) -> Field:
  """Declares a budget field (idempotent for an identical declaration)."""
  field = Field(name, default, kind, **kwargs)
  if name in _FIELDS and _FIELDS[name] != field:
    raise ValueError(f"budget field {name!r} is declared twice, differently")
  field.check(default, None if field.high == VOCAB else 10**9)
  _FIELDS[name] = field
  return field


def get(name: str) -> Field:
  if name not in _FIELDS:
    raise BudgetError(f"no budget field named {name!r}; declared: {', '.join(sorted(_FIELDS))}")
  return _FIELDS[name]


def fields() -> dict[str, Field]:
  return dict(_FIELDS)


def defaults() -> dict[str, Any]:
  return {name: f.default for name, f in sorted(_FIELDS.items())}


def as_dict(budget) -> dict[str, Any]:
  """A budget given as a ConfigDict, a dict or a View, as a plain dict."""
  if isinstance(budget, ml_collections.ConfigDict):
    return budget.to_dict()
  if isinstance(budget, View):
    return dict(budget.values)
  return dict(budget)


def parse_items(items) -> dict[str, Any]:
  """Budget fields given as "name=value" strings (a benchmark's flags), typed by their
  declarations and checked (booleans: 1 / true); raises BudgetError naming a bad one."""
  out = {}
  for item in items:
    name, _, text = item.partition("=")
    field = get(name.strip())
    value = (text.strip().lower() in ("1", "true")) if field.kind is bool else field.kind(text)
    field.check(value, None)
    out[field.name] = value
  return out


def _normalise(field: Field, value):
  # Configs written as 3 for a float field are the same budget as 3.0: one E hash.
  return float(value) if field.kind is float else value


def validate(budget, specs, vocab_size: int) -> dict[str, Any]:
  """The complete, checked budget for running `specs` (a list of AttackSpec).

  Returns every declared field (defaults filled in), so that E.B identifies the run.

  Raises:
    BudgetError (one line, naming the field): an unknown field; a value of the wrong type
      or out of range; a field changed from its default that no requested attack reads.
  """
  given = as_dict(budget)
  unknown = sorted(set(given) - set(_FIELDS))
  if unknown:
    raise BudgetError(f"unknown budget field(s) {', '.join(unknown)}; declared fields: "
                      f"{', '.join(sorted(_FIELDS))}")
  read = {f for spec in specs for f in spec.budget_fields}
  out = {}
  for name, field in sorted(_FIELDS.items()):
    value = given.get(name, field.default)
    field.check(value, vocab_size)
    value = _normalise(field, value)
    if name not in read and value != _normalise(field, field.default):
      names = ", ".join(s.name for s in specs) or "none"
      raise BudgetError(f"budget field {name}={value!r} is read by none of the requested "
                        f"attacks ({names}); leave it at its default {field.default!r} or "
                        "add an attack that declares it")
    out[name] = value
  for spec in specs:
    if spec.validate_budget is not None:
      spec.validate_budget(out, vocab_size)
  return out


class View:
  """The fields one attack declared, read as attributes or items; anything else raises."""

  def __init__(self, values: dict[str, Any], declared, attack: str):
    self.values = {k: values[k] for k in declared}
    self._attack = attack

  def __getattr__(self, name):
    if name.startswith("_") or name == "values":
      raise AttributeError(name)
    if name not in self.values:
      raise AttributeError(f"attack {self._attack!r} reads budget field {name!r}, which it does "
                           "not declare in its AttackSpec.budget_fields")
    return self.values[name]

  __getitem__ = __getattr__

  def to_dict(self) -> dict[str, Any]:
    return dict(self.values)


# Fields of the seed protocol's attacks (PROTOCOL section 4).
declare("candidates", 32, int, low=1, high=VOCAB, doc="C: activation candidates per position",
        source="PROTOCOL.md section 4")
declare("beam_width", 2, int, low=1, high=VOCAB, doc="W: beams kept per position",
        source="PROTOCOL.md section 4")
declare("c_a", 16, int, low=1, high=VOCAB, doc="joint attack: activation candidates at t >= 1",
        source="PROTOCOL.md section 4")
declare("c_g", 16, int, low=0, high=VOCAB, doc="joint attack: gradient-ranked candidates at t >= 1",
        source="PROTOCOL.md section 4")
declare("ridge_alpha", 1e-3, float, low=0.0, strict_low=True,
        doc="ridge strength relative to trace(Hc^T Hc)/d", source="PROTOCOL.md section 4")
declare("shuffle_seed", 17, int, low=0, doc="derangement seed of the shuffled-gradient control",
        source="lla")
