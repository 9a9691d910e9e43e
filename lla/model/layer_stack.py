"""The computation form of a model's parameters: its layers stacked, run as one scanned body.

The HF-named tree (GPT-2's `h_{i}/...`, the RoPE families' `layers_{i}/...`) is the form on
disk, in hashes, in the client's and server's shares and in training's per-layer masks and
gradients. For computation, `stack` makes another tree from it once: the same top-level
entries, but the L layers' subtrees replaced by one subtree `STACK` whose leaves have a
leading layer axis `[L, ...]`. Given that form, the models' `blocks` and `blocks_step` run a
range of layers as one `jax.lax.scan` of a single layer body (`scan`), so a program that runs
blocks start..stop-1 has the size of one layer whatever the depth or the cut. Given the
HF-named tree, they unroll the layers as before (what differentiating the named parameters
needs, and what costs no conversion inside a traced function).

The stack is made outside the traced function, not inside it: stacking inside copies every
layer's weights on every call, which on CPU made the one-token step 3x slower
(docs/benchmarks.md section 16). `computation_form` caches the stack of a tree, so that a
caller converts each model once. On CPU the scanned one-token step is still slower warm than
the unrolled one (each iteration copies its layer's weights out of the stack; section 16),
so the attacks' workspace passes this form where its `layer_form` asks (by default on GPU
and TPU, not on CPU); the captures (many rows per call, where the copy is hidden, and one
program per cut) run on the stack.

XLA's cost analysis counts a while loop's body once: the loops are named (`LOOP_SCOPE`) so
that the attacks' FLOP meter adds their other iterations (`workspace._layer_loop_flops`).
"""

from __future__ import annotations

import collections
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

STACK = "layer_stack"  # the top-level key of the stacked layers in the computation form
LOOP_SCOPE = "lla_layer_loop"  # in the op_name of every layer loop's HLO while
_CACHE_SIZE = 4  # trees whose stacks are kept (each a second copy of the layers' weights)
_CACHE: collections.OrderedDict = collections.OrderedDict()


def layer_names(params: dict) -> list[str]:
  """The HF-named layers' top-level keys in order: `h_0, h_1, ...` (GPT-2, which has
  `wte`) or `layers_0, layers_1, ...`."""
  prefix = "h_" if "wte" in params else "layers_"
  names = []
  while f"{prefix}{len(names)}" in params:
    names.append(f"{prefix}{len(names)}")
  return names


def stack(params: dict, n_layer: int) -> dict:
  """The computation form of an HF-named tree holding all `n_layer` layers (module
  docstring); a tree already stacked, or holding only some layers (a party's share), is
  returned as it is."""
  names = layer_names(params)
  if STACK in params or len(names) != n_layer:
    return params
  form = {key: value for key, value in params.items() if key not in names}
  form[STACK] = jax.tree.map(lambda *leaves: jnp.stack(leaves), *[params[n] for n in names])
  return form


def computation_form(params: dict, n_layer: int) -> dict:
  """`stack(params, n_layer)`, made once per tree (kept for the `_CACHE_SIZE` trees last
  asked for). Inside a traced function (leaves are tracers) the tree is returned as it is:
  stacking there would copy the weights on every call."""
  if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(params)):
    return params
  key = (id(params), n_layer)
  if key in _CACHE and _CACHE[key][0] is params:
    _CACHE.move_to_end(key)
    return _CACHE[key][1]
  form = stack(params, n_layer)
  _CACHE[key] = (params, form)  # the tree itself is kept, so its id is not reused
  while len(_CACHE) > _CACHE_SIZE:
    _CACHE.popitem(last=False)
  return form


def is_stacked(module: nn.Module) -> bool:
  """Whether a bound model module was applied to the computation form."""
  return not module.is_initializing() and STACK in module.variables.get("params", {})


def scan(parent: nn.Module, body: nn.Module, fn: Callable, carry, start: int, stop: int,
         xs=None, first_apart: bool = False):
  """`carry, y_i = fn(body bound to layer i, carry, i, xs_i)` for i = start..stop-1.

  Layer i's parameters are read from the stack by index inside the loop, so the range is
  never sliced out of the stack (a copy of its weights).

  Args:
    parent: the bound model module, applied to the computation form.
    body: an unbound module of the layers' class and config (`parent=None`).
    fn: (module, carry, i [int32 scalar], x_i) -> (carry, y_i), the same for every layer.
    carry: the residual stream.
    xs: None or a pytree of per-layer arrays with leading axis stop - start.
    first_apart: the first layer outside the loop, so that XLA still sees its input and
      can share its work between identical ones: the one-token step's first block on a
      candidate token is the same for every beam of a beam search (computed once, as with
      the layers unrolled, not once per beam).

  Returns:
    (carry, ys stacked along a leading axis of stop - start, or None for an empty range).
  """
  stacked = parent.variables["params"][STACK]

  def layer(i, carry, x):
    params = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), stacked)
    return body.apply({"params": params}, carry, i, x, method=fn)

  if start == stop:
    return carry, None
  if first_apart:
    carry, first = layer(jnp.int32(start), carry, jax.tree.map(lambda a: a[0], xs))
    carry, rest = scan(parent, body, fn, carry, start + 1, stop,
                       jax.tree.map(lambda a: a[1:], xs))
    return carry, (jax.tree.map(lambda a: a[None], first) if rest is None else
                   jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), first, rest))
  with jax.named_scope(LOOP_SCOPE):
    return jax.lax.scan(lambda c, ix: layer(ix[0], c, ix[1]), carry,
                        (jnp.arange(start, stop, dtype=jnp.int32), xs))
