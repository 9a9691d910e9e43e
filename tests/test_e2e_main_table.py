"""End to end: the main job on the tiny config, then verify / rescore / regenerate."""

import collections
import gc
import json
import math
import resource

import jax
import numpy as np
import pytest
from scipy import optimize

from configs import main_table as main_table_config
from lla import data
from lla import provenance
from lla import runtime
from lla.active import report as active_report
from lla.capture import store
from lla.model import checkpoint as ckpt
from lla.replay import regenerate
from lla.evidence import rundir
from lla.scoring import scorecard
from lla.study import defense_sweep, main_table, qualification

from test_attacks_units import np_client

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def arrays_before_the_job():
  """The JAX arrays other test files left alive in this process (an xdist worker runs
  several files) when the job starts: not the job's, and not necessarily in malloc's heap
  (an array may alias memory mapped from a file)."""
  gc.collect()
  return runtime.held_arrays()


@pytest.fixture(scope="module")
def finished(tmp_path_factory, data_dir, monkeypatch_module, arrays_before_the_job):
  monkeypatch_module.setenv("LLA_DATA_DIR", str(data_dir))
  monkeypatch_module.setenv("LLA_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
  config = main_table_config.get_config("tiny")
  workdir = tmp_path_factory.mktemp("main")
  report = main_table.run(config, str(workdir))
  return config, workdir, report


@pytest.fixture(scope="module")
def monkeypatch_module():
  with pytest.MonkeyPatch.context() as mp:
    yield mp


def test_report_has_every_section(finished):
  _, _, report = finished
  text = report.read_text()
  for heading in ("Main table", "primary test", "Corpus study", "Defense verdicts",
                  "Exact-document against token recovery", "FLOPs and wall time",
                  "Decoy-row training split", "Coverage"):
    assert heading in text, heading
  assert (report.parent / "frontier.png").stat().st_size > 1000
  assert (report.parent / "recovery.png").stat().st_size > 1000


def test_each_phase_records_the_peak_rss_it_ended_with(finished, arrays_before_the_job):
  """The job ran in this process: every recorded high-water mark is at most this process's
  now, they never fall, and the report prints each phase's (the next one's start) in GB."""
  _, workdir, report = finished
  (invocation,) = json.loads((workdir / main_table.TIMING).read_text())["invocations"]
  peaks = [p["peak_rss_mb"] for p in invocation["phases"]] + [invocation["peak_rss_mb"]]
  assert 0 < peaks[0] and peaks == sorted(peaks)
  assert peaks[-1] <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  text = report.read_text()
  for phase, peak in zip(invocation["phases"], peaks[1:]):
    assert f"| 1 | {phase['name']} | " in text and f" | {peak / 1024:.1f} |" in text
  # The base model's params, restored here, are alive from the end of its phase to the
  # end of the job: a lower bound on malloc's bytes in use at each later boundary.
  base = ckpt.restore(workdir / "pretrain" / "checkpoint")
  held = sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(base.params)) / 2**20
  heaps = [p["heap"] for p in invocation["phases"][1:]] + [invocation["heap"]]
  arrays = [p["jax_arrays"] for p in invocation["phases"][1:]] + [invocation["jax_arrays"]]
  for heap, held_arrays, peak in zip(heaps, arrays, peaks[1:]):
    assert heap["in_use_mb"] >= held, (heap, held)
    assert f" | {peak / 1024:.1f} | {heap['in_use_mb'] / 1024:.1f} |" in text
    # On CPU the buffers of the arrays the job made are malloc's blocks in use; those alive
    # now are the job's and at most the ones alive before it (which may have been freed).
    assert held_arrays["mb"] >= 0
    assert held_arrays["mb"] - arrays_before_the_job["mb"] <= heap["in_use_mb"], (
        held_arrays, arrays_before_the_job, heap)


def test_study_verifies_and_rescores(finished):
  _, workdir, _ = finished
  study = str(workdir / main_table.STUDY)
  assert rundir.verify(study) == []
  stored = (workdir / main_table.STUDY / rundir.SCORECARD_JSON).read_bytes()
  card = scorecard.build_from_inputs(study, json.loads(stored)["inputs"], None)
  assert scorecard.to_bytes(card) == stored


