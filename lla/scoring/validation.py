"""Validation of the measurement itself: the case list run by
experiments/validate_measurement.py and by tests/test_scoring_validation.py.

Kinds: `known-answer` (values worked out by hand in the case text),
`recomputation` (an independent method: scipy root finding, brute-force
loops), `fault-injection` (corrupted files, crashed modules, missing controls,
too few seeds, tampered logs) and `metamorphic` (relabelling that must not
change a score).
"""

import dataclasses
import math
import os
import shutil
import tempfile
from typing import Any, Callable

import numpy as np
import scipy.optimize
import scipy.stats

from lla.evidence import files
from lla.evidence import hashlog
from lla.evidence import manifest
from lla.evidence import rundir
from lla.scoring import bootstrap
from lla.scoring import coverage
from lla.scoring import gates
from lla.scoring import metrics
from lla.scoring import policy as policy_lib
from lla.scoring import scorecard
from lla.scoring import synthetic as syn
from lla.evidence.records import AttackRecord

Z = metrics.DEFAULT_Z
Z2 = Z * Z  # 6.44753664
DEFENSE = "mixup"
SPACE = coverage.ThreatSpace(
    families=("beam_inversion",),
    observations=("activations", "activations+gradients"),
    knowledge=("public",), defenses=("none", DEFENSE))
MODULES = [
    {"name": "activation", "family": "beam_inversion",
     "observations": ["activations"]},
    {"name": "joint", "family": "beam_inversion",
     "observations": ["activations", "gradients"]},
    # PROTOCOL section 5a: a defense PASSes only against an attack adapted to it.
    {"name": "mixup_adaptive", "family": "beam_inversion",
     "observations": ["activations"], "adapts_to": [DEFENSE]},
]


@dataclasses.dataclass(frozen=True)
class Case:
  """One validation case; passes when fn(ctx) equals `expected` (floats: tol)."""
  name: str
  kind: str
  expected: Any
  fn: Callable[["Context"], Any]
  tol: float = 1e-12


def standard_specs(seeds=(0, 1, 2), undefended=(30, 31),
                   defended=(1, 0)) -> list[syn.Spec]:
  """Undefended activation/joint and a defended pair, per model seed.

  Hits per document are fixed (no jitter) so counts are known by hand: 64
  documents x 32 tokens = 2,048 tokens per run.
  """
  out = []
  for m in seeds:
    out += [syn.Spec("activation", "beam_inversion", undefended[0], m),
            syn.Spec("joint", "beam_inversion", undefended[1], m),
            syn.Spec("activation", "beam_inversion", defended[0], m,
                     defense=DEFENSE),
            syn.Spec("joint", "beam_inversion", defended[1], m,
                     defense=DEFENSE),
            syn.Spec("mixup_adaptive", "beam_inversion", 0, m,
                     defense=DEFENSE)]
  return out


class Context:
  """Temporary directory, policy and cached synthetic runs for the cases."""

  def __init__(self, tmp: str):
    self.tmp = tmp
    self.policy = policy_lib.load_policy()
    self.truth = syn.truth_tokens(docs=64)
    self.cap = os.path.join(tmp, "cap")
    syn.make_capture(self.cap, self.truth)
    self._runs = {}
    self._cards = {}

  def run(self, name: str, specs=None, **kw) -> str:
    """A finished synthetic run in tmp/<name> (built once per name)."""
    if name not in self._runs:
      path = os.path.join(self.tmp, name)
      syn.make_run(path, self.cap, specs or standard_specs(),
                   kw.pop("policy_sha256", self.policy.sha256), **kw)
      self._runs[name] = path
    return self._runs[name]

  def copy(self, name: str, new: str) -> str:
    dst = os.path.join(self.tmp, new)
    shutil.copytree(self.run(name), dst)
    return dst

  def card(self, run: str, pol=None, contrasts: bool = False, **kw) -> dict:
    """The scorecard of `run`, cached: runs are never modified once scored.

    The 100,000-replicate bootstrap runs only where a case checks contrasts.
    """
    key = (run, id(pol), contrasts, repr(sorted(kw.items())))
    if key not in self._cards:
      self._cards[key] = scorecard.build(run, pol or self.policy, SPACE,
                                         MODULES, contrasts=contrasts, **kw)
    return self._cards[key]

  def gate(self, run: str, pol=None) -> dict:
    (g,) = self.card(run, pol)["gates"]
    return g


