"""Top-k over a vocabulary-sized table without materialising the [rows, V] scores.

Every attack scans the whole vocabulary: the ridge and gradient candidate rankings
([B*T, d] x [d, V], then top-C), SipIt's nearest-unvisited-row search, relaxed-input
attacks. XLA materialises the [rows, V] scores (1.6 GB for 8192 rows of GPT-2 at float32)
and sorts each row. The Pallas kernel here tiles V instead: for a block of query rows it
walks the table in tiles, scores each tile with one matmul (float32 accumulation), and
merges the tile into a running top-k held on chip, so only [rows, k] ever reaches memory.

  topk(x, table, k, kind="dot" | "neg_dot" | "neg_sq_dist", mask=None)
      -> (values [..., k] float32, indices [..., k] int32)

returns exactly what `vocab_topk_reference.topk` (materialise, then `lax.top_k`) returns
for the same scores: values in IEEE total order, ties to the lower index. On CPU `topk`
*is* the reference; on GPU (Triton) and TPU (Mosaic) it is the kernel.

The running top-k. Scores are mapped to int32 keys whose signed order is IEEE total
order (the order `lax.top_k` uses, -0 below +0), so comparisons are exact integer ones.
Each row keeps k (key, index) slots (k rounded up to a power of two), unsorted, and its
worst slot (lowest key, then highest index). A tile is merged in rounds: each round takes
every row's best remaining tile entry (highest key, then lowest index) and, where it
beats the row's worst slot, overwrites that slot. A row's tile entries come out in
decreasing order, so the rounds stop at the largest number of entries any row of the
block has that beat its worst slot at the start of the tile (at most k): the first tiles
take k rounds, later ones a few or none. Empty slots hold key INT32_MIN and distinct
indices >= 2^30; excluded and padding columns get the key of -inf and INT32_MIN
respectively, so they never displace a real score. The slots are sorted (key
descending, index ascending) after the kernel.

Parallelism. On GPU the grid is (row blocks, vocabulary splits): with few query rows
(SipIt verifies a handful of documents at a time) one program per row block would leave
most of the GPU idle, so the vocabulary is split among programs, each keeping its own
top-k, and the splits' slots are merged by the same final sort. On TPU the vocabulary is
the sequential grid axis and the row blocks the parallel one.

Precision (`precision`, default: JAX's `jax_default_matmul_precision`, which
lla.runtime.configure sets): "float32" multiplies in full float32 (Triton IEEE, Mosaic
HIGHEST); "tensorfloat32" uses TF32 on GPU and 3-pass bf16 on TPU; "bfloat16" casts x and
the table to bfloat16 (all backends, the reference too), products exact, float32
accumulation. bfloat16 inputs are always multiplied as bfloat16.

Exclusion mask: [..., V] bool, True = excluded (scores -inf, as `jnp.where(mask, -inf,
scores)` before `lax.top_k`). It is read tile by tile as int8 alongside the table (one
byte per entry against the 4 of a materialised score); SipIt's visited sets are already
[docs, V] bool, so no compact form is needed.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lla_kernels import vocab_topk_reference as reference

KINDS = reference.KINDS
IMPLS = ("auto", "platform", "reference", "triton", "mosaic")
PRECISIONS = ("float32", "tensorfloat32", "bfloat16")

_KEY_MIN = -(2**31)                 # padding and consumed tile entries; empty slots
_EMPTY_INDEX = 1 << 30              # empty slot s holds index _EMPTY_INDEX + s
_SIGN_FLIP = 0x7FFFFFFF

# Untuned starting points. depth 256 (GPT-2's d = 768 in three chunks) asked an H200 for
# 320 KiB of shared memory per program, over its 227 KiB; depth 64 keeps the float32 x and
# table chunks of a tile at 48 KiB.
_TRITON_BLOCKS = dict(rows=64, vocab=128, depth=64, num_warps=4, num_stages=2)
# Triton programs aimed for (about two per streaming multiprocessor of an H100/H200): with
# few row blocks the vocabulary is split among programs, whose top-k are merged after.
_TRITON_PROGRAMS = 264
_MOSAIC_BLOCKS = dict(rows=128, vocab=512)


def matmul_precision(name: str | None = None) -> str:
  """The precision mode ("float32", "tensorfloat32" or "bfloat16") of a JAX precision
  name; None reads `jax_default_matmul_precision` (unset: "float32")."""
  if name is None:
    name = jax.config.jax_default_matmul_precision
  mode = {None: "float32", "float32": "float32", "highest": "float32",
          "tensorfloat32": "tensorfloat32", "high": "tensorfloat32",
          "bfloat16": "bfloat16", "default": "bfloat16", "fastest": "bfloat16"}.get(name)
  if mode is None:
    raise ValueError(f"matmul precision must be one of {PRECISIONS} (or JAX's names "
                     f"highest/high/default), got {name!r}")
  return mode


# --- keys: int32 whose signed order is IEEE total order -----------------------------------


def _to_key(scores: jax.Array) -> jax.Array:
  bits = jax.lax.bitcast_convert_type(scores, jnp.int32)
  return jnp.where(bits < 0, bits ^ _SIGN_FLIP, bits)


def _from_key(keys: jax.Array) -> jax.Array:
  bits = jnp.where(keys < 0, keys ^ _SIGN_FLIP, keys)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


# --- the tile computation shared by both kernels ------------------------------------------


def _dot_precision(mode: str):
  return {"float32": jax.lax.Precision.HIGHEST, "tensorfloat32": jax.lax.Precision.HIGH,
          "bfloat16": jax.lax.Precision.DEFAULT}[mode]


def _tile_dot(x, e, mode: str):
  """x [r, c] . e [n, c]^T -> [r, n] float32."""
  return jax.lax.dot_general(x, e, (((1,), (1,)), ((), ())), precision=_dot_precision(mode),
                             preferred_element_type=jnp.float32)


def _tile_keys(dots, x_norms, e_norms, excluded, cols, kind: str, vocab: int):
  """Keys [r, n] of a tile: the reference's score formula, -inf where excluded,
  INT32_MIN in padding columns (cols [1, n] >= vocab)."""
  if kind == "dot":
    s = dots
  elif kind == "neg_dot":
    s = -dots
  else:
    s = -(x_norms - 2.0 * dots + e_norms)
  if excluded is not None:
    s = jnp.where(excluded, -jnp.inf, s)
  return jnp.where(cols < vocab, _to_key(s), _KEY_MIN)


def _worst(keys, idx):
  """Each row's worst slot: lowest key, then highest index; ([r, 1], [r, 1])."""
  worst_key = jnp.min(keys, axis=1, keepdims=True)
  worst_idx = jnp.max(jnp.where(keys == worst_key, idx, -1), axis=1, keepdims=True)
  return worst_key, worst_idx


