"""SipIt against an independent float64 numpy brute force, on a tiny random GPT-2.

4 layers, d = 32, a 96-token vocabulary, cut k = 2, 4 documents of T = 6 (one pair shares
its first token, so position 0's shared search runs). Each test runs the registered attack
through `registry.execute` (metered, as replay runs it).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lla.attacks import budget as budget_lib
from lla.attacks import candidates as cand_lib
from lla.attacks import registry
from lla.attacks.published import sipit
from lla.attacks.workspace import Workspace
from lla.model import split
from lla.model.gpt2 import GPT2Config

from test_attacks_units import np_client, random_params

CFG = GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_head=4, n_layer=4)
K, B, T, N_CAL = 2, 4, 6, 8


@pytest.fixture(scope="module")
def case():
  params = random_params(CFG, seed=0)
  rng = np.random.default_rng(0)
  truth = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
  truth[3, 0] = truth[1, 0]
  cal = rng.integers(0, CFG.vocab_size, (N_CAL, T)).astype(np.int32)
  h, g = split.boundary_messages(params, CFG, jnp.asarray(truth), K)
  return params, truth, cal, np.asarray(h), np.asarray(g)


def run(case, gradients="capture", params=None, memory=2 << 30, activations=None,
        calibration=None, **budget):
  capture_params, _, cal, h, g = case
  if isinstance(gradients, str):
    gradients = {"capture": g, "none": None}[gradients]
  ws = Workspace(h if activations is None else activations, gradients,
                 capture_params if params is None else params, CFG, K,
                 cal if calibration is None else calibration, memory_budget_bytes=memory)
  return registry.execute("sipit", ws, budget, jax.random.key(0))


def numpy_greedy(params, h: np.ndarray) -> np.ndarray:
  """Position by position, the token whose float64 client output is nearest to h_t given
  the tokens chosen before it: the whole vocabulary is scanned at every position."""
  out = np.zeros(h.shape[:2], np.int32)
  vocab = np.arange(CFG.vocab_size)
  for b in range(h.shape[0]):
    for t in range(h.shape[1]):
      tokens = np.concatenate([np.repeat(out[b:b + 1, :t], CFG.vocab_size, 0), vocab[:, None]], 1)
      dist = np.sum((np_client(params, CFG, tokens, K)[:, t] - h[b, t]) ** 2, -1)
      out[b, t] = int(np.argmin(dist))
  return out


@pytest.fixture(scope="module")
def brute(case):
  params, _, _, h, _ = case
  return numpy_greedy(params, h)


@pytest.mark.parametrize("budget", [
    {},                                                         # proposals
    {"sipit_ridge_candidates": 0, "sipit_gradient_candidates": 0},  # the refinement
    {"sipit_ridge_candidates": 0, "sipit_gradient_candidates": 0, "sipit_refine_iters": 0},
    {"sipit_ridge_candidates": 0, "sipit_gradient_candidates": 0, "sipit_refine_iters": 0,
     "sipit_max_iters": 0, "sipit_brute_chunk": 16},            # brute force alone
])
def test_sipit_equals_brute_force(case, brute, budget):
  _, truth, _, _, _ = case
  np.testing.assert_array_equal(brute, truth)  # the reference itself recovers the text
  result, charge = run(case, **budget)
  np.testing.assert_array_equal(result.predictions, brute)
  details = result.details
  assert details["exact"] and details["acceptance_rate"] == 1.0
  assert details["fallback_positions"] == 0 and details["fallback"] == ""
  # A wrong token is far outside the calibrated tolerance; the true one well inside.
  assert details["accepted_max_distance"] <= details["tolerance"]
  assert 0 < details["calibration_discrepancy"] < details["tolerance"] < 1e-3
  assert details["resolved_by_stage"]["shared_position0"] == 1
  if budget.get("sipit_max_iters") == 0:
    assert details["resolved_by_stage"]["brute_force"] == B * T - 1
    assert details["runner_up_margin"] > 100
  elif "sipit_refine_iters" in budget:
    assert details["resolved_by_stage"]["policy"] == B * T - 1
  elif budget:
    assert details["resolved_by_stage"]["refine"] == B * T - 1
  # Every stage it used is charged; the XLA count agrees with the analytic one.
  expected = {"calibration_activations", "ridge"} | (
      {"gradient_ranking", "activation_candidates"} if not budget else set())
  assert set(charge.stages) == expected
  assert charge.flops_source == "xla"
  assert 0.5 < charge.flops / charge.flops_analytic < 2.0
  assert result.predictions.dtype == np.int32


@pytest.mark.parametrize("misled", ["gradient_proposals", "policy"])
def test_sipit_terminates_through_brute_force(case, misled):
  """Proposals that miss (gradients deranged across documents), or a policy that starts
  from a useless decoder (fitted on one calibration document) and cannot move: every
  position still ends, exactly, through the brute-force scan."""
  _, truth, cal, _, g = case
  if misled == "gradient_proposals":
    result, _ = run(case, gradients=g[cand_lib.derangement(B, 3)], sipit_ridge_candidates=0,
                    sipit_gradient_candidates=2, sipit_refine_iters=0, sipit_max_iters=0,
                    sipit_brute_chunk=16)
  else:
    result, _ = run(case, gradients="none", calibration=cal[:1], sipit_ridge_candidates=0,
                    sipit_refine_iters=0, sipit_max_iters=1, sipit_step_size=1e-9,
                    sipit_brute_chunk=16)
    assert result.details["max_policy_iterations"] == 1
  np.testing.assert_array_equal(result.predictions, truth)
  details = result.details
  assert details["exact"]
  resolved = details["resolved_by_stage"]
  assert resolved["brute_force"] >= 0.8 * B * T, resolved
  by_stage = details["mean_verified_per_position_by_stage"]
  assert by_stage["brute_force"] > 1
  assert by_stage["proposals" if misled == "gradient_proposals" else "policy"] >= 0.8, by_stage


def test_sipit_trained_knowledge_falls_back_to_nearest(case):
  """Attacker weights that differ from the client's: nothing is accepted, the record says
  so, and each position takes the vocabulary's nearest token (float64 reference)."""
  params, truth, _, h, _ = case
  rng = np.random.default_rng(1)
  perturbed = jax.tree_util.tree_map(
      lambda x: x + 1e-3 * rng.standard_normal(x.shape).astype(np.float32), params)
  result, _ = run(case, params=perturbed, sipit_refine_iters=2, sipit_max_iters=2,
                  sipit_brute_chunk=16)
  details = result.details
  assert details["acceptance_rate"] == 0.0 and not details["exact"]
  assert details["fallback_positions"] == B * T
  assert details["resolved_by_stage"]["shared_position0"] == 0
  assert "nearest candidate" in details["fallback"]
  assert details["mean_verified_per_position"] == pytest.approx(CFG.vocab_size * (B * T - 1)
                                                                / (B * T))
  np.testing.assert_array_equal(result.predictions, numpy_greedy(perturbed, h))
  assert np.mean(result.predictions == truth) >= 0.9  # small perturbation: still close