def _wilson_brentq(s: int, n: int, z: float) -> float:
  """Upper root of the score test (p_hat - p)^2 = z^2 p (1 - p) / n."""
  ph = s / n
  if s == n:
    return 1.0
  f = lambda p: (ph - p) ** 2 - z * z * p * (1 - p) / n
  # At s = 0 the lower root is p_hat = 0 itself; start just above it.
  return scipy.optimize.brentq(f, ph if s else 1e-300, 1.0, xtol=1e-15,
                               rtol=1e-15)


def _first(problems, needle):
  hits = [p for p in problems if needle in p]
  return hits[0] if hits else f"no problem mentions {needle!r}: {problems}"


def _rewrite_log(run: str, edit: Callable[[list[bytes]], list[bytes]]) -> list:
  path = os.path.join(run, rundir.LOG)
  with open(path, "rb") as f:
    lines = f.read().split(b"\n")[:-1]
  with open(path, "wb") as f:
    f.write(b"".join(l + b"\n" for l in edit(lines)))
  return list(hashlog.verify_log(path).problems)


def jittered_specs() -> list[syn.Spec]:
  """standard_specs with per-document hit counts varying by up to +-3."""
  return [dataclasses.replace(s, jitter=3) for s in standard_specs()]


def _transformed_run(ctx: Context, name: str, doc_perm=None,
                     model_map=None, file_prefix="", source="base") -> str:
  """Rewrites a run with documents permuted and/or models relabelled."""
  base = ctx.run(source)
  truth = ctx.truth if doc_perm is None else ctx.truth[doc_perm]
  cap = os.path.join(ctx.tmp, name + "_cap")
  syn.make_capture(cap, truth)
  run = os.path.join(ctx.tmp, name)
  protocol = files.read_json(os.path.join(base, rundir.PROTOCOL))
  rundir.create(run, protocol, time=syn.RUN_TIME)
  cap_sha = files.sha256_file(os.path.join(cap, manifest.MANIFEST_NAME))
  for i, r in enumerate(rundir.load_records(base)):
    fname = f"{file_prefix}{i:03d}"
    pred = rundir.load_predictions(rundir.resolve(base, r.prediction_file))
    rel, sha = rundir.save_predictions(
        run, fname, pred if doc_perm is None else pred[doc_perm])
    m = r.model_seed if model_map is None else model_map[r.model_seed]
    rundir.save_record(run, fname, dataclasses.replace(
        r, capture_dir=os.path.relpath(cap, run), capture_sha256=cap_sha,
        truth_file=os.path.relpath(os.path.join(cap, "truth.safetensors"),
                                   run),
        prediction_file=rel, prediction_sha256=sha, model_seed=m,
        model_id=f"synthetic-model-{m}"))
  rundir.finalize(run, time=syn.RUN_TIME)
  return run


def _policy_copy(ctx: Context, created: str) -> policy_lib.Policy:
  d = os.path.join(ctx.tmp, f"policy_{created}")
  os.makedirs(d, exist_ok=True)
  raw = dict(ctx.policy.raw, created=created)
  path = os.path.join(d, "scorecard-policy.v3.json")
  files.atomic_write_json(path, raw, overwrite=True)
  return policy_lib.load_policy(path)


def _gate_summary(g: dict) -> tuple:
  return (g["decision"], g["envelope"], g["pooled"], g["n_seeds"])


