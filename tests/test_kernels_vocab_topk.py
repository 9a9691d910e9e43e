"""lla_kernels.vocab_topk: the Pallas kernel (interpret mode on CPU) against its reference, and
the reference against numpy brute force.

Integer-valued inputs make every score exact in float32 and in bfloat16 products with
float32 sums, so ties are real ties and the kernel must reproduce the reference bit for
bit (values and indices, ties to the lower index). The vocabulary (1000) is not a
multiple of either kernel's tile (Triton 128, Mosaic 512), nor are the rows of either
row block. Both kernels also have to lower for their hardware (Triton IR for CUDA, Mosaic
for TPU) at GPT-2's shape; running them there needs an accelerator.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from lla_kernels import vocab_topk
from lla_kernels import vocab_topk_reference as reference

ROWS, D, VOCAB = 70, 64, 1000


def integer_problem(seed: int, rows: int = ROWS, d: int = D, vocab: int = VOCAB):
  """x [rows, d], table [V, d] with small integer entries and duplicated table rows (exact
  ties), and a mask excluding ~30% of entries, all of row 1 and all but 3 entries of
  row 2 (fewer than k candidates: -inf entries fill the rest, in index order)."""
  rng = np.random.default_rng(seed)
  table = rng.integers(-3, 4, (vocab, d)).astype(np.float32)
  table[[40, 517, 999]] = table[3]
  table[[8, 900]] = table[7]
  x = rng.integers(-3, 4, (rows, d)).astype(np.float32)
  x[0] = table[3]                      # distance 0 to rows 3, 40, 517, 999
  mask = rng.random((rows, vocab)) < 0.3
  mask[1] = True
  mask[2] = True
  mask[2, [5, 600, 998]] = False
  return x, table, mask


def brute_force(x, table, k, kind, mask):
  """numpy: int64 scores, -inf where masked, stable sort (value descending, index ascending)."""
  xi, ti = x.astype(np.int64), table.astype(np.int64)
  dots = xi @ ti.T
  score = {"dot": dots, "neg_dot": -dots,
           "neg_sq_dist": -(((xi[:, None, :] - ti[None]) ** 2).sum(-1))}[kind].astype(np.float64)
  if mask is not None:
    score = np.where(mask, -np.inf, score)
  order = np.argsort(-score, axis=-1, kind="stable")[:, :k]
  return np.take_along_axis(score, order, -1), order


@pytest.mark.parametrize("kind", vocab_topk.KINDS)
def test_reference_equals_numpy_brute_force(kind):
  x, table, mask = integer_problem(seed=1)
  for m in (None, mask):
    values, indices = reference.topk(jnp.asarray(x), jnp.asarray(table), 40, kind,
                                     None if m is None else jnp.asarray(m))
    want_values, want_indices = brute_force(x, table, 40, kind, m)
    np.testing.assert_array_equal(np.asarray(indices), want_indices)
    np.testing.assert_array_equal(np.asarray(values), want_values)
    if kind == "neg_sq_dist" and m is None:  # the constructed ties, broken by index
      np.testing.assert_array_equal(np.asarray(indices)[0, :4], [3, 40, 517, 999])


# (impl, kind, k, masked, dtype, leading dims of x, Triton vocabulary splits): each
# interpret-mode case costs seconds. V = 1000 is 8 Triton tiles: one split walks all 8,
# three splits take 3 + 3 + 2, the default (None) gives each of 8 programs one tile.
KERNEL_CASES = [
    ("triton", "dot", 64, True, jnp.float32, (ROWS,), 1),
    ("triton", "neg_sq_dist", 1, False, jnp.bfloat16, (ROWS,), None),
    ("triton", "neg_sq_dist", 20, False, jnp.float32, (5, 14), 3),
    ("mosaic", "neg_sq_dist", 64, True, jnp.bfloat16, (ROWS,), None),
    ("mosaic", "neg_dot", 1, True, jnp.float32, (ROWS,), None),
    ("mosaic", "dot", 20, False, jnp.bfloat16, (7, 10), None),
]


@pytest.mark.parametrize("impl,kind,k,masked,dtype,lead,splits", KERNEL_CASES)
def test_kernel_equals_reference(impl, kind, k, masked, dtype, lead, splits):
  x, table, mask = integer_problem(seed=2)
  x, table = jnp.asarray(x, dtype).reshape(lead + (D,)), jnp.asarray(table, dtype)
  mask = jnp.asarray(mask).reshape(lead + (VOCAB,)) if masked else None
  got_values, got_indices = vocab_topk.topk(x, table, k, kind, mask, impl=impl, interpret=True,
                                            vocab_splits=splits)
  want_values, want_indices = vocab_topk.topk(x, table, k, kind, mask, impl="reference")
  assert got_indices.shape == got_values.shape == lead + (k,)
  assert got_indices.dtype == jnp.int32 and got_values.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(got_indices), np.asarray(want_indices))
  np.testing.assert_array_equal(np.asarray(got_values), np.asarray(want_values))
  flat = np.asarray(got_indices).reshape(-1, k)
  if kind == "neg_sq_dist" and k >= 4 and not masked:
    np.testing.assert_array_equal(flat[0, :4], [3, 40, 517, 999])
  if masked and k > 3:
    np.testing.assert_array_equal(flat[1], np.arange(k))             # nothing allowed
    np.testing.assert_array_equal(np.sort(flat[2, :3]), [5, 600, 998])
    np.testing.assert_array_equal(flat[2, 3:], [i for i in range(k + 3) if i not in (5,)][:k - 3])


def test_kernel_on_real_valued_inputs_is_a_top_k_up_to_rounding():
  """Random float32 data: the kernel's tile matmuls may round differently from one big
  matmul, so check what must hold regardless: every returned value is the float64 score
  of its index to float32 accuracy, values are sorted, and nothing better was left out."""
  rng = np.random.default_rng(3)
  x = rng.standard_normal((40, D)).astype(np.float32)
  table = rng.standard_normal((VOCAB, D)).astype(np.float32)
  k = 32
  for impl in ("triton", "mosaic"):
    values, indices = vocab_topk.topk(jnp.asarray(x), jnp.asarray(table), k, "neg_sq_dist",
                                      impl=impl, interpret=True)
    values, indices = np.asarray(values, np.float64), np.asarray(indices)
    exact = -((x[:, None, :].astype(np.float64) - table[None].astype(np.float64)) ** 2).sum(-1)
    tol = 1e-4 * np.abs(exact).max()
    np.testing.assert_allclose(values, np.take_along_axis(exact, indices, -1), atol=tol)
    assert np.all(np.diff(values, axis=-1) <= 0)
    assert all(len(set(row)) == k for row in indices)
    kth_best = np.sort(exact, axis=-1)[:, -k]
    assert np.all(values[:, -1] >= kth_best - tol)


def test_vocabulary_splits_fill_the_gpu_with_few_rows():
  assert vocab_topk.vocab_splits_for(row_blocks=1, tiles=393) == (197, 2)
  assert vocab_topk.vocab_splits_for(row_blocks=128, tiles=393) == (3, 131)
  assert vocab_topk.vocab_splits_for(row_blocks=300, tiles=393) == (1, 393)
  assert vocab_topk.vocab_splits_for(row_blocks=1, tiles=8, splits=3) == (3, 3)


def test_keys_follow_lax_top_k_total_order():
  """int32 keys order floats like lax.top_k (+nan > +inf > 1 > +0 > -0 > -inf > -nan)."""
  values = jnp.array([0.0, -0.0, 1.0, -jnp.inf, jnp.nan, -jnp.nan, jnp.inf, -1.5, 2e-45,
                      -2e-45], jnp.float32)
  keys = vocab_topk._to_key(values)
  order = np.argsort(-np.asarray(keys, np.int64), kind="stable")
  np.testing.assert_array_equal(order, np.asarray(jax.lax.top_k(values, values.size)[1]))
  np.testing.assert_array_equal(np.asarray(vocab_topk._from_key(keys)).view(np.int32),
                                np.asarray(values).view(np.int32))


def test_bfloat16_precision_casts_float32_inputs():
  x, table, _ = integer_problem(seed=4)
  x = jnp.asarray(x) + 0.01         # not representable in bfloat16: the cast matters
  table = jnp.asarray(table)
  got = vocab_topk.topk(x, table, 8, "dot", precision="bfloat16", impl="reference")
  want = reference.topk(x.astype(jnp.bfloat16), table.astype(jnp.bfloat16), 8, "dot")
  exact = reference.topk(x, table, 8, "dot")
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
  assert not np.array_equal(np.asarray(got[0]), np.asarray(exact[0]))
  with jax.default_matmul_precision("bfloat16"):
    np.testing.assert_array_equal(
        np.asarray(vocab_topk.topk(x, table, 8, "dot", impl="reference")[0]),
        np.asarray(want[0]))
  with jax.default_matmul_precision(None):  # unset (the test session sets it: conftest)
    assert vocab_topk.matmul_precision(None) == "float32"
  with pytest.raises(ValueError, match="matmul precision must be one of"):
    vocab_topk.matmul_precision("float16")


def test_auto_on_cpu_is_the_reference_executable():
  cpu = jax.devices("cpu")[0]  # the CPU backend also where an accelerator is the default
  x, table, mask = (jax.device_put(a, cpu) for a in integer_problem(seed=5))
  strip = lambda hlo: re.sub(r", metadata=\{[^}]*\}", "", hlo.split("ENTRY")[1])
  for m in (None, mask):
    auto = vocab_topk.topk.lower(x, table, 16, "neg_sq_dist", m).compile().as_text()
    ref = jax.jit(lambda x, table, mask: reference.topk(x, table, 16, "neg_sq_dist", mask))
    assert strip(auto) == strip(ref.lower(x, table, m).compile().as_text())


@pytest.mark.parametrize("platform,impl,target", [("cuda", "triton", "__gpu$xla.gpu.triton"),
                                                  ("tpu", "mosaic", "tpu_custom_call")])
def test_kernels_lower_for_their_hardware(platform, impl, target):
  """GPT-2's shape: the Triton (CUDA) and Mosaic (TPU) lowerings accept the kernels, with
  float32 and bfloat16 inputs, with and without a mask (compiling needs the hardware)."""
  rows, d, vocab = 100, 768, 50257
  checks = [export.DisabledSafetyCheck.custom_call(target)]
  for dtype, masked in ((jnp.float32, False), (jnp.bfloat16, True)):
    args = (jax.ShapeDtypeStruct((rows, d), dtype), jax.ShapeDtypeStruct((vocab, d), dtype),
            jax.ShapeDtypeStruct((rows, vocab), jnp.bool_) if masked else None)
    fn = jax.jit(lambda x, table, mask: vocab_topk.topk(x, table, 32, "neg_sq_dist", mask,
                                                        impl=impl))
    module = export.export(fn, platforms=[platform], disabled_checks=checks)(*args).mlir_module()
    assert target in module and "chlo.top_k" not in module


@pytest.mark.parametrize("platform,target", [("cuda", "__gpu$xla.gpu.triton"),
                                             ("tpu", "tpu_custom_call"), ("cpu", None)])
def test_platform_dispatch_picks_the_kernel_of_each_platform(platform, target):
  args = (jax.ShapeDtypeStruct((8, 32), jnp.float32), jax.ShapeDtypeStruct((300, 32), jnp.float32))
  fn = jax.jit(lambda x, table: vocab_topk.topk(x, table, 4, impl="platform"))
  checks = [] if target is None else [export.DisabledSafetyCheck.custom_call(target)]
  module = export.export(fn, platforms=[platform], disabled_checks=checks)(*args).mlir_module()
  if target is None:
    assert "chlo.top_k" in module and "custom_call" not in module
  else:
    assert target in module and "chlo.top_k" not in module


def test_bad_arguments_are_one_line_errors():
  x, table = jnp.zeros((4, 16)), jnp.zeros((10, 16))
  cases = [
      (dict(x=x, table=table, k=11), "k must lie in \\[1, V=10\\]"),
      (dict(x=x, table=jnp.zeros((10, 8)), k=2), "disagree"),
      (dict(x=x.astype(jnp.bfloat16), table=table, k=2), "must both be float32 or both bfloat16"),
      (dict(x=x, table=table, k=2, kind="cosine"), "kind must be one of"),
      (dict(x=x, table=table, k=2, mask=jnp.zeros((4, 9), bool)), "mask must be bool"),
      (dict(x=x, table=table, k=2, impl="cuda"), "impl must be one of"),
  ]
  for kwargs, message in cases:
    with pytest.raises(ValueError, match=message):
      vocab_topk.topk(**kwargs)