def _merge(keys, idx, tile, cols, slots: int):
  """Merges tile keys [r, n] (columns cols [1, n]) into the running slots [r, slots]."""
  worst_key, worst_idx = _worst(keys, idx)
  beats = (tile != _KEY_MIN) & ((tile > worst_key) | ((tile == worst_key) & (cols < worst_idx)))
  rounds = jnp.minimum(jnp.max(jnp.sum(beats.astype(jnp.int32), axis=1)), slots)

  def round_(_, carry):
    keys, idx, tile = carry
    worst_key, worst_idx = _worst(keys, idx)
    best_key = jnp.max(tile, axis=1, keepdims=True)
    best_idx = jnp.min(jnp.where(tile == best_key, cols, _EMPTY_INDEX), axis=1, keepdims=True)
    better = (best_key != _KEY_MIN) & (
        (best_key > worst_key) | ((best_key == worst_key) & (best_idx < worst_idx)))
    slot = better & (keys == worst_key) & (idx == worst_idx)
    keys = jnp.where(slot, best_key, keys)
    idx = jnp.where(slot, best_idx, idx)
    tile = jnp.where(cols == best_idx, _KEY_MIN, tile)
    return keys, idx, tile

  keys, idx, _ = jax.lax.fori_loop(0, rounds, round_, (keys, idx, tile))
  return keys, idx


def _empty_slots(rows: int, slots: int):
  keys = jnp.full((rows, slots), _KEY_MIN, jnp.int32)
  idx = _EMPTY_INDEX + jax.lax.broadcasted_iota(jnp.int32, (rows, slots), 1)
  return keys, idx


# --- GPU (Triton): a program per (row block, vocabulary split), the tile loop inside -------