def test_predictions_regenerate_bit_for_bit(finished):
  """A spot check, one record per module (regenerating all 269 costs 4 minutes here; the
  replay tests regenerate whole runs): every replay module's first record bit for bit, the
  decoy-row modules (their own driver) listed, not redone."""
  _, workdir, _ = finished
  study = str(workdir / main_table.STUDY)
  result = regenerate.check(study, per_attack=1)
  # Same stack as recorded; only the checkout may differ (a commit made while the job ran).
  assert result.problems == [] and not any(provenance.numeric(p) for p in result.provenance)
  first = {}
  for record in rundir.load_records(study):
    if record.status == "ok":
      first.setdefault(record.attack, record.run_id)
  decoy = {a for a in first if a.startswith("decoy_")}
  assert decoy and len(first) - len(decoy) > 20, sorted(first)
  assert sorted(result.regenerated) == sorted(i for a, i in first.items() if a not in decoy)
  assert sorted(s.split(":")[0] for s in result.skipped) == sorted(first[a] for a in decoy)
  assert all("runs in its own driver" in s for s in result.skipped)


def _wilson_upper_ref(fired: int, n: int, z: float) -> float:
  """One-sided Wilson upper bound as the upper root of p - k/n = z sqrt(p (1 - p) / n)
  (scipy root finding, not the closed form lla.scoring.metrics uses)."""
  if fired == n:
    return 1.0
  f = lambda p: p - fired / n - z * np.sqrt(p * (1 - p) / n)
  return optimize.brentq(f, fired / n + 1e-12, 1.0, xtol=1e-15)


def _np_lm_loss(params, cfg, tokens: np.ndarray) -> float:
  """Mean next-token CE over all B (T - 1) positions of the whole model, float64 numpy
  (HF GPT-2: blocks, ln_f, head tied to wte)."""
  p = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), params)
  x = np_client(params, cfg, tokens, cfg.n_layer)
  mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
  y = (x - mu) / np.sqrt(var + cfg.layer_norm_epsilon) * p["ln_f"]["scale"] + p["ln_f"]["bias"]
  logits = y @ p["wte"]["embedding"].T
  top = logits.max(-1, keepdims=True)
  lse = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
  picked = np.take_along_axis(logits[:, :-1], tokens[:, 1:, None], -1)[..., 0]
  return float(np.mean(lse[:, :-1] - picked))