def cases() -> list[Case]:
  """The full validation case list."""
  ka, rc, fi, mm = ("known-answer", "recomputation", "fault-injection",
                    "metamorphic")
  pol = policy_lib.load_policy()
  rng = np.random.default_rng(7)
  small_d = rng.integers(-2, 5, size=(4, 9)).astype(np.float64)
  return [
      # --- known answers, worked by hand (z = 2.5392, z^2 = 6.44753664) ---
      Case("wilson U(0 of 100): p=0 gives z^2/(n+z^2) = 6.44753664/106.44753664",
           ka, 0.06057008779644411, lambda c: metrics.wilson_upper(0, 100)),
      Case("wilson U(100 of 100): p=1 gives (1+z^2/n)/(1+z^2/n) = 1", ka, 1.0,
           lambda c: metrics.wilson_upper(100, 100)),
      Case("wilson U(50 of 100) = (0.5 + 0.0322376832 + 2.5392*sqrt(0.0025 + "
           "0.000161188416)) / 1.0644753664 = 0.6632266515/1.0644753664",
           ka, 0.6230549549961766, lambda c: metrics.wilson_upper(50, 100)),
      Case("wilson U(1 of 4) = (0.25 + 0.80594208 + 2.5392*sqrt(0.046875 + "
           "0.10074276)) / 2.61188416 = 2.03152955/2.61188416", ka,
           0.7778023173912849, lambda c: metrics.wilson_upper(1, 4)),
      Case("floor p0=0, n=8192 (one seed of 256 x 32) = 100 z^2/(8192+z^2) pp",
           ka, 0.07864338475284575, lambda c: metrics.floor_pp(0.0, 8192)),
      Case("excess of 0/100 with p0=0 = 100 * 0.0605700878 pp", ka,
           6.057008779644411, lambda c: metrics.excess_pp(0, 100, 0.0)),
      Case("envelope of excess {a: 3, b: 5, c: -1} is 5 at b", ka, (5, "b"),
           lambda c: _env({"a": 3, "b": 5, "c": -1})),
      Case("token recovery [[1,2,3],[4,5,6]] vs [[1,2,0],[4,5,6]]: 5/6 tokens, "
           "1/2 documents; t>=1: 3/4 tokens", ka, ((5, 6), (1, 2), (3, 4)),
           lambda c: _hand_recovery()),
      Case("after a BOS: truth [[9,2,3],[9,5,6]], predictions [[0,2,3],[9,5,0]]: "
           "after_bos 3/4 tokens, 1/2 documents (position 0 unscored)", ka,
           ((3, 4), (1, 2)), lambda c: _hand_after_bos()),
      Case("baseline p0 of token 7 on [[7,7,1],[7,2,7]]: all 4/6, t>=1 2/4", ka,
           ((4, 6), (2, 4)), lambda c: _hand_baseline()),
      Case("gate rule: envelope 0.5, floor 0.2, 3 seeds, control -> PASS", ka,
           gates.PASS, lambda c: gates.decide(0.5, 0.2, 3, True, pol)[0]),
      Case("gate rule: envelope exactly 1.0 pp (<= 1.0) -> PASS", ka, gates.PASS,
           lambda c: gates.decide(1.0, 0.2, 3, True, pol)[0]),
      Case("gate rule: envelope 1.01 pp, 3 seeds, control -> FAIL", ka,
           gates.FAIL, lambda c: gates.decide(1.01, 0.2, 3, True, pol)[0]),
      Case("gate rule: floor 1.2 pp > 1.0 -> INSUFFICIENT_EVIDENCE even with "
           "envelope 5 pp", ka, gates.INSUFFICIENT,
           lambda c: gates.decide(5.0, 1.2, 3, True, pol)[0]),
      Case("synthetic run: defended activation pooled over 3 seeds = 1 hit x 64"
           " docs x 3 = 192 of 3 x 2048 = 6144", ka, (192, 6144),
           lambda c: _pooled(c.gate(c.run("base")), "activation")),
      Case("synthetic run: undefended joint exact documents = 0 (31 of 32 "
           "right per doc)", ka, 0,
           lambda c: c.card(c.run("base"))["undefended"][0]["pooled"]["joint"]
           ["docs_exact"]),
      Case("synthetic run with a clean defense (1 and 0 hits/doc, p0 ~ 5.6%) "
           "-> PASS", ka, gates.PASS,
           lambda c: c.gate(c.run("base"))["decision"]),
      Case("synthetic run: primary test joint - activation = (31-30)/32 = "
           "+3.125 pp, interval degenerate", ka, (3.125, 3.125, 3.125, True),
           lambda c: _primary(c.card(c.run("base"), contrasts=True))),
      # --- independent recomputation ---
      Case("wilson formula vs brentq root of the score-test quadratic, "
           "max |diff| over ~120 (s, n) pairs, n = 1..24576, < 1e-12", rc, True,
           lambda c: _wilson_vs_brentq() < 1e-12),
      Case("z = 2.5392 is Phi^-1(1 - 0.05/9) (scipy) to 4 decimals", rc, 2.5392,
           lambda c: round(float(scipy.stats.norm.ppf(1 - 0.05 / 9)), 4)),
      Case("floor = 100(U(p0)-p0) vs brentq for p0 = 1000/8192", rc, True,
           lambda c: abs(metrics.floor_pp(1000 / 8192, 8192) - 100 * (
               _wilson_brentq(1000, 8192, Z) - 1000 / 8192)) < 1e-9),
      Case("bootstrap w_m^T D w_n / MN vs slow gather loop on the same 500 "
           "draws (4 x 9)", rc, True,
           lambda c: _fast_vs_slow(small_d)),
      Case("bootstrap 95% interval vs an independent slow loop (own RNG, "
           "4000 replicates): ends within 0.15", rc, True,
           lambda c: _interval_vs_slow(small_d)),
      Case("bootstrap of constant D = 0.7 gives [0.7, 0.7]", rc, (0.7, 0.7),
           lambda c: _const_interval()),
      Case("bonferroni: 3 contrasts -> each at 1 - 0.05/3, ends equal numpy "
           "percentiles 0.8333 / 99.1667 of the replicates", rc, True,
           lambda c: _bonferroni_check(small_d)),
      Case("token / exact-document recovery vs python loops on random "
           "[20, 16] arrays, both position sets", rc, True,
           lambda c: _recovery_vs_loop()),
      Case("pooled counts across seeds = counts of the concatenated arrays", rc,
           True, lambda c: _pool_vs_concat()),
      Case("scorecard U of a defended row vs brentq on its own counts", rc, True,
           lambda c: _row_vs_brentq(c)),
      # --- fault injection ---
      Case("clean synthetic run verifies", fi, [],
           lambda c: rundir.verify(c.run("base"))),
      Case("corrupted predictions -> verify names the file", fi,
           "manifest.sha256: changed: predictions/k6__public__mixup__m0__s0__"
           "activation.npy", lambda c: _corrupt_prediction(c)),
      Case("corrupted predictions -> scoring refuses, naming the file", fi,
           True, lambda c: _score_corrupt(c)),
      Case("deleted record -> verify names it missing", fi,
           "manifest.sha256: missing: records/k6__public__none__m1__s0__"
           "joint.json", lambda c: _delete_record(c)),
      Case("extra file -> verify names it", fi, "manifest.sha256: extra: "
           "notes.txt", lambda c: _extra_file(c)),
      Case("crashed module -> unmeasured cell, no metrics, not in the envelope",
           fi, ("unmeasured", None, ["activation", "mixup_adaptive"]),
           lambda c: _crashed(c)),
      Case("defense without a positive control (reference at 0 hits) -> "
           "INSUFFICIENT_EVIDENCE", fi, gates.INSUFFICIENT,
           lambda c: c.gate(c.run("weakref", standard_specs(
               undefended=(0, 0))))["decision"]),
      Case("two seeds instead of three -> INSUFFICIENT_EVIDENCE naming seeds",
           fi, (gates.INSUFFICIENT, "2 independent seed(s), policy needs >= 3"),
           lambda c: _two_seeds(c)),
      Case("floor above 1 pp (4 documents) -> INSUFFICIENT_EVIDENCE", fi, True,
           lambda c: _tiny_floor(c)),
      Case("explicit reference that is itself defended -> rejected, "
           "INSUFFICIENT_EVIDENCE", fi, (gates.INSUFFICIENT, True),
           lambda c: _defended_reference(c)),
      Case("policy created after the run -> flagged, PASS withheld", fi,
           (gates.INSUFFICIENT, True), lambda c: _late_policy(c)),
      Case("run recorded another policy hash -> flagged", fi, True,
           lambda c: any("recorded policy" in f for f in c.card(
               c.run("otherpolicy", policy_sha256="f" * 64))["policy"]
                         ["flags"])),
      Case("tampered log: entry edited -> located at line 2", fi,
           "line 2: entry 1 edited (its hash does not match its contents)",
           lambda c: _log_edit(c)),
      Case("tampered log: entry deleted -> located at line 3", fi,
           "line 3: entries 2 deleted before entry 3",
           lambda c: _rewrite_log(c.copy("base", "log_del"),
                                  lambda l: l[:2] + l[3:])[0]),
      Case("tampered log: two entries swapped -> located at line 2", fi,
           "line 2: entry 2 out of order: entry 1 appears elsewhere (reordered)",
           lambda c: _rewrite_log(c.copy("base", "log_swap"),
                                  lambda l: [l[0], l[2], l[1]] + l[3:])[0]),
      Case("tampered log: tail truncated -> unsealed", fi, True,
           lambda c: "not sealed" in _rewrite_log(
               c.copy("base", "log_trunc"), lambda l: l[:-2])[-1]),
      Case("record with an unknown field -> error naming the file", fi, True,
           lambda c: _bad_record(c)),
      Case("re-scoring reproduces the written scorecard byte for byte", fi,
           True, lambda c: _rescore_bytes(c)),
      # --- metamorphic ---
      Case("permuting documents leaves the whole scorecard, bootstrap "
           "included, byte-identical", mm, True,
           lambda c: scorecard.to_bytes(c.card(c.run("jitter", jittered_specs(
           )), contrasts=True)) == scorecard.to_bytes(c.card(_transformed_run(
               c, "docperm", doc_perm=np.random.default_rng(3).permutation(64),
               source="jitter"), contrasts=True))),
      Case("relabelling models (0<->2) leaves gates and contrasts unchanged",
           mm, True, lambda c: _model_relabel(c)),
      Case("renaming/reordering record files leaves the scorecard identical",
           mm, True, lambda c: scorecard.to_bytes(c.card(c.run("base"))) ==
           scorecard.to_bytes(c.card(_transformed_run(c, "renamed",
                                                      file_prefix="z")))),
      Case("swapping attack order leaves the envelope unchanged", mm, True,
           lambda c: _env({"a": 2.0, "b": 2.0, "c": 1.0}) ==
           _env({"c": 1.0, "b": 2.0, "a": 2.0})),
      Case("adding a weaker attack leaves the envelope unchanged", mm, True,
           lambda c: _env({"a": 3.0, "b": 1.0}) ==
           _env({"a": 3.0, "b": 1.0, "weak": -4.0})),
      Case("one more hit never lowers U (n = 50, s = 0..49)", mm, True,
           lambda c: bool(np.all(np.diff(metrics.wilson_upper(
               np.arange(51), 50)) > 0))),
      Case("a weak reference cannot make a defense pass; sensitivity names the"
           " strong one", mm, (gates.INSUFFICIENT, True),
           lambda c: _weak_explicit_reference(c)),
  ]