def test_sipit_inexact_documents_skip_the_later_brute_force(case):
  """With sipit_brute_force_inexact off, position 0's exhaustive miss marks a document
  inexact: position 0 is still the vocabulary's nearest, later positions never brute force."""
  params, truth, _, h, _ = case
  rng = np.random.default_rng(1)
  perturbed = jax.tree_util.tree_map(
      lambda x: x + 1e-3 * rng.standard_normal(x.shape).astype(np.float32), params)
  budget = dict(params=perturbed, sipit_refine_iters=2, sipit_max_iters=2, sipit_brute_chunk=16)
  full, _ = run(case, **budget)
  cheap, _ = run(case, sipit_brute_force_inexact=False, **budget)
  assert cheap.details["inexact_documents"] == B
  assert "skipped the brute force" in cheap.details["fallback"]
  np.testing.assert_array_equal(cheap.predictions[:, 0], numpy_greedy(perturbed, h)[:, 0])
  # Only position 0 is scanned: at most the vocabulary once per document.
  brute = cheap.details["mean_verified_per_position_by_stage"]["brute_force"] * B * T
  assert 0 < brute <= CFG.vocab_size * B
  assert cheap.details["mean_verified_per_position"] < full.details["mean_verified_per_position"]
  assert full.details["inexact_documents"] == B and "skipped" not in full.details["fallback"]


