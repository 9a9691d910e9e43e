"""The protocol tuple E (canonical JSON, sha256 identity) and the attack registry's refusals."""

import dataclasses
import hashlib
import json

import pytest

from lla.attacks import registry
from lla.protocol import tuple as protocol


def example() -> protocol.ProtocolTuple:
  return protocol.make(
      T=protocol.Target(model_id="abc", cut=6, defense="noise",
                        defense_params=protocol.frozen({"sigma": 0.1, "clip": {"c": 1, "a": 2}}),
                        n_layer=12),
      O=protocol.Observations(gradients=True),
      B=protocol.Budgets(fields=protocol.frozen({"candidates": 16, "beam_width": 2})),
      C=protocol.Corpora(split_hashes=protocol.frozen({"evaluation": "e" * 64, "calibration": "c"})),
      G=protocol.Controls(seeds=(0, 1)))


def test_canonical_json_round_trip():
  e = example()
  text = e.canonical_json()
  # Canonical: sorted keys, no whitespace, UTF-8, one trailing newline (lla.evidence.files).
  independent = json.dumps(e.to_dict(), sort_keys=True, separators=(",", ":"),
                           ensure_ascii=False) + "\n"
  assert text == independent.encode("utf-8")
  back = protocol.ProtocolTuple.from_dict(json.loads(text))
  assert back == e and back.canonical_json() == text
  assert back.to_dict() == e.to_dict() == json.loads(text)
  assert back.T.defense_params == (("clip", (("a", 2), ("c", 1))), ("sigma", 0.1))
  assert json.loads(text)["T"]["defense_params"] == {"clip": {"a": 2, "c": 1}, "sigma": 0.1}
  # Independent digest of the canonical form.
  assert e.sha256() == hashlib.sha256(independent.encode("utf-8")).hexdigest()
  # Dict insertion order does not matter.
  other = e.replace(T=dataclasses.replace(
      e.T, defense_params=protocol.frozen({"clip": {"a": 2, "c": 1}, "sigma": 0.1})))
  assert other.sha256() == e.sha256()
  with pytest.raises(ValueError, match="schema"):
    protocol.ProtocolTuple.from_dict({**json.loads(text), "schema": "other"})


def test_sha256_is_stable_and_changes_with_every_component():
  e = example()
  # Stable: equal tuples built separately hash equally, here and in a fresh process.
  assert e.sha256() == example().sha256()
  import subprocess, sys, pathlib
  code = ("import sys; sys.path.insert(0, sys.argv[1]); import test_protocol_tuple as t; "
          "print(t.example().sha256())")
  here = pathlib.Path(__file__).parent
  out = subprocess.run([sys.executable, "-c", code, str(here)], capture_output=True, text=True,
                       cwd=here.parent, check=True).stdout.strip()
  assert out == e.sha256()
  changes = dict(
      T=dataclasses.replace(e.T, cut=3),
      V=protocol.Attacker(position="eavesdropper"),
      O=dataclasses.replace(e.O, gradients=False),
      K=protocol.Knowledge("trained"),
      B=dataclasses.replace(e.B, fields=protocol.frozen({"candidates": 16, "beam_width": 4})),
      C=dataclasses.replace(e.C, seq_len=64),
      M=protocol.Metrics(names=("token_recovery",)),
      G=dataclasses.replace(e.G, seeds=(0, 2)),
  )
  assert set(changes) == {f.name for f in dataclasses.fields(protocol.ProtocolTuple)}
  hashes = {e.sha256()}
  for name, component in changes.items():
    changed = e.replace(**{name: component})
    assert changed.sha256() != e.sha256(), name
    hashes.add(changed.sha256())
  assert len(hashes) == 9
  # Nested parameters count too.
  nested = e.replace(T=dataclasses.replace(
      e.T, defense_params=protocol.frozen({"sigma": 0.1, "clip": {"c": 1, "a": 3}})))
  assert nested.sha256() != e.sha256()


def test_tuple_validation():
  with pytest.raises(ValueError, match="needs a target"):
    protocol.make()
  t = protocol.Target(model_id="m", cut=1)
  with pytest.raises(ValueError, match="attacker position 'nowhere'"):
    protocol.make(T=t, V=protocol.Attacker(position="nowhere"))
  with pytest.raises(ValueError, match="knowledge 'all'"):
    protocol.make(T=t, K=protocol.Knowledge("all"))


class _Dummy:

  def __init__(self, spec):
    self.spec = spec

  def __call__(self, ws, budget, key):
    raise AssertionError("never run")


def test_registry_refusals():
  names = registry.names()
  assert {"activation", "joint", "shuffled_gradients", "random_candidates", "ridge",
          "gradient_only"} <= set(names)
  with pytest.raises(ValueError, match="'activation' is registered twice"):
    registry.register(_Dummy(registry.AttackSpec("activation", "x", ("activations",))))
  with pytest.raises(ValueError, match=r"requires unknown observations \['logits'\]"):
    registry.register(_Dummy(registry.AttackSpec("logit_test", "x", ("activations", "logits"))))
  for revision in (0, 1.5):
    with pytest.raises(ValueError, match=f"revision {revision} is not a positive integer"):
      registry.register(_Dummy(registry.AttackSpec("revision_test", "x", ("activations",),
                                                   revision=revision)))
  assert registry.names() == names  # nothing was added
  with pytest.raises(KeyError, match="no attack named 'nope'"):
    registry.get("nope")
  joint = registry.get("joint").spec
  assert joint.requires == ("activations", "gradients")
  with pytest.raises(registry.IncompatibleCaptureError,
                     match="'joint' needs gradients, which capture X does not hold"):
    registry.check_compatible(joint, {"activations"}, "public", capture_name="capture X")
  with pytest.raises(registry.IncompatibleCaptureError, match="not 'none'"):
    registry.check_compatible(joint, {"activations", "gradients"}, "none")
  registry.check_compatible(joint, {"activations", "gradients"}, "trained")
  registry.check_compatible(registry.get("gradient_only").spec, {"gradients"}, "none")