def test_active_tier_numbers_recounted_from_its_files(finished):
  """The main job's active tier (configs/active.py:tiny on the job's pre-trained base, under
  workdir/active) and its report, its numbers checked against quantities the test derives
  itself: recovery and the frequency
  baseline recounted with numpy from the stored predictions and the client's documents;
  the step-0 captures against a float64 numpy client of the base model (no server has
  changed the client yet); the mixed server's reply against its formula applied to the
  honest and FSHA replies; the task loss at step 0 against a numpy forward; thresholds and
  detection rates recounted from the stored windows.

  Not asserted, because it does not hold here: fsha_decode beating the frequency baseline.
  With 16 hijacked steps on the tiny base the decoder recovers nothing (0 of 256 tokens
  against a baseline of 8); FSHA needed thousands of steps on MNIST
  (notes/active-server.md 1.5).
  """
  main_config, workdir, _ = finished
  config, tier = main_config.active, workdir / main_table.ACTIVE
  summary = json.loads((tier / "summary.json").read_text())
  servers = {r["server"] for r in summary["recovery"]}
  assert servers == {"honest", "fsha", "mixed0.2"}
  assert set(summary["detection"]) == {"splitguard", "reference_cosine", "scrutinizer",
                                       "splitout"}
  splits = data.load_splits(**config.data.to_dict())
  documents = np.asarray(splits.evaluation.tokens)
  # The frequency baseline: the calibration corpus's most common token (unique here).
  counts = np.bincount(np.asarray(splits.calibration.tokens).reshape(-1))
  assert np.sum(counts == counts.max()) == 1
  top = int(counts.argmax())

  # --- recovery, recounted: every row of the summary from its stored predictions ----------
  study = tier / "study"
  rows = {(r["server"], r["step"], r["attack"]): r for r in summary["recovery"]}
  expected_rows = {(server, step, attack) for step in (0, 16)
                   for server, attacks in (("honest", config.replay.honest),
                                           ("fsha", config.replay.hijacked),
                                           ("mixed0.2", config.replay.hijacked))
                   for attack in attacks}
  assert set(rows) == expected_rows
  predictions = {}
  for (server, step, attack), row in rows.items():
    record = json.loads((study / rundir.RECORDS /
                         f"active__{server}_s0__step{step}__{attack}.json").read_text())
    assert record["status"] == "ok" and record["baseline_token"] == top, record
    pred = rundir.load_predictions(rundir.resolve(str(study), record["prediction_file"]))
    predictions[server, step, attack] = pred
    assert pred.shape == documents.shape
    assert row["token_recovery"] == np.mean(pred == documents), (server, step, attack)
    assert row["baseline"] == np.mean(documents == top)
  # Step 0: no server has touched the client yet, so every server's capture holds the same
  # h and a passive attack predicts the same tokens on each.
  assert np.array_equal(predictions["honest", 0, "ridge"], predictions["fsha", 0, "ridge"])
  assert np.array_equal(predictions["honest", 0, "ridge"], predictions["mixed0.2", 0, "ridge"])
  # With the client's exact weights at step 0 (trained knowledge = the base), the beam search
  # verifies ridge's candidates through the true client: it keeps what ridge gets right.
  assert rows["honest", 0, "activation"]["token_recovery"] >= \
      rows["honest", 0, "ridge"]["token_recovery"] > 0.5

  # --- the step-0 captures against numpy -----------------------------------------------
  base = ckpt.restore(workdir / "pretrain" / "checkpoint")
  h_ref = np_client(base.params, base.cfg, documents, config.cut)
  caps = {s: store.load_capture(tier / "captures" / f"{s}_s0" / "step_0")
          for s in ("honest", "fsha", "mixed0.2")}
  for server, c in caps.items():
    np.testing.assert_allclose(c.activations, h_ref, rtol=0, atol=1e-5 * np.abs(h_ref).max())
    assert np.array_equal(c.activations, caps["honest"].activations), server
    # h[:, T-1] reaches no loss term: an honest reply's last row is zero, and the hijacker
    # (zero_last_row) copies that.
    assert not c.gradients[:, -1].any() and c.gradients[:, :-1].any(), server
  # The mixed server's reply is (1 - beta) g_task + beta |g_task| / |g_adv| g_adv per row; at
  # step 0 its two halves are the honest server and the FSHA server of the same seed.
  g_task, g_adv = (caps[s].gradients.astype(np.float64) for s in ("honest", "fsha"))
  norm = lambda g: np.linalg.norm(g, axis=-1, keepdims=True)
  ratio = np.divide(norm(g_task), norm(g_adv), out=np.zeros_like(norm(g_adv)),
                    where=norm(g_adv) > 0)
  mixed = 0.8 * g_task + 0.2 * ratio * g_adv
  np.testing.assert_allclose(caps["mixed0.2"].gradients, mixed, rtol=0,
                             atol=1e-5 * np.abs(mixed).max())

  # --- task loss: step 0 is the base model on the documents, for every server -----------
  ce0 = _np_lm_loss(base.params, base.cfg, documents)
  losses = {(r["server"], r["step"]): r for r in summary["task_loss"]}
  for server in ("honest", "fsha", "mixed0.2"):
    assert losses[server, 0]["task_loss"] == pytest.approx(ce0, rel=1e-5), server
    assert losses[server, 0]["public_tail_loss"] == pytest.approx(ce0, rel=1e-5), server
  # FSHA trains no task tail: its deployed model is the public tail at every step.
  assert losses["fsha", 16]["task_loss"] == losses["fsha", 16]["public_tail_loss"]

  # --- detection: thresholds and rates recounted from the stored windows -----------------
  calibration = json.loads((tier / "runs" / "honest_s100.json").read_text())["windows"]
  z = float(config.detectors.wilson_z)
  for name, det in summary["detection"].items():
    scores = sorted(score for _, score in calibration[name])
    # numpy's "higher" quantile: the order statistic at ceil(q (n - 1)) (the maximum here).
    index = int(np.ceil(float(config.detectors.quantile) * (len(scores) - 1)))
    assert det["threshold"] == scores[index], name
    for server in servers:
      windows = summary["curves"][f"{server}_s0"]["windows"][name]
      fired = [step for step, score in windows if score > det["threshold"]]
      got = det[server]
      assert (got["windows"], got["fired"]) == (len(windows), len(fired)), (name, server)
      assert got["first_steps"] == [fired[0] if fired else None], (name, server)
      assert got["wilson_upper"] == pytest.approx(
          _wilson_upper_ref(len(fired), len(windows), z), abs=1e-9), (name, server)
  # Reference cosine at step 0: the honest server's tail is the client's public reference,
  # so its score 1 - cos is 0; the mixed reply's cosine with the task gradient is
  # (1 - beta) / sqrt((1 - beta)^2 + beta^2) where the critic's gradient is orthogonal to it
  # (nearly so here); FSHA's critic gradient is unrelated to the task: 1 - cos near 1, so
  # it fires at the first check.
  first = {server: dict(summary["curves"][f"{server}_s0"]["windows"]["reference_cosine"])[0]
           for server in servers}
  assert abs(first["honest"]) < 1e-6, first
  assert first["mixed0.2"] == pytest.approx(1 - 0.8 / np.sqrt(0.8 ** 2 + 0.2 ** 2), abs=0.01)
  assert first["fsha"] > 0.5 > summary["detection"]["reference_cosine"]["threshold"]
  assert summary["detection"]["reference_cosine"]["fsha"]["first_steps"] == [0]

  card = json.loads((tier / "study" / "scorecard.json").read_text())
  assert card["coverage"]["tiers"]["active"]["partial"] + \
      card["coverage"]["tiers"]["active"]["covered"] >= 1
  assert summary["decoy_probe"]["table"]
  path = active_report.write(tier, workdir / "active_report")
  text = path.read_text()
  assert "fsha_decode (none)" in text and "Decoy-row split" in text
  for figure in ("active_recovery.png", "active_detection.png", "active_decoy_probe.png"):
    assert (workdir / "active_report" / figure).stat().st_size > 0


