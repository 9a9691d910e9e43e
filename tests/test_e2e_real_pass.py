"""A real-capture PASS, end to end through the capture and replay CLIs and a study's scoring.

Three tiny random GPT-2s (the gate's three independent model seeds) each encode 48 random
documents of 16 tokens, drawn uniformly from a vocabulary of 2,048. Each model is captured
twice by experiments/capture.py, as inference captures at k = 1: undefended, and defended
by Gaussian noise with rows first clipped to norm 1e-30 and then given noise of sigma = 1
(an explicit secret per model). In float32, n + s == n for |s| <= 1e-30 unless |n| < ~1e-23
(probability ~1e-23 per entry), so the defended message is the noise draw itself: a
function of the secret alone, bit for bit, which the test checks by computing the message
of other documents. A message that carries zero information about the documents makes
every prediction independent of them, and since the documents are uniform over V, every
attack's hits are Binomial(n, 1/V) whatever it does: far below the 1 pp bar at n = 2,304
per attack (3 x 48 x 16).

experiments/replay.py then runs, into one study, `activation` on each undefended capture
(the positive control, linked by run prefix) and every attack that fits the defended
capture (PROTOCOL 5a, derived here from the registry's declarations), the defense-aware
baseline with the attacker's own seed. Scored before the defense-aware replay, the gate
must say INSUFFICIENT_EVIDENCE naming it; after, PASS. The expected decision, envelope and
floor are computed here from the predictions and the truth files alone, with scipy's Wilson
bound, by the PROTOCOL 5 and 5a rules written out below, never by lla's scoring.
"""

import os
import pathlib
import re
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import load_file
from scipy.stats import binomtest, norm

from lla import defenses
from lla.attacks import registry
from lla.defenses import training as defended
from lla.evidence import rundir
from lla.model import hf_io
from lla.model.gpt2 import GPT2Config
from lla.scoring import policy as policy_lib
from lla.scoring import scorecard

from test_attacks_units import random_params

pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parent.parent
CFG = GPT2Config(vocab_size=2048, n_positions=16, n_embd=32, n_head=4, n_layer=2)
K, B, T, N_CAL = 1, 48, 16, 32
MODEL_SEEDS = (0, 1, 2)
DEFENSE = {"name": "gaussian", "sigma": 1.0, "clip_norm": 1e-30}
AWARE = "activation_defense_aware"
# PROTOCOL 5, policy scorecard-policy.v3.
Z, THRESHOLD_PP, MIN_SEEDS, CONTROL_PP = 2.5392, 1.0, 3, 1.0
# Small budgets: with nothing to recover, no budget recovers more (the argument above);
# they keep the test to minutes on two cores. Recorded in every record's E.B.
BUDGET = {"candidates": 8, "c_a": 4, "c_g": 4, "beam_width": 2, "likelihood_candidates": 8,
          "sip_epochs": 1, "sip_hidden": 16, "eia_steps": 5, "eia_mapper": False,
          "bisr_f_steps": 5, "bisr_f_decode": "nearest", "sipit_max_iters": 4,
          "sipit_refine_iters": 2, "sipit_brute_force_inexact": False}


def fitting_attacks() -> list[str]:
  """PROTOCOL 5a on this capture, from the declarations: every registered attack (not a
  negative control, passive tier) whose observations the capture holds (activations
  only: an inference capture), that runs under public knowledge, and that is generic or
  adapts to the Gaussian mechanism."""
  out = []
  for m in registry.module_entries():
    if (m["role"] != "negative_control" and m["tier"] == "passive"
        and set(m["requires"]) <= {"activations"} and "public" in m["knowledge"]
        and (not m["adapts_to"] or "gaussian" in m["adapts_to"])):
      out.append(m["name"])
  return sorted(out)


def env() -> dict:
  return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))


def cli(*args) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, "-m", *args], cwd=REPO, env=env(), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(proc: subprocess.Popen, timeout=600) -> None:
  out, err = proc.communicate(timeout=timeout)
  assert proc.returncode == 0, f"{proc.args}\n{out[-2000:]}\n{err[-4000:]}"


def capture_args(root, m, defended_: bool) -> list[str]:
  args = ["experiments.capture", "--config=configs/capture.py", f"--config.cut={K}",
          "--config.training=False", "--config.batch_size=16",
          f"--config.model.hf_dir={root / f'hf{m}'}",
          f"--config.data.tokens_npy={root / f'docs{m}.npy'}"]
  if defended_:
    args += [f"--config.defense.name={DEFENSE['name']}",
             f"--config.defense.sigma={DEFENSE['sigma']}",
             f"--config.defense.clip_norm={DEFENSE['clip_norm']}",
             f"--config.defense.secret_seed={9000 + m}"]
  return args + [f"--workdir={root / ('gauss' if defended_ else 'none') / f'm{m}'}"]


