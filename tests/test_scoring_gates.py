"""Gate decisions, reference links and sensitivity on synthetic runs.

Every expected number and decision here is worked out in the test from PROTOCOL.md
sections 5 and 5a, never taken from the gate code or from a run: the Wilson bound is the
root of the score equation found with scipy (not the closed form `metrics` uses), the
frequency baseline is counted on the truth with numpy, hits are what the synthetic
predictions were built to hit (exactly `correct_per_doc` per document), and the attacks
that fit a capture are listed by hand from the registry's declarations.
"""

import dataclasses
import math

import numpy as np
import pytest
from scipy import optimize

from lla.scoring import gates
from lla.scoring import metrics
from lla.scoring import policy as policy_lib
from lla.scoring import scorecard
from lla.scoring import synthetic as syn

POL = policy_lib.load_policy()
Z = 2.5392  # PROTOCOL section 5, written out (the policy's wilson_z must agree)
DOCS, T_LEN = 64, 32  # the synthetic capture: 64 documents of 32 tokens, baseline token 0


def wilson_upper_ref(hits: int, n: int, z: float = Z) -> float:
  """The one-sided Wilson (score) upper bound as the upper root of the score equation
  p - p_hat = z sqrt(p (1 - p) / n), solved numerically: an independent route to the
  closed form of PROTOCOL section 5."""
  p_hat = hits / n
  if hits == n:
    return 1.0
  f = lambda p: (p - p_hat) - z * math.sqrt(p * (1.0 - p) / n)
  return optimize.brentq(f, p_hat + 1e-12, 1.0, xtol=1e-15, rtol=4 * np.finfo(float).eps)


def excess_ref(hits: int, n: int, baseline_hits: int) -> float:
  """100 (U(p_a, n) - p0) in pp, p0 = baseline_hits / n (PROTOCOL section 5)."""
  return 100.0 * (wilson_upper_ref(hits, n) - baseline_hits / n)


def floor_ref(baseline_hits: int, n: int) -> float:
  """100 (U(p0, n) - p0): the smallest excess n allows."""
  return 100.0 * (wilson_upper_ref(baseline_hits, n) - baseline_hits / n)


# The frequency baseline of the synthetic capture, counted on its truth with numpy.
B0 = int(np.count_nonzero(syn.truth_tokens(docs=DOCS) == 0))
N1 = DOCS * T_LEN  # scored tokens of one record (all positions)


@pytest.fixture(scope="module")
def cap(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("cap"))
  syn.make_capture(d, syn.truth_tokens(docs=64))
  return d


# A registry of three attacks: two generic, one adaptive to mixup.
MODULES = [
    {"name": "activation", "family": "beam_inversion", "observations": ["activations"]},
    {"name": "joint", "family": "beam_inversion",
     "observations": ["activations", "gradients"]},
    {"name": "mixup_adaptive", "family": "beam_inversion", "observations": ["activations"],
     "adapts_to": ["mixup"]},
]


def _gate(tmp_path, cap, specs, modules=None):
  run = str(tmp_path / "run")
  syn.make_run(run, cap, specs, POL.sha256)
  (g,) = scorecard.build(run, POL, None, modules)["gates"]
  return g


def _covered(m, hits=(0, 0, 0), defense="mixup", **kw):
  """The defended runs of every attack in MODULES on seed m: hits per document."""
  return [syn.Spec(name, "beam_inversion", h, m, defense=defense, **kw)
          for name, h in zip(("activation", "joint", "mixup_adaptive"), hits)]