# The gate rule of PROTOCOL section 5, written out again here (not lla.scoring's code): the
# one-sided Wilson upper bound, counts pooled over seeds per module (a module scored on
# t >= 1 apart), excess = 100 (U(p, n) - p0), floor = 100 (U(p0, n) - p0).
_Z, _THRESHOLD_PP, _MIN_SEEDS = 2.5392, 1.0, 3


def _wilson_upper(p: float, n: int) -> float:
  z2 = _Z * _Z
  return (p + z2 / (2 * n) + _Z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))) / (1 + z2 / n)


def _pooled(study: str, records) -> dict[str, tuple[float, float, int]]:
  """Module key -> (excess pp, floor pp, model seeds), from the predictions and truth files."""
  sums, seeds = collections.defaultdict(lambda: np.zeros(3, np.int64)), collections.defaultdict(set)
  for r in records:
    truth = np.asarray(rundir.load_truth(rundir.resolve(study, r.truth_file)))
    pred = np.load(rundir.resolve(study, r.prediction_file))
    first = {"all": 0, "t>=1": 1}[r.scored_positions]
    key = r.attack if first == 0 else f"{r.attack}[t>=1]"
    sums[key] += [(pred == truth)[:, first:].sum(), (truth[:, first:] == r.baseline_token).sum(),
                  truth[:, first:].size]
    seeds[key].add(r.model_seed)
  return {k: (100 * (_wilson_upper(h / n, n) - b / n), 100 * (_wilson_upper(b / n, n) - b / n),
              len(seeds[k])) for k, (h, b, n) in sums.items()}