def _env(excess: dict) -> tuple:
  e = metrics.envelope({k: {"excess_pp": v, "floor_pp": 0.0}
                        for k, v in excess.items()})
  return e["envelope_pp"], e["argmax"]


def _hand_recovery():
  t = np.array([[1, 2, 3], [4, 5, 6]])
  p = np.array([[1, 2, 0], [4, 5, 6]])
  return (metrics.token_recovery(p, t), metrics.exact_document_recovery(p, t),
          metrics.token_recovery(p, t, "t>=1"))


def _hand_after_bos():
  t = np.array([[9, 2, 3], [9, 5, 6]])
  p = np.array([[0, 2, 3], [9, 5, 0]])
  return (metrics.token_recovery(p, t, "after_bos"),
          metrics.exact_document_recovery(p, t, "after_bos"))


def _hand_baseline():
  t = np.array([[7, 7, 1], [7, 2, 7]])
  return metrics.baseline_hits(t, 7), metrics.baseline_hits(t, 7, "t>=1")


def _pooled(g, attack):
  return g["pooled"][attack]["hits"], g["pooled"][attack]["n"]


def _primary(card):
  (p,) = card["contrasts"]["primary"]
  return p["estimate"], p["lo"], p["hi"], p["passed"]


def _wilson_vs_brentq() -> float:
  worst = 0.0
  for n in (1, 2, 5, 17, 100, 2048, 8192, 24576):
    for s in sorted({0, 1, n // 3, n // 2, n - 1, n} | set(
        np.random.default_rng(n).integers(0, n + 1, 19).tolist())):
      worst = max(worst, abs(metrics.wilson_upper(s, n) -
                             _wilson_brentq(s, n, Z)))
  return worst