def test_wilson_reference_is_the_protocol_bound():
  """The test's own bound (a root of the score equation) against the closed form at
  p_hat = 0 and against `metrics`, and the policy's z against PROTOCOL section 5."""
  assert POL.wilson_z == Z and POL.threshold_pp == 1.0 and POL.min_seeds == 3
  for n in (1, 32, 2048, 6144):
    # p_hat = 0: p = z sqrt(p (1 - p) / n)  <=>  p = z^2 / (n + z^2).
    assert wilson_upper_ref(0, n) == pytest.approx(Z * Z / (n + Z * Z), rel=1e-12)
    for hits in sorted({0, 1, n // 7, n // 2, n - 1, n}):
      assert metrics.wilson_upper(hits, n, Z) == pytest.approx(
          wilson_upper_ref(hits, n), rel=1e-10, abs=1e-14), (hits, n)
  # One-sided: U >= p_hat always, strictly while p_hat < 1.
  assert wilson_upper_ref(5, 100) > 0.05 and wilson_upper_ref(100, 100) == 1.0


# (envelope, floor, seeds, positive control) -> the decision, by PROTOCOL section 5's rule.
@pytest.mark.parametrize("args,decision", [
    ((0.99, 0.5, 3, True), gates.PASS),            # all three conditions hold
    ((1.0, 0.5, 3, True), gates.PASS),             # "<= 1.0 pp" includes the threshold
    ((1.5, 0.5, 3, True), gates.FAIL),             # > 1.0 pp with (2) and (3) met
    ((1.5, 0.5, 2, True), gates.INSUFFICIENT),     # 2 seeds: (2) fails, no FAIL either
    ((0.5, 0.5, 3, False), gates.INSUFFICIENT),    # no positive control
    ((0.5, 1.01, 3, True), gates.INSUFFICIENT),    # floor above 1.0 pp: PASS impossible
    ((1.5, 1.01, 3, True), gates.INSUFFICIENT),    # ... and an envelope above it proves nothing
    ((None, None, 0, True), gates.INSUFFICIENT),   # nothing measured
])
def test_decide_rule(args, decision):
  assert gates.decide(*args, POL)[0] == decision


def test_policy_flags_withhold_pass_only():
  assert gates.decide(0.5, 0.5, 3, True, POL, ["late"]) == (
      gates.INSUFFICIENT, ["PASS withheld: late"])
  assert gates.decide(2.0, 0.5, 3, True, POL, ["late"])[0] == gates.FAIL


def test_leaking_defense_fails_with_pooled_and_per_seed_numbers(tmp_path, cap):
  specs = []
  for m in range(3):
    specs += [syn.Spec("activation", "beam_inversion", 30, m),
              syn.Spec("activation", "beam_inversion", 4 + m, m,
                       defense="mixup")]
  g = _gate(tmp_path, cap, specs)
  # Pooled: (4 + 5 + 6) hits in each of 64 documents over 3 x 2048 tokens; per seed: its own.
  pooled = excess_ref((4 + 5 + 6) * DOCS, 3 * N1, 3 * B0)
  per_seed = [excess_ref((4 + m) * DOCS, N1, B0) for m in range(3)]
  assert pooled > POL.threshold_pp + 5 and floor_ref(3 * B0, 3 * N1) < POL.threshold_pp
  assert g["decision"] == gates.FAIL
  assert g["envelope"]["envelope_pp"] == pytest.approx(pooled, abs=1e-9)
  assert g["envelope"]["floor_pp"] == pytest.approx(floor_ref(3 * B0, 3 * N1), abs=1e-9)
  assert [p["envelope_pp"] for p in g["per_seed"]] == pytest.approx(per_seed, abs=1e-9)
  assert [p["floor_pp"] for p in g["per_seed"]] == pytest.approx([floor_ref(B0, N1)] * 3,
                                                                 abs=1e-9)
  assert all(l["kind"] == "implicit (family match)" for l in g["links"])


@pytest.mark.parametrize("hits,decision", [((2, 2, 2), gates.FAIL), ((2, 2, 1), gates.PASS)])
def test_fail_and_pass_bracket_the_threshold(tmp_path, cap, hits, decision):
  """The defended `activation` hits 2, 2 and then 2 or 1 tokens per document on the three
  seeds: 6 or 5 hits per 96 pooled tokens of a document. By the hand bound the first is
  above 1.0 pp by more than 0.4 pp and the second below it by more than 0.6 pp, so one hit
  per document on one seed moves the decision across the threshold."""
  specs = []
  for m in range(3):
    specs += [syn.Spec("activation", "beam_inversion", 30, m),
              *_covered(m, hits=(hits[m], 0, 0))]
  envelope = excess_ref(sum(hits) * DOCS, 3 * N1, 3 * B0)
  if decision == gates.FAIL:
    assert envelope > POL.threshold_pp + 0.4, envelope
  else:
    assert envelope < POL.threshold_pp - 0.6, envelope
  assert floor_ref(3 * B0, 3 * N1) < POL.threshold_pp  # PASS is possible at this n
  assert excess_ref(30 * DOCS * 3, 3 * N1, 3 * B0) > POL.positive_control_pp  # control
  g = _gate(tmp_path, cap, specs, MODULES)
  assert g["decision"] == decision, g["reasons"]
  assert g["envelope"]["argmax"] == "activation"
  assert g["envelope"]["envelope_pp"] == pytest.approx(envelope, abs=1e-9)
  assert g["n_seeds"] == 3


def test_explicit_reference_mismatch_is_rejected(tmp_path, cap):
  specs = []
  for m in range(3):
    specs += [syn.Spec("activation", "beam_inversion", 30, m,
                       corpus="other"),
              syn.Spec("activation", "beam_inversion", 0, m, defense="mixup",
                       reference=f"k6/public/none/m{m}/s0/activation")]
  g = _gate(tmp_path, cap, specs)
  assert g["decision"] == gates.INSUFFICIENT
  assert all(l["kind"] == "explicit" and not l["references"] and
             any("corpus 'other' != 'synthetic'" in p for p in l["problems"])
             for l in g["links"])


def test_sensitivity_reports_weak_alternative(tmp_path, cap):
  specs = []
  for m in range(3):
    specs += [syn.Spec("activation", "beam_inversion", 30, m),
              syn.Spec("ridge_like", "beam_inversion", 0, m), *_covered(m)]
  g = _gate(tmp_path, cap, specs, MODULES)
  # activation recovers 30 of 32 (a control far above 1.0 pp); ridge_like nothing (its
  # excess is negative: no control); the defended envelope (0 hits) is below 1.0 pp.
  control = {"activation": excess_ref(30 * DOCS * 3, 3 * N1, 3 * B0),
             "ridge_like": excess_ref(0, 3 * N1, 3 * B0)}
  assert control["activation"] > 50 and control["ridge_like"] < 0
  assert excess_ref(0, 3 * N1, 3 * B0) < POL.threshold_pp
  assert g["decision"] == gates.PASS
  alts = {a["reference"]: a["decision"] for a in g["sensitivity"]["alternatives"]}
  assert alts == {"activation": gates.PASS, "ridge_like": gates.INSUFFICIENT}
  assert {a["reference"]: a["excess_pp"] for a in g["sensitivity"]["alternatives"]} == \
      pytest.approx(control, abs=1e-9)
  assert g["sensitivity"]["decision_changes"]
  assert "ridge_like" in g["sensitivity"]["line"]


def test_positive_control_only_counts_measured_families(tmp_path, cap):
  specs = []
  for m in range(3):
    specs += [syn.Spec("grad", "gradient_heuristic", 30, m),
              syn.Spec("activation", "beam_inversion", 0, m),
              syn.Spec("activation", "beam_inversion", 0, m, defense="mixup"),
              dataclasses.replace(syn.Spec("grad", "gradient_heuristic", 0, m,
                                           defense="mixup"), status="crashed")]
  g = _gate(tmp_path, cap, specs)
  assert g["decision"] == gates.INSUFFICIENT
  assert set(g["positive_controls"]) == {"beam_inversion"}
  assert any("no positive control" in r for r in g["reasons"])
  assert any("unmeasured" in r for r in g["reasons"])


def test_only_the_adaptive_attack_leaks_fail_names_it(tmp_path, cap):
  specs = []
  for m in range(3):
    specs += [syn.Spec("activation", "beam_inversion", 30, m), *_covered(m, hits=(0, 0, 12))]
  g = _gate(tmp_path, cap, specs, MODULES)
  assert g["decision"] == gates.FAIL
  assert g["envelope"]["argmax"] == "mixup_adaptive"
  assert g["envelope"]["envelope_pp"] == pytest.approx(
      excess_ref(12 * DOCS * 3, 3 * N1, 3 * B0), abs=1e-9)
  assert "envelope set by mixup_adaptive" in g["reasons"]
  assert g["fitting"]["adaptive"] == ["mixup_adaptive"]
  # The same study scored as if the adaptive attack had not been run: no PASS.
  run = [s for s in specs if s.attack != "mixup_adaptive"]
  g = _gate(tmp_path / "without", cap, run, MODULES)
  assert g["decision"] == gates.INSUFFICIENT
  assert any("PASS withheld: fitting attack(s) unmeasured: mixup_adaptive (not run)" == r
             for r in g["reasons"])


def test_crashed_fitting_attack_withholds_pass(tmp_path, cap):
  specs = []
  for m in range(3):
    covered = _covered(m)
    covered[2] = dataclasses.replace(covered[2], status="crashed")
    specs += [syn.Spec("activation", "beam_inversion", 30, m), *covered]
  g = _gate(tmp_path, cap, specs, MODULES)
  assert g["decision"] == gates.INSUFFICIENT
  assert g["fitting"]["unmeasured"] == {"mixup_adaptive": "crashed"}


def test_mechanism_without_adaptive_attack_cannot_pass(tmp_path, cap):
  specs = []
  for m in range(3):
    specs += [syn.Spec("activation", "beam_inversion", 30, m),
              *_covered(m, defense="topk")[:2]]
  g = _gate(tmp_path, cap, specs, MODULES)
  assert g["decision"] == gates.INSUFFICIENT
  assert g["fitting"]["fitting"] == ["activation", "joint"]  # mixup_adaptive does not fit
  assert "PASS withheld: no adaptive attack for this mechanism (topk)" in g["reasons"]
  # Without module entries nothing says which attacks fit: no PASS either.
  g = _gate(tmp_path / "none", cap, specs, None)
  assert g["decision"] == gates.INSUFFICIENT
  assert any("no attack registry given" in r for r in g["reasons"])


def test_fitting_follows_observations_knowledge_and_threat_model():
  modules = MODULES + [
      {"name": "control", "observations": ["activations"], "role": "negative_control"},
      {"name": "active", "observations": ["gradients"], "tier": "active"},
      {"name": "aware", "observations": ["activations"], "defense_aware": True,
       "defenses": {"mixup": "activations", "nopeek": "training",
                    "projection": "activations"}},
      {"name": "aware_unknown", "observations": ["activations"], "defense_aware": True},
      {"name": "trained_only", "observations": ["activations"], "knowledge": ["trained"]},
  ]
  names = lambda *a: sorted(m["name"] for m in gates.fitting_modules(modules, *a))
  # A defense-aware entry that does not say what a defense acts on stays required.
  assert names({"activations"}, "public", "mixup") == [
      "activation", "aware", "aware_unknown", "mixup_adaptive"]
  assert names({"activations", "gradients"}, "public", "nopeek") == [
      "activation", "aware_unknown", "joint"]
  assert names(None, "trained", "projection") == [
      "activation", "aware", "aware_unknown", "joint", "trained_only"]


# The registered attacks that fit a training capture (O: h and g) of a projection-defended
# client under public knowledge, listed by hand from the registry's declarations (PROTOCOL
# section 5a): every passive attack whose needs are within {activations, gradients} and
# that runs under public knowledge, the gradient-reading ones included (a defense on h
# leaves g open); the defense-aware baselines (projection transforms h); of the adaptive
# attacks only projection_adaptive. Left out, each for a declared reason: the decoy_*
# attacks (decoy-row observations, trained knowledge only), fsha_decode (active tier,
# knowledge none), gaussian/mixup/nopeek/quantize/topk_adaptive (other mechanisms), and
# the negative controls random_candidates and shuffled_gradients. An attack registered
# later that fits must be added here by hand (this test then fails until it is).
FITTING_PROJECTION_TRAINING = (
    "activation", "activation_defense_aware", "activation_flop_matched", "bisr", "bisr_b",
    "bisr_f", "eia", "gradient_only", "gradient_only_t1", "joint", "joint_defense_aware",
    "lamp", "projection_adaptive", "ridge", "sip", "sip_linear", "sipit", "tag")


def test_live_registry_pass_needs_every_fitting_attack(tmp_path, cap):
  """With the real registry's module entries, on a projection-defended training capture:
  the hand-listed fitting attacks all measured and none leaking is a PASS (so nothing
  outside the list is required); removing any one hand-named attack of the list withholds
  it; only projection_adaptive leaking is a FAIL that names it."""
  from lla.attacks import registry  # pylint: disable=g-import-not-at-top
  # The built-in modules only: other tests of the session may have registered plugins.
  modules = [m for m in registry.module_entries() if m["source"]["module"].startswith("lla.")]
  names = {m["name"] for m in modules}
  assert set(FITTING_PROJECTION_TRAINING) <= names
  specs = []
  for m in range(3):
    specs += [syn.Spec("activation", "beam_inversion", 30, m)]
    # Each record made at the revision the registry lists (another counts as unmeasured).
    specs += [syn.Spec(name, "beam_inversion", 12 if name == "projection_adaptive" else 0, m,
                       defense="projection",
                       attack_revision=registry.get(name).spec.revision)
              for name in FITTING_PROJECTION_TRAINING]
  g = _gate(tmp_path, cap, specs, modules)
  assert g["decision"] == gates.FAIL and g["envelope"]["argmax"] == "projection_adaptive"
  assert g["envelope"]["envelope_pp"] == pytest.approx(
      excess_ref(12 * DOCS * 3, 3 * N1, 3 * B0), abs=1e-9)
  assert g["fitting"]["fitting"] == list(FITTING_PROJECTION_TRAINING)
  assert g["fitting"]["adaptive"] == ["projection_adaptive"]
  # Nothing leaks: PASS with exactly the hand-listed attacks measured.
  clean = [s if s.defense == "none" else dataclasses.replace(s, correct_per_doc=0)
           for s in specs]
  g = _gate(tmp_path / "clean", cap, clean, modules)
  assert g["decision"] == gates.PASS, g["reasons"]
  assert g["fitting"]["unmeasured"] == {}
  # One hand-named fitting attack missing, each for a different reason it fits: the
  # adaptive attack, a gradient-only attack (the open channel), a defense-aware baseline.
  for missing in ("projection_adaptive", "gradient_only", "joint_defense_aware"):
    without = [s for s in clean if s.attack != missing]
    g = _gate(tmp_path / f"missing_{missing}", cap, without, modules)
    assert g["decision"] == gates.INSUFFICIENT, (missing, g["reasons"])
    assert g["fitting"]["unmeasured"] == {missing: "not run"}
    assert f"PASS withheld: fitting attack(s) unmeasured: {missing} (not run)" in g["reasons"]


# --- Observations per capture (PROTOCOL section 5a) -------------------------------------
#
# A study (several captures, each with its own protocol tuple) in which one defended
# configuration holds a training capture per model seed (O: h and g) and one inference
# capture (O: h only). The gradient-reading attack `joint` fits the training captures and
# must be measured on each of them; the inference capture does not need it.

TRAINING = {"activations": True, "gradients": True}
INFERENCE = {"activations": True, "gradients": False}


def _study(tmp_path, captures, runs):
  """A study with `captures` {name: (model_seed, O)} and `runs` [(capture, attack, hits)]
  (family beam_inversion; defended iff the capture name starts with 'mixup')."""
  from lla.evidence import rundir  # pylint: disable=g-import-not-at-top
  from lla.evidence.records import AttackRecord  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  import zlib  # pylint: disable=g-import-not-at-top
  run = str(tmp_path / "study")
  rundir.create(run, {"schema": rundir.STUDY_SCHEMA,
                      "G": {"policy": POL.policy_id, "policy_sha256": POL.sha256}},
                time=syn.RUN_TIME)
  os.makedirs(os.path.join(run, rundir.PROTOCOLS))
  made = {}
  for i, (name, (model_seed, o)) in enumerate(sorted(captures.items())):
    directory = str(tmp_path / f"cap_{name}")
    truth = syn.truth_tokens(docs=64, seed=100 + i)  # distinct bytes: distinct captures
    sha = syn.make_capture(directory, truth)
    e_hash = rundir.add_protocol(run, {"T": {"capture": name}, "O": o})
    made[name] = (directory, sha, e_hash, truth, model_seed)
  for capture, attack, hits in runs:
    directory, sha, e_hash, truth, model_seed = made[capture]
    run_id = f"{capture}/s0/{attack}"
    name = run_id.replace("/", "__")
    pred_file, pred_sha = rundir.save_predictions(
        run, name, syn.predict(truth, hits, zlib.crc32(run_id.encode())))
    rundir.save_record(run, name, AttackRecord(
        run_id=run_id, attack=attack, family="beam_inversion", status="ok", error=None,
        e_hash=e_hash, capture_dir=os.path.relpath(directory, run), capture_sha256=sha,
        truth_file=os.path.relpath(os.path.join(directory, "truth.safetensors"), run),
        prediction_file=pred_file, prediction_sha256=pred_sha, scored_positions="all",
        baseline_token=0, model_id=f"synthetic-model-{model_seed}", model_seed=model_seed,
        cut=6, knowledge="public", corpus="synthetic",
        defense="mixup" if capture.startswith("mixup") else "none", defense_params={},
        reference=None, seed=0, budget={}, flops=1.0, flops_source="analytic",
        flops_analytic=1.0, wall_s=1.0, compile_s=0.0, stages={}, details={},
        provenance={"lla": "synthetic"}))
  rundir.finalize(run, time=syn.RUN_TIME)
  (g,) = scorecard.build(run, POL, None, MODULES)["gates"]
  return g


def _mixed_captures():
  captures = {f"plain_m{m}": (m, TRAINING) for m in range(3)}
  captures.update({f"mixup_m{m}": (m, TRAINING) for m in range(3)})
  captures["mixup_inference_m0"] = (0, INFERENCE)
  return captures


def _mixed_runs(joint_on=(0, 1, 2)):
  """Nothing recovered under the defense; the undefended control recovers 30 of 32."""
  runs = [(f"plain_m{m}", "activation", 30) for m in range(3)]
  for m in range(3):
    runs += [(f"mixup_m{m}", "activation", 0), (f"mixup_m{m}", "mixup_adaptive", 0)]
    runs += [(f"mixup_m{m}", "joint", 0)] if m in joint_on else []
  runs += [("mixup_inference_m0", "activation", 0), ("mixup_inference_m0", "mixup_adaptive", 0)]
  return runs


def test_inference_capture_leaves_gradient_attacks_required_on_training_captures(tmp_path):
  """joint (h and g) never ran on the training captures: no PASS, joint named. One inference
  capture in the configuration must not remove it from the attacks that fit them."""
  g = _study(tmp_path / "without", _mixed_captures(), _mixed_runs(joint_on=()))
  assert g["decision"] == gates.INSUFFICIENT, g["reasons"]
  assert "joint" in g["fitting"]["unmeasured"]
  assert any(r.startswith("PASS withheld: fitting attack(s) unmeasured: joint (not run")
             for r in g["reasons"]), g["reasons"]
  # Missing on one training capture only: still withheld, and that capture is named.
  g = _study(tmp_path / "partly", _mixed_captures(), _mixed_runs(joint_on=(0, 1)))
  assert g["decision"] == gates.INSUFFICIENT, g["reasons"]
  assert set(g["fitting"]["unmeasured"]) == {"joint"}
  assert g["fitting"]["unmeasured"]["joint"] == "not run on 1 of 3 captures it fits: model_seed 2"
  # joint on every training capture and not on the inference one (it cannot run there): PASS.
  g = _study(tmp_path / "covered", _mixed_captures(), _mixed_runs())
  assert g["decision"] == gates.PASS, g["reasons"]
  assert g["fitting"]["unmeasured"] == {}
  assert g["fitting"]["observed"] == [
      {"observations": ["activations"], "captures": 1,
       "fitting": ["activation", "mixup_adaptive"]},
      {"observations": ["activations", "gradients"], "captures": 3,
       "fitting": ["activation", "joint", "mixup_adaptive"]}]


def test_gates_know_every_observation_kind_the_registry_declares():
  """Scoring lists the observation kinds itself (it imports nothing of the attacks): the
  same kinds, decoy-row frames included."""
  from lla.attacks import registry  # pylint: disable=g-import-not-at-top
  assert set(gates.OBSERVATIONS) == set(registry.OBSERVATIONS) == {
      "activations", "gradients", "decoy_forward", "decoy_gradients"}