def test_tiny_gates_decide_as_the_rule_recomputed_from_the_files(finished):
  """Each defended gate's envelope, floor, seeds, positive control and decision, recomputed
  from the study's prediction and truth files with the rule written out above."""
  config, workdir, _ = finished
  study = str(workdir / main_table.STUDY)
  card = json.loads((workdir / main_table.STUDY / rundir.SCORECARD_JSON).read_text())
  records = rundir.load_records(study)
  by_id = {r.run_id: r for r in records}
  for gate in card["gates"]:
    if gate["config"]["defense"] == "decoy_rows":
      continue
    group = [r for r in records if r.status == "ok" and
             all(getattr(r, f) == v for f, v in gate["config"].items())]
    rows = _pooled(study, group)
    argmax = max(rows, key=lambda k: rows[k][0])
    envelope, floor = rows[argmax][0], max(f for _, f, _ in rows.values())
    seeds = min(s for _, _, s in rows.values())
    references = collections.defaultdict(set)  # family -> its linked undefended runs
    for r in group:
      assert r.reference is not None, r.run_id  # the main job links every defended run
      references[r.family].add(r.reference)
    control = any(max(e for e, _, _ in _pooled(study, [by_id[i] for i in ids]).values())
                  > _THRESHOLD_PP for ids in references.values())
    if seeds < _MIN_SEEDS or not control or floor > _THRESHOLD_PP:
      expected = "INSUFFICIENT_EVIDENCE"
    elif envelope > _THRESHOLD_PP:
      expected = "FAIL"
    else:  # tiny leaves the published attacks unmeasured on defended captures: no PASS
      expected = "INSUFFICIENT_EVIDENCE"
    label = gate["config"]["defense_params"].get("label")
    assert gate["decision"] == expected, (label, gate["reasons"])
    assert gate["envelope"]["envelope_pp"] == pytest.approx(envelope, abs=1e-9), label
    assert gate["envelope"]["floor_pp"] == pytest.approx(floor, abs=1e-9), label
    assert gate["envelope"]["argmax"] == argmax and gate["n_seeds"] == seeds == 3, label
    # The sample allows both decisions: 3 models x 48 documents put the floor under 1 pp.
    assert floor < _THRESHOLD_PP, (label, floor)
    assert any(r.startswith("fitting attack(s) unmeasured: bisr") for r in gate["reasons"])
  # One gate per configuration of config.defenses, epsilon-parameterised ones included.
  assert len([g for g in card["gates"] if g["config"]["defense"] != "decoy_rows"]) == len(
      defense_sweep.configurations(config))
  assert {"dx_privacy", "dp_forward"} <= {g["config"]["defense"] for g in card["gates"]}
  for gate in card["gates"]:
    if gate["config"]["defense"] == "decoy_rows":
      # The decoy-row configurations have no undefended run of their family (the decoy
      # experiment's positive control is its own leak injection): the policy cannot decide.
      assert gate["decision"] == "INSUFFICIENT_EVIDENCE" and gate["n_seeds"] == 3
      assert any("no positive control" in r for r in gate["reasons"]), gate["reasons"]
      # Decoy frames are an observation kind of their own: only decoy attacks fit them.
      assert all(n.startswith("decoy_") for n in gate["fitting"]["fitting"]), gate["fitting"]
  # PROTOCOL 5a: the projection PASSes the attacks that ignore it; its adaptive attack sets
  # the envelope.
  projection, = [g for g in card["gates"] if g["config"]["defense"] == "projection"]
  assert projection["envelope"]["argmax"] == "projection_adaptive"
  # The policy's primary test is at k = 6; tiny has k = 2 only: not evaluated, and says why.
  (primary,) = card["contrasts"]["primary"]
  assert primary == {"evaluated": False, "reason": "no measured joint/activation records at "
                     "cut 6, public knowledge"}