def _fast_vs_slow(d) -> bool:
  mi, ni = bootstrap.draw_indices(np.random.default_rng(11), 500, *d.shape)
  slow = np.array([d[np.ix_(a, b)].mean() for a, b in zip(mi, ni)])
  return bool(np.allclose(bootstrap.replicate_means(d, mi, ni), slow,
                          rtol=0, atol=1e-12))


def _interval_vs_slow(d) -> bool:
  res = bootstrap.interval(d, 0.95, n_replicates=20000)
  rng = np.random.default_rng(2024)
  m, n = d.shape
  slow = [d[np.ix_(rng.integers(0, m, m), rng.integers(0, n, n))].mean()
          for _ in range(4000)]
  lo, hi = np.percentile(slow, [2.5, 97.5])
  return bool(abs(lo - res["lo"]) < 0.15 and abs(hi - res["hi"]) < 0.15)


def _const_interval():
  r = bootstrap.interval(np.full((3, 5), 0.7), n_replicates=1000)
  return round(r["lo"], 12), round(r["hi"], 12)


def _bonferroni_check(d) -> bool:
  res = bootstrap.bonferroni({"a": d, "b": -d, "c": 2 * d}, 0.95,
                             n_replicates=3000)
  reps = bootstrap.replicates(d, 3000)
  lo, hi = np.percentile(reps, [100 * 0.05 / 6, 100 * (1 - 0.05 / 6)])
  return bool(math.isclose(res["a"]["confidence"], 1 - 0.05 / 3) and
              res["a"]["lo"] == lo and res["a"]["hi"] == hi)