def test_sipit_deterministic_and_chunking_invariant(case):
  # A decoder fitted on two calibration documents is poor, so that every stage runs.
  budget = {"sipit_gradient_candidates": 0, "sipit_refine_iters": 2, "sipit_max_iters": 2,
            "sipit_brute_chunk": 16}
  cal = case[2][:2]
  first, _ = run(case, calibration=cal, **budget)
  again, _ = run(case, calibration=cal, **budget)
  one_doc_chunks, _ = run(case, calibration=cal, memory=1, **budget)
  by_stage = first.details["mean_verified_per_position_by_stage"]
  assert all(count > 0 for count in by_stage.values()), by_stage
  np.testing.assert_array_equal(first.predictions, case[1])
  for other in (again, one_doc_chunks):
    np.testing.assert_array_equal(other.predictions, first.predictions)
    for key in ("resolved_by_stage", "mean_verified_per_position_by_stage", "tolerance"):
      assert other.details[key] == first.details[key], key
    # A lone document's call runs 1 row in one-document chunks and a bucket of rows in the
    # full chunk: XLA:CPU's matrix-vector and matrix products differ in the last bits.
    assert other.details["runner_up_margin"] == pytest.approx(
        first.details["runner_up_margin"], rel=1e-6)
  assert again.details == first.details


def test_sipit_documents_together_and_in_blocks_search_as_one_alone(case, brute, monkeypatch):
  """The chunk's documents advance together, each at its own position, and refinement and
  policy run in blocks of iterations: against each document in a chunk of its own searched
  iteration by iteration (blocks of 1), the same predictions (the float64 reference's) and
  the same statistics. The budgets end blocks inside a document's iterations (refinement
  3 in blocks of 2, policy 5 in blocks of 4) and every stage settles some positions."""
  budget = {"sipit_gradient_candidates": 0, "sipit_ridge_candidates": 1,
            "sipit_refine_iters": 3, "sipit_max_iters": 5, "sipit_brute_chunk": 16}
  cal = case[2][:1]  # A decoder fitted on one document: every stage has work.
  monkeypatch.setattr(sipit, "REFINE_BLOCK", 2)
  monkeypatch.setattr(sipit, "POLICY_BLOCK", 4)
  together, _ = run(case, calibration=cal, **budget)
  monkeypatch.setattr(sipit, "REFINE_BLOCK", 1)
  monkeypatch.setattr(sipit, "POLICY_BLOCK", 1)
  alone, _ = run(case, calibration=cal, memory=1, **budget)
  np.testing.assert_array_equal(together.predictions, brute)
  np.testing.assert_array_equal(alone.predictions, brute)
  details = together.details
  assert all(details["resolved_by_stage"][stage] > 0 for stage in sipit.STAGES), details
  assert details["mean_refine_iterations"] > 2 and details["max_policy_iterations"] == 5
  for key in ("resolved_by_stage", "mean_verified_per_position_by_stage",
              "mean_verified_per_position", "refine_positions", "policy_positions",
              "mean_refine_iterations", "mean_policy_iterations", "max_policy_iterations",
              "acceptance_rate", "tolerance", "calibration_discrepancy"):
    assert alone.details[key] == details[key], key


def test_sipit_padded_calls_are_charged_their_documents_alone(case, brute, monkeypatch):
  """Calls padded to a bucket (here every one to the chunk's 4 documents) search as calls
  on the waiting documents alone (no padding at all) and are charged the same FLOPs, XLA's
  and the analytic count: the padding is lla's, not the attack's work."""
  budget = {"sipit_gradient_candidates": 0, "sipit_ridge_candidates": 1,
            "sipit_refine_iters": 3, "sipit_max_iters": 5, "sipit_brute_chunk": 16}
  cal = case[2][:1]  # A decoder fitted on one document: every stage has work.
  bucket, sizes = sipit._bucket, []

  def spied(active, limit, floor=1):
    rows = bucket(active, limit, floor)
    sizes.append((len(active), len(rows)))
    return rows

  monkeypatch.setattr(sipit, "_bucket", lambda active, limit, floor=1: active.astype(np.int32))
  exact, exact_charge = run(case, calibration=cal, **budget)
  monkeypatch.setattr(sipit, "_bucket", spied)
  monkeypatch.setattr(sipit, "BUCKET_FLOOR", 64)
  padded, padded_charge = run(case, calibration=cal, **budget)
  assert any(real < rows for real, rows in sizes), sizes  # some call did run padding
  assert all(rows in (1, B) for _, rows in sizes), sizes  # brute force alone runs 1 row
  np.testing.assert_array_equal(padded.predictions, brute)
  np.testing.assert_array_equal(exact.predictions, brute)
  for key in ("resolved_by_stage", "mean_verified_per_position_by_stage",
              "mean_refine_iterations", "mean_policy_iterations"):
    assert padded.details[key] == exact.details[key], key
  assert padded_charge.flops_analytic == pytest.approx(exact_charge.flops_analytic, rel=1e-12)
  # XLA's counts per row differ a little between row counts (it simplifies a lone row's
  # products differently: 0.3% in all, 1.0% in the refinement, here); charging the padding
  # would add 30%.
  assert padded_charge.flops == pytest.approx(exact_charge.flops, rel=1e-2)
  for stage, flops in exact.details["flops_by_stage"].items():
    assert padded.details["flops_by_stage"][stage] == pytest.approx(flops, rel=2e-2), stage