def test_tiny_scorecard_carries_qualification_and_decoy_coverage(finished):
  config, workdir, _ = finished
  study = str(workdir / main_table.STUDY)
  card = json.loads((workdir / main_table.STUDY / rundir.SCORECARD_JSON).read_text())
  records = rundir.load_records(study)
  quality = card["qualification"]
  # The tiny job ran the declared tests of config.qualification.modules (and logged their
  # outcomes); a pass on a checkout with uncommitted changes is `partial`. The checks of
  # the other modules did not run: unmeasured, never assumed.
  outcomes = qualification.recorded_outcomes(study)
  assert outcomes["modules"] == sorted(config.qualification.modules)
  assert outcomes["recorded"].endswith("started before its phases")
  # The started run's modules were planned from the config before any record existed.
  measured = {r.attack for r in records if r.status == "ok"}
  assert measured <= set(main_table.planned_modules(config))
  dirty = outcomes["git_dirty"] is not False
  source = f"pytest outcome in {qualification.OUTCOMES_FILE}" + (
      f" ({qualification.DIRTY})" if dirty else "")
  for module in config.qualification.modules:
    for kind in ("reference_consistency", "synthetic"):  # (adaptation adds the runs')
      cell = quality[module][kind]
      if any(e["evidence"].startswith("tests/") for e in cell["evidence"]):
        assert cell["status"] == ("partial" if dirty else "pass"), (module, kind, cell)
        assert cell["sources"] == [source], (module, kind, cell)
  assert quality["sipit"]["reference_consistency"]["status"] == "unmeasured"
  assert quality["sipit"]["reference_consistency"]["sources"] == ["not run"]
  assert quality["activation"]["real_model"]["status"] == "pass"
  # mixup_adaptive's records carry per-document claims: scored per document beside per
  # row, with the mixup gate under each (docs/attacks.md).
  section = card["per_document"]
  assert sorted(section["rows"]) == sorted(r.run_id for r in records if r.status == "ok"
                                           and r.attack == "mixup_adaptive")
  assert [g["config"]["defense"] for g in section["gates"]] == ["mixup"]
  # Each defended configuration: "pass" iff refitting on the defended calibration is at
  # least the unaware attack's excess, recomputed from the gate's pooled figures. Under
  # Gaussian noise, top-k and projection both sit near the baseline (their order is
  # floating-point noise across machines); quantisation helps and mixup hurts by margins
  # of ~14 and ~9 pp.
  adaptation = quality["activation_defense_aware"]["adaptation"]
  gates_by_label = {g["config"]["defense_params"].get("label", g["config"]["defense"]): g
                    for g in card["gates"]}
  statuses = {}
  for item in adaptation["evidence"]:
    label = item["detail"].split()[0]
    pooled = gates_by_label[label]["pooled"]
    aware = pooled["activation_defense_aware"]["excess_pp"]
    assert item["status"] == ("pass" if aware > pooled["activation"]["excess_pp"]
                              else "partial"), item
    statuses[label] = item["status"]
  # The baseline runs where the defense transforms the forward message: not on quantities
  # the client computes from noisy embeddings (dx_privacy), nor on gradients or training.
  assert sorted(statuses) == ["dp_forward_epsilon8.0_delta1e-05_clip_norm6.0",
                              "gaussian_sigma0.3", "mixup_m2", "projection_enabledTrue",
                              "quantize_bits2", "topk_sparsity0.75"]
  # Each item's status from the study's own files: the refitted and the unaware attack's
  # excess recomputed from their predictions and truth (`_pooled`, the rule above) on the
  # gate's configuration; "pass" only where refitting is strictly above.
  for item in adaptation["evidence"]:
    label = item["detail"].split()[0]
    gate = gates_by_label[label]
    group = [r for r in records if r.status == "ok" and
             all(getattr(r, f) == v for f, v in gate["config"].items())]
    rows = _pooled(study, group)
    aware, unaware = rows["activation_defense_aware"][0], rows["activation"][0]
    assert gate["pooled"]["activation_defense_aware"]["excess_pp"] == pytest.approx(
        aware, abs=1e-9), label
    assert gate["pooled"]["activation"]["excess_pp"] == pytest.approx(unaware, abs=1e-9), label
    if aware != unaware:  # (a tie's status is the qualification rule's, not this figure's)
      assert item["status"] == ("pass" if aware > unaware else "partial"), (label, aware,
                                                                          unaware)
  # The cell's status is its worst item (fail < partial < unmeasured < pass).
  assert adaptation["status"] == next(s for s in ("fail", "partial", "unmeasured", "pass")
                                      if s in statuses.values())
  cells = {(c["family"], c["observation"]): c["status"] for c in card["coverage"]["cells"]
           if c["defense"] == "decoy_rows" and c["knowledge"] == "trained"}
  assert cells[("decoy_structural", "decoy_gradients")] == "covered"
  assert cells[("decoy_content", "decoy_forward+decoy_gradients")] == "covered"
  assert card["coverage"]["unplaced"] == []