def vocab_splits_for(row_blocks: int, tiles: int, splits: int | None = None) -> tuple[int, int]:
  """(splits, tiles per split) of the Triton grid: enough programs to fill the GPU when
  there are few row blocks (SipIt's handful of rows), one split when there are many."""
  if splits is None:
    splits = -(-_TRITON_PROGRAMS // row_blocks)
  per_split = -(-tiles // max(1, min(splits, tiles)))
  return -(-tiles // per_split), per_split


def _triton_kernel(x_ref, e_ref, x_norms_ref, e_norms_ref, mask_ref, keys_ref, idx_ref, *,
                   kind: str, vocab: int, block_vocab: int, depth: int, tiles_per_split: int,
                   mode: str):
  from jax.experimental.pallas import triton as pltriton  # GPU-only module

  rows, d = x_ref.shape
  slots = keys_ref.shape[-1]
  x_norms = x_norms_ref[...][:, None] if kind == "neg_sq_dist" else None
  lane = jax.lax.broadcasted_iota(jnp.int32, (1, block_vocab), 1)

  def tile(t, carry):
    keys, idx = carry
    start = t * block_vocab
    cols = start + lane
    in_vocab = cols < vocab
    dots = jnp.zeros((rows, block_vocab), jnp.float32)
    for c in range(0, d, depth):
      x = x_ref[:, pl.ds(c, depth)]
      e = pltriton.load(e_ref.at[pl.ds(start, block_vocab), pl.ds(c, depth)],
                        mask=in_vocab.reshape(block_vocab, 1), other=0)
      dots += _tile_dot(x, e, mode)
    e_norms = None
    if kind == "neg_sq_dist":
      e_norms = pltriton.load(e_norms_ref.at[pl.ds(start, block_vocab)],
                              mask=in_vocab.reshape(block_vocab), other=0)[None, :]
    excluded = None
    if mask_ref is not None:
      excluded = pltriton.load(mask_ref.at[:, pl.ds(start, block_vocab)], mask=in_vocab,
                               other=0) != 0
    tile_keys = _tile_keys(dots, x_norms, e_norms, excluded, cols, kind, vocab)
    return _merge(keys, idx, tile_keys, cols, slots)

  first = pl.program_id(1) * tiles_per_split
  last = jnp.minimum(first + tiles_per_split, pl.cdiv(vocab, block_vocab))
  keys, idx = jax.lax.fori_loop(first, last, tile, _empty_slots(rows, slots))
  keys_ref[...] = keys
  idx_ref[...] = idx


def _triton_call(x, table, x_norms, e_norms, mask, slots, kind, mode, interpret, splits):
  """[splits, R, slots] keys and indices: each split's own top-`slots`."""
  from jax.experimental.pallas import triton as pltriton  # GPU-only module

  r, d = x.shape
  vocab = table.shape[0]
  b = _TRITON_BLOCKS
  depth = math.gcd(d, b["depth"])
  if depth < 16:
    raise ValueError(f"the Triton kernel needs d divisible by 16, got d={d}")
  rows = b["rows"]
  splits, tiles_per_split = vocab_splits_for(r // rows, pl.cdiv(vocab, b["vocab"]), splits)
  whole = lambda shape: pl.BlockSpec(shape, lambda i, s: (0,) * len(shape))
  in_specs = [pl.BlockSpec((rows, d), lambda i, s: (i, 0)), whole((vocab, d)),
              pl.BlockSpec((rows,), lambda i, s: (i,)), whole((vocab,))]
  operands = [x, table, x_norms, e_norms]
  if mask is not None:
    in_specs.append(pl.BlockSpec((rows, vocab), lambda i, s: (i, 0)))
    operands.append(mask)
  kernel = functools.partial(_triton_kernel, kind=kind, vocab=vocab, block_vocab=b["vocab"],
                             depth=depth, tiles_per_split=tiles_per_split, mode=mode)
  if mask is None:
    kernel = _without_mask(kernel, num_inputs=4)
  out_spec = pl.BlockSpec((None, rows, slots), lambda i, s: (s, i, 0))
  return pl.pallas_call(
      kernel, grid=(r // rows, splits), in_specs=in_specs, out_specs=[out_spec, out_spec],
      out_shape=[jax.ShapeDtypeStruct((splits, r, slots), jnp.int32)] * 2,
      compiler_params=pltriton.CompilerParams(num_warps=b["num_warps"],
                                              num_stages=b["num_stages"]),
      interpret=interpret, name="vocab_topk_triton")(*operands)


# --- TPU (Mosaic): grid (row blocks, vocabulary tiles), slots resident across tiles ---------


def _mosaic_kernel(x_ref, e_ref, x_norms_ref, e_norms_ref, mask_ref, keys_ref, idx_ref, *,
                   kind: str, vocab: int, mode: str):
  t = pl.program_id(1)
  rows, slots = keys_ref.shape
  block_vocab = e_ref.shape[0]

  @pl.when(t == 0)
  def _():
    keys_ref[...], idx_ref[...] = _empty_slots(rows, slots)

  cols = t * block_vocab + jax.lax.broadcasted_iota(jnp.int32, (1, block_vocab), 1)
  dots = _tile_dot(x_ref[...], e_ref[...], mode)
  x_norms = x_norms_ref[...] if kind == "neg_sq_dist" else None
  e_norms = e_norms_ref[...] if kind == "neg_sq_dist" else None
  excluded = None if mask_ref is None else mask_ref[...] != 0
  tile_keys = _tile_keys(dots, x_norms, e_norms, excluded, cols, kind, vocab)
  keys_ref[...], idx_ref[...] = _merge(keys_ref[...], idx_ref[...], tile_keys, cols, slots)


def _mosaic_call(x, table, x_norms, e_norms, mask, slots, kind, mode, interpret, splits):
  """[1, R, slots] keys and indices (the vocabulary in one split: a TPU's one or two cores
  are filled by the row blocks)."""
  from jax.experimental.pallas import tpu as pltpu  # TPU-only module

  del splits
  r, d = x.shape
  vocab = table.shape[0]
  rows, block_vocab = min(_MOSAIC_BLOCKS["rows"], r), _MOSAIC_BLOCKS["vocab"]
  grid = (r // rows, pl.cdiv(vocab, block_vocab))
  in_specs = [pl.BlockSpec((rows, d), lambda i, t: (i, 0)),
              pl.BlockSpec((block_vocab, d), lambda i, t: (t, 0)),
              pl.BlockSpec((rows, 1), lambda i, t: (i, 0)),
              pl.BlockSpec((1, block_vocab), lambda i, t: (0, t))]
  operands = [x, table, x_norms[:, None], e_norms[None, :]]
  if mask is not None:
    in_specs.append(pl.BlockSpec((rows, block_vocab), lambda i, t: (i, t)))
    operands.append(mask)
  kernel = functools.partial(_mosaic_kernel, kind=kind, vocab=vocab, mode=mode)
  if mask is None:
    kernel = _without_mask(kernel, num_inputs=4)
  out_spec = pl.BlockSpec((rows, slots), lambda i, t: (i, 0))
  keys, idx = pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs, out_specs=[out_spec, out_spec],
      out_shape=[jax.ShapeDtypeStruct((r, slots), jnp.int32)] * 2,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      interpret=interpret, name="vocab_topk_mosaic")(*operands)
  return keys[None], idx[None]


def _without_mask(kernel, num_inputs: int):
  """The kernel with mask_ref=None, for calls that pass no mask operand."""
  def wrapped(*refs):
    return kernel(*refs[:num_inputs], None, *refs[num_inputs:])
  return wrapped


# --- the public function ------------------------------------------------------------------


def _row_multiple(impl: str, rows: int) -> int:
  if impl == "triton":
    return _TRITON_BLOCKS["rows"]
  # Mosaic: whole blocks of 128 rows, or one block of the rows rounded up to 32 (the int8
  # mask's sublane tile).
  return _MOSAIC_BLOCKS["rows"] if rows > _MOSAIC_BLOCKS["rows"] else -(-rows // 32) * 32


def pallas_topk(x, table, k: int, kind: str, mask, impl: str, mode: str, interpret: bool,
                splits: int | None = None):
  """The kernel on x [R, d] (mask [R, V] or None): (values, indices) [R, k]."""
  r = x.shape[0]
  vocab = table.shape[0]
  x_norms = (reference.squared_norms(x) if kind == "neg_sq_dist"
             else jnp.zeros((r,), jnp.float32))
  e_norms = (reference.squared_norms(table) if kind == "neg_sq_dist"
             else jnp.zeros((vocab,), jnp.float32))
  multiple = _row_multiple(impl, r)
  padded = -(-r // multiple) * multiple
  pad = lambda a: jnp.pad(a, ((0, padded - r),) + ((0, 0),) * (a.ndim - 1))
  x, x_norms = pad(x), pad(x_norms)
  if mask is not None:
    mask = pad(mask.astype(jnp.int8))
  slots = 1 << (k - 1).bit_length()  # Triton tensors have power-of-two sizes
  call = _triton_call if impl == "triton" else _mosaic_call
  keys, idx = call(x, table, x_norms, e_norms, mask, slots, kind, mode, interpret, splits)
  # Each split's slots are unsorted: order all by key descending, then index ascending.
  gather = lambda a: jnp.moveaxis(a[:, :r], 0, 1).reshape(r, -1)
  inverted, idx = jax.lax.sort((~gather(keys), gather(idx)), dimension=1, num_keys=2)
  return _from_key(~inverted[:, :k]), idx[:, :k]


def _validate(x, table, k: int, kind: str, mask, impl: str) -> None:
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  if table.ndim != 2 or x.ndim < 1 or x.shape[-1] != table.shape[1]:
    raise ValueError(f"x [..., d] and table [V, d] disagree: {x.shape} and {table.shape}")
  if x.dtype != table.dtype or x.dtype not in (jnp.float32, jnp.bfloat16):
    raise ValueError(f"x and table must both be float32 or both bfloat16, got {x.dtype} and "
                     f"{table.dtype}")
  if not 1 <= k <= table.shape[0]:
    raise ValueError(f"k must lie in [1, V={table.shape[0]}], got {k}")
  if table.shape[0] >= _EMPTY_INDEX:
    raise ValueError(f"the vocabulary must be smaller than 2^30, got {table.shape[0]}")
  if mask is not None and (mask.dtype != jnp.bool_
                           or mask.shape != x.shape[:-1] + (table.shape[0],)):
    raise ValueError(f"mask must be bool {x.shape[:-1] + (table.shape[0],)}, got "
                     f"{mask.dtype}{mask.shape}")


@functools.partial(jax.jit, static_argnames=("k", "kind", "impl", "precision", "interpret",
                                             "vocab_splits"))
def topk(x: jax.Array, table: jax.Array, k: int, kind: str = "dot",
         mask: jax.Array | None = None, *, impl: str = "auto", precision: str | None = None,
         interpret: bool = False, vocab_splits: int | None = None
         ) -> tuple[jax.Array, jax.Array]:
  """The k best table rows for every query row (module docstring).

  Args:
    x: [..., d] query rows, float32 or bfloat16.
    table: [V, d] table rows (e.g. the token embeddings), the dtype of x.
    k: rows returned per query, 1 <= k <= V (static).
    kind: "dot" (largest <x, E[v]> first), "neg_dot" (smallest first) or "neg_sq_dist"
      (nearest in Euclidean distance first).
    mask: optional [..., V] bool, True where a table row is excluded for that query.
    impl: "platform" (the kernel on GPU and TPU, the reference elsewhere, chosen when
      the computation is lowered: `lax.platform_dependent`), "auto" (the same, except that
      a host whose default backend is the CPU takes the reference without tracing the
      kernels, which keeps CPU compilation as it was), "reference", "triton" or "mosaic".
    precision: "float32", "tensorfloat32" or "bfloat16"; None: JAX's default matmul
      precision (module docstring).
    interpret: run the Pallas kernel in interpret mode (any backend; for tests).
    vocab_splits: Triton only: programs the vocabulary is split among per row block
      (None: enough to fill the GPU, `vocab_splits_for`).

  Returns:
    (values [..., k] float32, indices [..., k] int32), best first; ties go to the lower
    index, and values equal the reference's.
  """
  _validate(x, table, k, kind, mask, impl)
  mode = matmul_precision(precision)
  if mode == "bfloat16":
    x, table = x.astype(jnp.bfloat16), table.astype(jnp.bfloat16)

  def ref(x, table, mask):
    return reference.topk(x, table, k, kind, mask)

  def kernel(which):
    def run(x, table, mask):
      lead = x.shape[:-1]
      flat_mask = None if mask is None else mask.reshape(-1, table.shape[0])
      values, idx = pallas_topk(x.reshape(-1, x.shape[-1]), table, k, kind, flat_mask,
                                which, mode, interpret, vocab_splits)
      return values.reshape(lead + (k,)), idx.reshape(lead + (k,))
    return run

  if impl == "reference" or (impl == "auto" and jax.default_backend() == "cpu"):
    return ref(x, table, mask)
  if impl in ("triton", "mosaic"):
    return kernel(impl)(x, table, mask)
  return jax.lax.platform_dependent(x, table, mask, default=ref, cuda=kernel("triton"),
                                    tpu=kernel("mosaic"))