@pytest.mark.parametrize("stage", ["refine", "policy"])
def test_sipit_block_is_charged_its_iterations_one_call_each(case, stage):
  """A block of iterations runs as one `Workspace.scan`: it ends in the state of its
  iterations called one by one, and is charged what XLA counts for them called so (not
  its body once, as XLA counts a loop)."""
  params, truth, _, h, _ = case
  n, trips, t = 2, 3, 2
  cache = split.init_cache(CFG, K, T)
  for s in range(t):
    _, cache = split.client_step(params, CFG, cache, jnp.int32(truth[0, s]), jnp.int32(s))
  cache = jnp.stack([cache] * B)
  rng = np.random.default_rng(3)
  e = jnp.asarray(rng.standard_normal((B, CFG.n_embd)).astype(np.float32) * 0.02)
  idx, pos = jnp.asarray([0, 2], jnp.int32), jnp.full((n,), t, jnp.int32)
  start, seen, tol = jnp.zeros(n, jnp.int32), jnp.zeros(n, jnp.int32), jnp.float32(1e-9)
  log = {"active": jnp.zeros((trips, n), jnp.bool_),
         "value": jnp.zeros((trips, n), jnp.float32)}
  state = (jnp.zeros((B, CFG.vocab_size), jnp.bool_), sipit.empty_record(CFG, K, B), e, seen)
  static = {"cfg": CFG, "num": 2, "iters": 10}
  if stage == "refine":
    step = sipit.refine_iteration
    consts = (params, cache, jnp.asarray(h), jnp.eye(CFG.n_embd) * 0.5, idx, pos, start, tol)
    state += (jnp.ones(n, jnp.bool_), jnp.full((n,), jnp.inf, jnp.float32), log)
  else:
    step = sipit.policy_iteration
    consts = (params, cache, jnp.asarray(h), idx, pos, start, jnp.full((n,), 2, jnp.int32),
              tol, jnp.float32(1.0), jnp.float32(1.0))
    state += (log,)
  ws = Workspace(h, None, params, CFG, K, case[2])
  with ws.attack_scope("blocks"):
    meter = sipit.Meter(ws)
    looped = meter.scan(stage, 0.0, step, consts, state, (jnp.arange(trips, dtype=jnp.int32),),
                        **static)
  one = jax.jit(lambda consts, state, i: step(*consts, state, i, **static))
  stepped, flops = state, 0.0
  for i in range(trips):
    i = jnp.int32(i)
    flops += one.lower(consts, stepped, i).compile().cost_analysis()["flops"]
    stepped = one(consts, stepped, i)
  # The same candidates, keys/values, iterates and logs; the distances within float32
  # rounding (the loop computes ||h_t||^2, which it does not change, once, not per trip).
  for key in ("rel", "runner"):
    np.testing.assert_allclose(looped[1][key], stepped[1][key], rtol=1e-6)
    looped[1][key] = stepped[1][key]
  for a, b in zip(jax.tree_util.tree_leaves(looped), jax.tree_util.tree_leaves(stepped)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert np.asarray(looped[-1]["active"]).all()  # every iteration of both rows ran
  # Within XLA's simplifications, which differ a little inside the loop (0.1% here).
  assert flops > 0 and meter.xla[stage] == pytest.approx(flops, rel=1e-2)


def test_sipit_nan_raises_naming_position_and_document(case):
  _, _, _, h, _ = case
  bad = h.copy()
  bad[1, 2] = np.nan
  with pytest.raises(FloatingPointError, match="position 2, iteration 0, document 1"):
    run(case, activations=bad)


def test_sipit_declares_its_budget():
  spec = registry.get("sipit").spec
  assert spec.requires == ("activations",) and spec.family == "sequential_inversion"
  fields = budget_lib.fields()
  for name in spec.budget_fields:
    assert name in fields and fields[name].doc
  assert budget_lib.get("sipit_step_size").default == 1.0  # official CLI default
  with pytest.raises(budget_lib.BudgetError, match="sipit_batch"):
    budget_lib.validate({"sipit_batch": 0}, [spec], CFG.vocab_size)
  assert {check[1].split("::")[1] for check in spec.checks} <= set(globals())
  assert sipit.merge_proposals(None, None, 2, 1)[0].shape == (1, 2, 0)


def test_linearised_order_matches_float64_finite_differences(case):
  """The brute force's ranking: the client's Jacobian in the input embedding (JVPs) against
  central differences of the float64 numpy client; the visited token ranks last."""
  params, truth, _, h, _ = case
  b, t = 0, 3
  cache = split.init_cache(CFG, K, T)
  for s in range(t):
    _, cache = split.client_step(params, CFG, cache, jnp.int32(truth[b, s]), jnp.int32(s))
  wte = np.asarray(split.wte(params), np.float64)
  e = wte[truth[b, t]] + 0.3 * np.random.default_rng(2).standard_normal(CFG.n_embd) * 0.02
  visited = np.zeros((1, CFG.vocab_size), bool)
  visited[0, truth[b, t]] = True
  order = np.asarray(sipit.linearised_order(
      params, cache[None], jnp.asarray(visited), jnp.asarray(e[None], jnp.float32),
      jnp.zeros(1, jnp.int32), jnp.int32(t), jnp.asarray(h[b:b + 1, t]), cfg=CFG))

  def client_at(x):  # float64 client output at position t with input embedding x
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    p["wte"]["embedding"] = np.concatenate([p["wte"]["embedding"], x[None]])
    tokens = np.concatenate([truth[b, :t], [CFG.vocab_size]])[None]
    return np_client(p, CFG, tokens, K)[0, t]

  step = 1e-5
  jacobian = np.stack([(client_at(e + step * u) - client_at(e - step * u)) / (2 * step)
                       for u in np.eye(CFG.n_embd)])
  error = np.sum(((wte - e) @ jacobian - (h[b, t] - client_at(e))) ** 2, axis=-1)
  error[truth[b, t]] = np.inf
  assert order[-1] == truth[b, t]
  np.testing.assert_array_equal(order[:10], np.argsort(error, kind="stable")[:10])


def test_budget_items_are_typed_by_their_declarations():
  """The benchmarks' --budget items: an int, a float and a bool field typed as declared;
  an unknown name or an out-of-range value is refused naming the field."""
  registry.load_builtin()
  parsed = budget_lib.parse_items(["sipit_max_iters=3", " ridge_alpha=0.5",
                                   "sipit_brute_force=false"])
  assert parsed == {"sipit_max_iters": 3, "ridge_alpha": 0.5, "sipit_brute_force": False}
  assert [type(v) for v in parsed.values()] == [int, float, bool]
  assert budget_lib.parse_items(["sipit_brute_force=1"]) == {"sipit_brute_force": True}
  with pytest.raises(budget_lib.BudgetError, match="no_such_field"):
    budget_lib.parse_items(["no_such_field=1"])
  with pytest.raises(budget_lib.BudgetError, match="ridge_alpha"):
    budget_lib.parse_items(["ridge_alpha=-1"])


def test_position0_is_calibrated_on_its_own(case):
  """Position 0 (the attention sink, whose row carries the massive activations) has a
  tolerance of its own: the factor times its largest discrepancy, the other positions' from
  theirs, each at least float32's epsilon; and the attack reports both."""
  eps = float(np.finfo(np.float32).eps)
  calibration = sipit.Calibration.of([3e-4, 1e-8, 2e-6, 5e-7], 100.0, None)
  assert (calibration.first_discrepancy, calibration.discrepancy) == (3e-4, 2e-6)
  assert calibration.first_tolerance == pytest.approx(3e-2)
  assert calibration.tolerance == pytest.approx(2e-4)
  np.testing.assert_allclose(calibration.at([0, 1, 3]), [3e-2, 2e-4, 2e-4])
  tight = sipit.Calibration.of([0.0, 1e-9], 100.0, None)
  assert tight.first_tolerance == tight.tolerance == pytest.approx(100 * eps)
  alone = sipit.Calibration.of([4e-7], 10.0, None)
  assert alone.tolerance == alone.first_tolerance == pytest.approx(4e-6)
  result, _ = run(case)
  details = result.details
  assert 0 <= details["calibration_discrepancy_position0"] < details["tolerance_position0"]
  assert details["tolerance_position0"] == pytest.approx(
      100.0 * max(details["calibration_discrepancy_position0"], eps))