def test_rerun_of_a_finished_study_only_renders(finished):
  config, workdir, report = finished
  before = {p: p.stat().st_mtime_ns for p in (workdir / main_table.STUDY).rglob("*") if p.is_file()}
  assert main_table.run(config, str(workdir)) == report
  after = {p: p.stat().st_mtime_ns for p in (workdir / main_table.STUDY).rglob("*") if p.is_file()}
  assert before == after


# --- A synthetic scored study beside it: every decision path with known answers --------
#
# Predictions hit exactly a chosen number of the 32 tokens of each of 64 documents
# (lla.scoring.synthetic), on 3 models at k = 6, public knowledge (the policy's primary
# setting). The study is scored by the main job's own scoring phase and rendered by its
# report, so the decisions below are the main job's, on inputs whose answers are known:
#   projection  0 hits under the defense, a strong undefended control  -> PASS
#   gaussian    20 of 32 hits under the defense                       -> FAIL
#   mixup       0 hits, but only 2 of the 3 models                    -> INSUFFICIENT_EVIDENCE
#   primary     joint 31 vs activation 28 (+-1 per document)          -> met (lower bound > 2 pp)

SYNTHETIC_DECISIONS = {"projection": "PASS", "gaussian": "FAIL",
                       "mixup": "INSUFFICIENT_EVIDENCE"}


# The attacks that fit a projection-defended training capture (h and g) under public
# knowledge, listed by hand from their declarations (PROTOCOL section 5a): every passive
# module reading h and/or g, with the projection's own adaptive attack and the defense-aware
# baselines (the projection acts on h); not the adaptive attacks of other mechanisms, not the
# negative controls (random_candidates, shuffled_gradients), not fsha_decode (active tier),
# not the decoy-row modules (their own observations).
PROJECTION_FITTING = ("activation", "activation_defense_aware", "activation_flop_matched",
                      "bisr", "bisr_b", "bisr_f", "eia", "gradient_only", "gradient_only_t1",
                      "joint", "joint_defense_aware", "lamp", "projection_adaptive", "ridge",
                      "sip", "sip_linear", "sipit", "tag")


def _plugins() -> tuple[str, ...]:
  """Attacks other test modules of this process registered: scoring records them in the
  study's threat space too, so the synthetic study measures them (recovering nothing)."""
  from lla.attacks import registry  # pylint: disable=g-import-not-at-top
  return tuple(n for n in registry.names() if not registry.source(n)["module"].startswith("lla."))