def replay(root, m, capture: str, attacks: list[str], prefix: str, *extra) -> None:
  budget = [f"--config.budget.{k}={v}" for k, v in BUDGET.items()
            if any(k in registry.get(a).spec.budget_fields for a in attacks)]
  finish(cli("experiments.replay", "--config=configs/replay.py",
             f"--config.capture_dir={root / capture / f'm{m}'}",
             f"--config.attacker.hf_dir={root / f'hf{m}'}",
             f"--config.calibration.tokens_npy={root / 'cal.npy'}",
             f"--config.attacks={','.join(attacks)}", f"--config.model_seed={m}",
             f"--config.run_prefix={prefix}", *budget, *extra, f"--workdir={root / 'study'}"))


@pytest.fixture(scope="module")
def study(tmp_path_factory):
  start = time.perf_counter()
  root = tmp_path_factory.mktemp("real_pass")
  rng = np.random.default_rng(2024)
  np.save(root / "cal.npy", rng.integers(0, CFG.vocab_size, (N_CAL, T)).astype(np.int32))
  for m in MODEL_SEEDS:
    hf_io.save_hf_dir(random_params(CFG, seed=500 + m, std=0.05), CFG, root / f"hf{m}")
    np.save(root / f"docs{m}.npy", rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32))
  jobs = [capture_args(root, m, d) for m in MODEL_SEEDS for d in (False, True)]
  for pair in (jobs[i:i + 2] for i in range(0, len(jobs), 2)):  # two at a time: two cores
    for proc in [cli(*args) for args in pair]:
      finish(proc)
  pol = policy_lib.load_policy()
  rundir.create_study(str(root / "study"), {"G": {"policy": pol.policy_id,
                                                  "policy_sha256": pol.sha256}})
  fitting = fitting_attacks()
  unaware = [a for a in fitting if not registry.get(a).spec.defense_aware]
  for m in MODEL_SEEDS:
    replay(root, m, "none", ["activation"], f"none/m{m}/")
    replay(root, m, "gauss", unaware, f"gauss/m{m}/", f"--config.reference_prefix=none/m{m}/")
  missing = scorecard.build(str(root / "study"), pol, contrasts=False)
  for m in MODEL_SEEDS:
    replay(root, m, "gauss", [AWARE], f"gauss/m{m}/", f"--config.reference_prefix=none/m{m}/",
           f"--config.calibration_defense_seed={m}")
  full = scorecard.build(str(root / "study"), pol, contrasts=False)
  return root, fitting, missing, full, time.perf_counter() - start


def wilson_upper(hits: int, n: int) -> float:
  """PROTOCOL 5's one-sided Wilson upper bound at z = 2.5392: scipy's Wilson interval."""
  return binomtest(hits, n, alternative="less").proportion_ci(
      confidence_level=norm.cdf(Z), method="wilson").high


def by_hand(root: pathlib.Path, attacks: list[str]) -> dict:
  """Envelope, floor, seeds and positive control from the predictions and truth files."""
  truth = {m: load_file(str(root / "gauss" / f"m{m}" / "truth.safetensors"))["tokens"]
           for m in MODEL_SEEDS}
  records = {r.run_id: r for r in rundir.load_records(str(root / "study"))}
  excess, floor, seeds = {}, {}, {}
  for a in attacks:
    hits = base = n = 0
    for m in MODEL_SEEDS:
      r = records.get(f"gauss/m{m}/{a}")
      if r is None or r.status != "ok":
        continue
      pred = np.load(root / "study" / r.prediction_file)
      first = 0 if r.scored_positions == "all" else 1
      hits += int((pred[:, first:] == truth[m][:, first:]).sum())
      base += int((truth[m][:, first:] == r.baseline_token).sum())
      n += truth[m][:, first:].size
      seeds.setdefault(a, set()).add(m)
    if n:
      excess[a] = 100 * (wilson_upper(hits, n) - base / n)
      floor[a] = 100 * (wilson_upper(base, n) - base / n)
  control_hits = control_n = control_base = 0
  for m in MODEL_SEEDS:
    r = records[f"none/m{m}/activation"]
    t = load_file(str(root / "none" / f"m{m}" / "truth.safetensors"))["tokens"]
    control_hits += int((np.load(root / "study" / r.prediction_file) == t).sum())
    control_base += int((t == r.baseline_token).sum())
    control_n += t.size
  return {"excess": excess, "envelope": max(excess.values()),
          "argmax": max(excess, key=excess.get), "floor": max(floor.values()),
          "seeds": min(len(s) for s in seeds.values()),
          "measured": sorted(a for a in attacks if len(seeds.get(a, ())) == len(MODEL_SEEDS)),
          "control": 100 * (wilson_upper(control_hits, control_n) - control_base / control_n)}