def _recovery_vs_loop() -> bool:
  rng = np.random.default_rng(5)
  t = rng.integers(0, 4, (20, 16))
  p = np.where(rng.random((20, 16)) < 0.8, t, rng.integers(0, 4, (20, 16)))
  ok = True
  for pos, start in (("all", 0), ("t>=1", 1)):
    hits = sum(int(p[i, j] == t[i, j]) for i in range(20)
               for j in range(start, 16))
    docs = sum(all(p[i, j] == t[i, j] for j in range(start, 16))
               for i in range(20))
    ok &= metrics.token_recovery(p, t, pos) == (hits, 20 * (16 - start))
    ok &= metrics.exact_document_recovery(p, t, pos) == (docs, 20)
  return bool(ok)


def _pool_vs_concat() -> bool:
  rng = np.random.default_rng(9)
  ts = [rng.integers(0, 5, (8, 6)) for _ in range(3)]
  ps = [np.where(rng.random(t.shape) < 0.5, t, 0) for t in ts]
  pooled = sum((metrics.count(p, t, 0, "t>=1") for p, t in zip(ps, ts)),
               metrics.Counts(0, 0, 0, 0, 0))
  direct = metrics.count(np.concatenate(ps), np.concatenate(ts), 0, "t>=1")
  return pooled == direct