def _synthetic_specs():
  from lla.attacks import registry  # pylint: disable=g-import-not-at-top
  from lla.scoring import synthetic as syn  # pylint: disable=g-import-not-at-top
  # A PASS needs every registered attack that fits the defended capture measured (PROTOCOL
  # section 5a): under the projection, each of them recovers nothing.
  family = {m["name"]: m["family"] for m in registry.module_entries()}
  # Each record at its attack's registered revision (another counts as unmeasured).
  revision = {m["name"]: m["revision"] for m in registry.module_entries()}
  others = [(name, family[name]) for name in PROJECTION_FITTING + _plugins()
            if name not in ("activation", "joint")]
  specs = []
  for m in range(3):
    specs += [syn.Spec(name, family, 0, m, defense="projection",
                       attack_revision=revision[name]) for name, family in others]
    specs += [syn.Spec("activation", "beam_inversion", 28, m, jitter=1),
              syn.Spec("joint", "beam_inversion", 31, m, jitter=1),
              syn.Spec("shuffled_gradients", "beam_inversion", 28, m, jitter=1),
              syn.Spec("activation", "beam_inversion", 0, m, defense="projection"),
              syn.Spec("joint", "beam_inversion", 0, m, defense="projection"),
              syn.Spec("activation", "beam_inversion", 20, m, defense="gaussian")]
    if m < 2:
      specs.append(syn.Spec("activation", "beam_inversion", 0, m, defense="mixup"))
  return specs


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
  from lla.scoring import policy as policy_lib  # pylint: disable=g-import-not-at-top
  from lla.scoring import synthetic as syn  # pylint: disable=g-import-not-at-top
  from lla.study import report as report_lib  # pylint: disable=g-import-not-at-top
  config = main_table_config.get_config("tiny")
  workdir = tmp_path_factory.mktemp("synthetic")
  syn.make_capture(str(workdir / "captures" / "cap"), syn.truth_tokens(docs=64))
  study = workdir / main_table.STUDY
  syn.make_run(str(study), str(workdir / "captures" / "cap"), _synthetic_specs(),
               policy_lib.load_policy(config.scoring.policy).sha256, finalize=False)
  card = main_table.score(config, study)
  rundir.finalize(str(study))
  return config, workdir, card, report_lib.render(config, workdir)


def test_synthetic_study_decisions(synthetic):
  _, _, card, _ = synthetic
  decisions = {g["config"]["defense"]: g["decision"] for g in card["gates"]}
  assert decisions == SYNTHETIC_DECISIONS
  # The rule's fitting set is the hand-listed one: a PASS rests on every one of them.
  projection, = [g for g in card["gates"] if g["config"]["defense"] == "projection"]
  assert sorted(set(projection["fitting"]["fitting"]) - set(_plugins())) == sorted(
      PROJECTION_FITTING)
  reasons = {g["config"]["defense"]: g["reasons"] for g in card["gates"]}
  assert reasons["mixup"][0] == "2 independent seed(s), policy needs >= 3"
  assert reasons["gaussian"][0].startswith("envelope ") and "> 1 pp" in reasons["gaussian"][0]


def test_synthetic_primary_test_against_an_independent_count(synthetic):
  _, workdir, card, report = synthetic
  study = workdir / main_table.STUDY
  truth = rundir.load_truth(str(workdir / "captures" / "cap" / "truth.safetensors"))
  gains = []
  for m in range(3):
    hits = {a: (np.load(study / "predictions" / f"k6__public__none__m{m}__s0__{a}.npy")
                == truth).sum(axis=1) for a in ("joint", "activation")}
    gains.append(hits["joint"] - hits["activation"])
  expected = 100 * np.mean(gains) / truth.shape[1]
  (primary,) = card["contrasts"]["primary"]
  assert primary["evaluated"] and primary["passed"] is True
  assert primary["estimate"] == pytest.approx(expected, abs=1e-12)
  assert primary["lo"] > 2.0 and primary["lo"] < primary["estimate"] < primary["hi"]
  text = report.read_text()
  assert (f"| **primary**: joint − activation (k = 6, public knowledge) | synthetic | "
          f"{primary['estimate']:+.2f} | [{primary['lo']:+.2f}, {primary['hi']:+.2f}] (95%) | "
          "lower bound > +2.0 | yes |") in text
  assert "is met: " in text and "lies above +2.0 pp." in text
  assert "| secondary: joint − shuffled_gradients | synthetic |" in text


def test_synthetic_study_report_verifies_and_rescores(synthetic):
  _, workdir, card, report = synthetic
  study = str(workdir / main_table.STUDY)
  assert rundir.verify(study) == []
  stored = (workdir / main_table.STUDY / rundir.SCORECARD_JSON).read_bytes()
  assert scorecard.to_bytes(scorecard.build_from_inputs(
      study, json.loads(stored)["inputs"], None)) == stored
  text = report.read_text()
  for defense, decision in SYNTHETIC_DECISIONS.items():
    assert f"| {defense} | — | **{decision}** |" in text  # No declared strength.
  assert card["qualification"]["activation"]["real_model"]["status"] == "pass"