def decide(figures: dict, fitting: list[str]) -> str:
  """PROTOCOL 5 and 5a: PASS needs envelope <= 1 pp, floor <= 1 pp, >= 3 seeds, a positive
  control > 1 pp and every fitting attack measured; an envelope above 1 pp with the rest
  met is FAIL; anything else INSUFFICIENT_EVIDENCE."""
  ready = (figures["seeds"] >= MIN_SEEDS and figures["control"] > CONTROL_PP
           and figures["floor"] <= THRESHOLD_PP)
  if ready and figures["envelope"] > THRESHOLD_PP:
    return "FAIL"
  if ready and figures["measured"] == fitting:
    return "PASS"
  return "INSUFFICIENT_EVIDENCE"


def test_the_defended_message_is_a_function_of_the_secret_alone(study):
  root = study[0]
  for m in MODEL_SEEDS:
    stored = load_file(str(root / "gauss" / f"m{m}" / "messages.safetensors"))["activations"]
    params, cfg = hf_io.load_hf_dir(root / f"hf{m}")
    other = np.random.default_rng(m).integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    h, _ = defended.batched_messages(
        params, cfg, other, K, defenses.make("gaussian", sigma=DEFENSE["sigma"],
                                             clip_norm=DEFENSE["clip_norm"]),
        defenses.Secret.explicit(9000 + m), 16, training=False)
    assert np.array_equal(stored, h)  # other documents, the same bits


def test_every_fitting_attack_measured_gives_pass(study):
  root, fitting, _, card, seconds = study
  assert AWARE in fitting and "gaussian_adaptive" in fitting and "activation" in fitting
  figures = by_hand(root, fitting)
  expected = decide(figures, fitting)
  assert expected == "PASS", figures
  gate, = card["gates"]
  assert gate["decision"] == expected, gate["reasons"]
  assert gate["envelope"]["envelope_pp"] == pytest.approx(figures["envelope"], abs=1e-9)
  assert gate["envelope"]["floor_pp"] == pytest.approx(figures["floor"], abs=1e-9)
  assert gate["envelope"]["argmax"] == figures["argmax"]
  assert gate["n_seeds"] == figures["seeds"] == 3
  assert sorted(gate["pooled"]) == fitting  # every fitting attack measured, nothing else
  for a, value in figures["excess"].items():
    assert gate["pooled"][a]["excess_pp"] == pytest.approx(value, abs=1e-9)
  assert figures["control"] > CONTROL_PP
  assert gate["positive_controls"]["beam_inversion"]["ok"]
  print(f"\nreal-capture PASS in {seconds:.0f} s: envelope {figures['envelope']:+.3f} pp "
        f"({figures['argmax']}), floor {figures['floor']:.3f} pp, {figures['seeds']} seeds, "
        f"control {figures['control']:+.1f} pp; measured: {', '.join(fitting)}")


def test_one_fitting_attack_left_out_gives_insufficient_evidence_naming_it(study):
  root, fitting, card, _, _ = study
  present = [a for a in fitting if a != AWARE]
  figures = by_hand(root, present)
  figures["measured"] = present
  assert decide(figures, fitting) == "INSUFFICIENT_EVIDENCE"
  gate, = card["gates"]
  assert gate["decision"] == "INSUFFICIENT_EVIDENCE"
  assert gate["envelope"]["envelope_pp"] == pytest.approx(figures["envelope"], abs=1e-9)
  assert figures["envelope"] <= THRESHOLD_PP and figures["floor"] <= THRESHOLD_PP
  named = [r for r in gate["reasons"] if "fitting attack(s) unmeasured: " in r]
  assert named, gate["reasons"]
  # It names the one left out, and only it: "fitting attack(s) unmeasured: NAME (not run)".
  assert re.findall(r"(\w+) \(", named[0].split("unmeasured: ", 1)[1]) == [AWARE], named
  print(f"\nwithout {AWARE}: {gate['decision']} (envelope {figures['envelope']:+.3f} pp, "
        f"floor {figures['floor']:.3f} pp): {named[0]}")