def _row_vs_brentq(c) -> bool:
  row = next(r for r in c.card(c.run("base"))["rows"]
             if r["defense"] == DEFENSE)["metrics"]
  return abs(row["wilson_upper"] - _wilson_brentq(row["hits"], row["n"], Z)
             ) < 1e-12


def _corrupt_prediction(c):
  run = c.copy("base", "corrupt")
  path = os.path.join(run, "predictions",
                      "k6__public__mixup__m0__s0__activation.npy")
  data = bytearray(open(path, "rb").read())
  data[-1] ^= 1
  open(path, "wb").write(bytes(data))
  return _first(rundir.verify(run), "changed")


def _score_corrupt(c) -> bool:
  run = os.path.join(c.tmp, "corrupt")
  if not os.path.exists(run):
    _corrupt_prediction(c)
  try:
    c.card(run)
  except ValueError as e:
    return "k6__public__mixup__m0__s0__activation.npy" in str(e)
  return False


def _delete_record(c):
  run = c.copy("base", "delrec")
  os.remove(os.path.join(run, "records", "k6__public__none__m1__s0__joint.json"))
  return _first(rundir.verify(run), "missing")


def _extra_file(c):
  run = c.copy("base", "extra")
  open(os.path.join(run, "notes.txt"), "w").write("edited by hand\n")
  return _first(rundir.verify(run), "extra")


def _crashed(c):
  specs = standard_specs()
  specs = [dataclasses.replace(s, status="crashed")
           if s.defense == DEFENSE and s.attack == "joint" else s
           for s in specs]
  card = c.card(c.run("crashed", specs))
  cell = next(x for x in card["coverage"]["cells"]
              if x["defense"] == DEFENSE and "gradients" in x["observation"])
  row = next(r for r in card["rows"] if r["status"] == "crashed")
  return cell["status"], row["metrics"], sorted(card["gates"][0]["pooled"])


def _two_seeds(c):
  g = c.gate(c.run("twoseeds", standard_specs(seeds=(0, 1))))
  return g["decision"], g["reasons"][0]


def _tiny_floor(c) -> bool:
  cap = os.path.join(c.tmp, "tinycap")
  syn.make_capture(cap, syn.truth_tokens(docs=4, seq_len=8))
  run = os.path.join(c.tmp, "tiny")
  syn.make_run(run, cap, standard_specs(undefended=(8, 8), defended=(0, 0)),
               c.policy.sha256)
  g = c.gate(run)
  return (g["decision"] == gates.INSUFFICIENT and g["envelope"]["floor_pp"] > 1
          and any("makes PASS impossible" in r for r in g["reasons"]))


def _defended_reference(c):
  specs = [dataclasses.replace(
      s, reference=f"k6/public/{DEFENSE}/m{s.model_seed}/s0/joint")
           if s.defense == DEFENSE and s.attack == "activation" else s
           for s in standard_specs()]
  specs = [dataclasses.replace(s, reference=(
      f"k6/public/{DEFENSE}/m{s.model_seed}/s0/activation"))
           if s.defense == DEFENSE and s.attack in ("joint", "mixup_adaptive")
           else s for s in specs]
  g = c.gate(c.run("defref", specs))
  return g["decision"], any("is defended" in p for l in g["links"]
                            for p in l["problems"])


def _late_policy(c):
  late = _policy_copy(c, "2027-01-01")
  run = c.run("latepolicy", policy_sha256=late.sha256)
  g = c.gate(run, late)
  return g["decision"], any("after the run started" in r
                            for r in g["reasons"])


def _log_edit(c):
  def edit(lines):
    lines[1] = lines[1].replace(b'"predictions"', b'"prediction5"')
    return lines
  return _rewrite_log(c.copy("base", "log_edit"), edit)[0]


def _bad_record(c) -> bool:
  path = os.path.join(c.tmp, "bad_record.json")
  rec = files.read_json(next(
      os.path.join(c.run("base"), "records", f) for f in sorted(
          os.listdir(os.path.join(c.run("base"), "records")))))
  rec["surprise"] = 1
  files.atomic_write_json(path, rec, overwrite=True)
  try:
    AttackRecord.load(path)
  except ValueError as e:
    return path in str(e) and "surprise" in str(e)
  return False


def _rescore_bytes(c) -> bool:
  run = c.copy("base", "rescore")
  card = c.card(run, contrasts=True)
  rundir.reopen(run)
  scorecard.write(run, card)
  rundir.finalize(run)
  again = scorecard.build_from_inputs(run, card["inputs"], c.policy)
  with open(os.path.join(run, rundir.SCORECARD_JSON), "rb") as f:
    return f.read() == scorecard.to_bytes(again) and rundir.verify(run) == []


def _model_relabel(c) -> bool:
  a = c.card(c.run("jitter", jittered_specs()), contrasts=True)
  b = c.card(_transformed_run(c, "relabel", model_map={0: 2, 1: 1, 2: 0},
                              source="jitter"), contrasts=True)
  lo, hi = a["contrasts"]["primary"][0]["lo"], a["contrasts"]["primary"][0]["hi"]
  if lo == hi:
    return "degenerate interval: the case would test nothing"
  return (_gate_summary(a["gates"][0]) == _gate_summary(b["gates"][0]) and
          a["contrasts"] == b["contrasts"] and a["undefended"] == b["undefended"])


def _weak_explicit_reference(c):
  """Undefended 'activation' at 0 hits (weak) and 'joint' at 31 (strong).

  Every defended run (each fitting attack) links explicitly to the weak
  activation reference only, so only the weak reference counts.
  """
  specs = []
  for m in (0, 1, 2):
    specs += [syn.Spec("activation", "beam_inversion", 0, m),
              syn.Spec("joint", "beam_inversion", 31, m)]
    specs += [syn.Spec(a, "beam_inversion", 0, m, defense=DEFENSE,
                       reference=f"k6/public/none/m{m}/s0/activation")
              for a in ("activation", "joint", "mixup_adaptive")]
  g = c.gate(c.run("weakexplicit", specs))
  return g["decision"], g["sensitivity"]["decision_changes"]


def run_cases(selected: list[Case] | None = None) -> list[dict]:
  """Runs the cases in a fresh temporary directory; one result dict each."""
  results = []
  with tempfile.TemporaryDirectory(prefix="lla-validate-") as tmp:
    ctx = Context(tmp)
    for case in selected or cases():
      try:
        got = case.fn(ctx)
        ok = _equal(got, case.expected, case.tol)
      except Exception as e:  # A crashing case is a failed case, reported.
        got, ok = f"raised {type(e).__name__}: {e}", False
      results.append({"case": case.name, "kind": case.kind,
                      "expected": case.expected, "got": got, "pass": ok})
  return results


def _equal(got, expected, tol) -> bool:
  if isinstance(expected, float) and isinstance(got, (float, int)):
    return abs(got - expected) <= tol * max(1.0, abs(expected))
  return got == expected


def table(results: list[dict]) -> str:
  """Plain-text table: case | kind | expected | got | pass."""
  def cut(x, w):
    s = repr(x) if not isinstance(x, str) else x
    return s if len(s) <= w else s[:w - 3] + "..."
  lines = [f"{'#':>3} {'case':<72} {'kind':<15} {'expected':<28} "
           f"{'got':<28} pass"]
  for i, r in enumerate(results, 1):
    lines.append(f"{i:>3} {cut(r['case'], 72):<72} {r['kind']:<15} "
                 f"{cut(r['expected'], 28):<28} {cut(r['got'], 28):<28} "
                 f"{'PASS' if r['pass'] else 'FAIL'}")
  n_ok = sum(r["pass"] for r in results)
  lines.append(f"{n_ok}/{len(results)} cases pass")
  return "\n".join(lines)
