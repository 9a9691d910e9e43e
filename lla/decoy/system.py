"""The training-time split with decoy rows (PROTOCOL section 7) as one pure, jitted step.

A trusted local node (TLN) owns the model's prefix (embed + blocks[0:k]; GPT-2 or a RoPE
family, lla.model.split), a private linear
encoder d -> D and decoder D -> d, the tail (blocks[k:L], final norm, head), the loss and the
labels. An untrusted cloud node (UCN) trains a radial row-wise map on D-dimensional rows.
Per step the TLN sends one frame (real rows + decoys, permuted and Haar-rotated), the UCN
returns its output frame, the TLN returns dL/d(UCN output) in wire coordinates, and the
UCN returns dL/d(UCN input) so that the TLN can train its prefix and encoder too.

Every random draw comes from the step's explicit key, so a step is a pure function of
(state, block, key): a run is a `lax.scan` over steps and is bit-reproducible.

Shapes: R = n_real (32 rows, one block), M = R + n_decoy (80), D the wire width (64),
d = n_embd, P pool rows, S steps. A block is R + 1 tokens: inputs tokens[:R] and targets
tokens[1:], so every real row carries a loss term (with only R tokens the last row would
have no target and its returned gradient would be structurally zero).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lla.model import split


@dataclasses.dataclass(frozen=True)
class SplitSpec:
  """Static description of the system (hashable: a jit static argument).

  Attributes:
    cfg: the model's architecture (any family); cut: k, the number of prefix blocks.
    n_real: real rows per frame (block length); n_decoy: decoy rows per frame.
    width: D, the wire width; pool_size: P, recently sent real latents decoys come from.
    fwd_clip: C, L2 clip of every real row before it is sent.
    fwd_noise: per-coordinate Gaussian std of the forward noise, in units of C.
    grad_clip: C_g of the mitigation (clip of every returned-gradient row); 0 = off.
    grad_noise: per-coordinate std of the mitigation's noise, in units of C_g.
    ucn_hidden: hidden width of the UCN's scalar MLP phi.
    train_model: whether the TLN also trains the model's prefix and tail (else only the codec).
    lr_tln, lr_ucn, weight_decay: AdamW settings of the two nodes.
  """
  cfg: split.ModelConfig
  cut: int
  n_real: int = 32
  n_decoy: int = 48
  width: int = 64
  pool_size: int = 8192
  fwd_clip: float = 1.0
  fwd_noise: float = 0.02
  grad_clip: float = 0.0
  grad_noise: float = 0.35
  ucn_hidden: int = 32
  train_model: bool = True
  lr_tln: float = 1e-3
  lr_ucn: float = 1e-3
  weight_decay: float = 0.01

  def __post_init__(self):
    if not 1 <= self.cut < self.cfg.n_layer:
      raise ValueError(f"cut={self.cut} must satisfy 1 <= cut < n_layer={self.cfg.n_layer}")
    if self.pool_size % self.n_real or self.pool_size < self.n_decoy:
      raise ValueError(f"pool_size={self.pool_size} must be a multiple of n_real={self.n_real}"
                       f" and at least n_decoy={self.n_decoy}")

  @property
  def n_rows(self) -> int:
    return self.n_real + self.n_decoy


# --- The gauge: secret permutation and Haar rotation ------------------------------------


def haar(key: jax.Array, dim: int) -> jax.Array:
  """A Haar-distributed orthogonal [dim, dim]: QR of a Gaussian, with the sign fix.

  Without multiplying the columns of Q by sign(diag(R)) the distribution is not Haar.
  """
  q, r = jnp.linalg.qr(jax.random.normal(key, (dim, dim), jnp.float32))
  return q * jnp.sign(jnp.diag(r))[None, :]


def to_wire(rows: jax.Array, perm: jax.Array, rot: jax.Array) -> jax.Array:
  """Rows [M, D] in TLN order -> frame [M, D]: wire row i is rows[perm[i]] @ rot."""
  return rows[perm] @ rot


def from_wire(frame: jax.Array, perm: jax.Array, rot: jax.Array) -> jax.Array:
  """Inverse of `to_wire`: frame [M, D] -> rows [M, D] in TLN order.

  A gather by the inverse permutation: its transpose is a scatter, so rows the caller
  drops get gradients that are exactly zero, not merely small.
  """
  return (frame @ rot.T)[jnp.argsort(perm)]


# --- The UCN: a radial row-wise map ---------------------------------------------------------


def init_ucn(key: jax.Array, hidden: int) -> dict:
  """phi's parameters; the output layer starts at zero so that the UCN starts as identity."""
  return {"w1": jax.random.normal(key, (1, hidden)) , "b1": jnp.zeros(hidden),
          "w2": jnp.zeros((hidden, 1)), "b2": jnp.zeros(1)}


def row_norm(x: jax.Array) -> jax.Array:
  """[..., D] -> [..., 1]; the epsilon keeps the gradient finite at a zero row."""
  return jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-12)


def ucn_apply(params: dict, x: jax.Array) -> jax.Array:
  """x [..., D] -> x * phi(||x||) with phi(r) = 1 + MLP(r).

  A function of each row's norm times the row: it commutes with any rotation of the rows
  and any permutation of them, so the gauge never changes what the UCN computes.
  """
  r = row_norm(x)
  hidden = jax.nn.gelu(r @ params["w1"] + params["b1"])
  return x * (1.0 + hidden @ params["w2"] + params["b2"])


# --- The TLN --------------------------------------------------------------------------------


def init_codec(key: jax.Array, d: int, width: int) -> dict:
  k_enc, k_dec = jax.random.split(key)
  return {"enc": {"w": jax.random.normal(k_enc, (d, width)) / np.sqrt(d), "b": jnp.zeros(width)},
          "dec": {"w": jax.random.normal(k_dec, (width, d)) / np.sqrt(width), "b": jnp.zeros(d)}}


def clip_rows(x: jax.Array, c: float) -> jax.Array:
  """Scales every row [..., D] with norm above c down to norm c."""
  return x * jnp.minimum(1.0, c / row_norm(x))


def encode(spec: SplitSpec, tln: dict, inputs: jax.Array, key: jax.Array) -> jax.Array:
  """Real rows as sent: inputs [R] int -> clip(enc(prefix(inputs)), C) + noise, [R, D]."""
  model = split.module(spec.cfg)
  x = model.apply({"params": tln["model"]}, inputs[None], method="embed")
  h = model.apply({"params": tln["model"]}, x, 0, spec.cut, method="blocks")[0]
  z = clip_rows(h @ tln["enc"]["w"] + tln["enc"]["b"], spec.fwd_clip)
  return z + spec.fwd_noise * spec.fwd_clip * jax.random.normal(key, z.shape)


def tail_loss(spec: SplitSpec, tln: dict, real_out: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean CE of the tail on decoded real rows: real_out [R, D], targets [R] -> scalar."""
  x = (real_out @ tln["dec"]["w"] + tln["dec"]["b"])[None]
  logits = split.server_logits(tln["model"], spec.cfg, x, spec.cut)[0]
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def mitigate(spec: SplitSpec, grad: jax.Array, key: jax.Array) -> jax.Array:
  """Clip every row (decoys too) to C_g and add N(0, (grad_noise C_g)^2) per coordinate."""
  noise = spec.grad_noise * spec.grad_clip * jax.random.normal(key, grad.shape)
  return clip_rows(grad, spec.grad_clip) + noise


def _optimizers(spec: SplitSpec):
  tln_opt = optax.adamw(spec.lr_tln, weight_decay=spec.weight_decay)
  if not spec.train_model:
    labels = lambda p: {k: jax.tree.map(lambda _: "frozen" if k == "model" else "train", v)
                        for k, v in p.items()}
    tln_opt = optax.multi_transform({"train": tln_opt, "frozen": optax.set_to_zero()}, labels)
  return tln_opt, optax.adamw(spec.lr_ucn, weight_decay=spec.weight_decay)


# --- State, one step, a scanned run -------------------------------------------------------------


def init_state(spec: SplitSpec, model_params: dict, pool_blocks: jax.Array, key: jax.Array):
  """The state of both nodes before step 0.

  Args:
    model_params: the TLN's model (pretrained or random).
    pool_blocks: [P / R, R + 1] tokens; the TLN encodes them to fill the decoy pool, as if
      they had been sent just before the run.
    key: init key.

  Returns:
    state dict: tln, ucn, tln_opt, ucn_opt, pool [P, D], ptr (next pool row to overwrite).
  """
  k_codec, k_ucn, k_pool = jax.random.split(key, 3)
  tln = {"model": model_params, **init_codec(k_codec, spec.cfg.n_embd, spec.width)}
  ucn = init_ucn(k_ucn, spec.ucn_hidden)
  keys = jax.random.split(k_pool, pool_blocks.shape[0])
  pool = jax.jit(jax.vmap(lambda b, k: encode(spec, tln, b[:-1], k)))(pool_blocks, keys)
  tln_opt, ucn_opt = _optimizers(spec)
  return {"tln": tln, "ucn": ucn, "tln_opt": tln_opt.init(tln), "ucn_opt": ucn_opt.init(ucn),
          "pool": pool.reshape(spec.pool_size, spec.width), "ptr": jnp.zeros((), jnp.int32)}


def step(spec: SplitSpec, state: dict, block: jax.Array, key: jax.Array,
         ucn_offset: jax.Array | None = None):
  """One training step of both nodes.

  Args:
    state: as returned by `init_state`.
    block: [R + 1] int tokens (inputs block[:R], targets block[1:]).
    key: this step's key; every secret (noise, decoys, permutation, rotation) derives from it.
    ucn_offset: [M, D] added by a malicious UCN to its output frame
      (lla.active.decoy_probe); None for the honest system.

  Returns:
    (new state, out) with out = {forward [M, D] the frame sent, gradient [M, D] the
    returned gradient as the UCN receives it, perm [M] (wire row i holds TLN row perm[i];
    rows < R are real), loss scalar}.
  """
  k_noise, k_decoy, k_perm, k_rot, k_mit = jax.random.split(key, 5)
  tln, ucn, r = state["tln"], state["ucn"], spec.n_real

  real, fwd_vjp = jax.vjp(lambda p: encode(spec, p, block[:-1], k_noise), tln)
  # Decoys are old real rows already sent; they are constants of this step.
  decoys = state["pool"][jax.random.choice(k_decoy, spec.pool_size, (spec.n_decoy,),
                                           replace=False)]
  perm = jax.random.permutation(k_perm, spec.n_rows)
  rot = haar(k_rot, spec.width)
  frame_in = to_wire(jnp.concatenate([real, decoys]), perm, rot)

  frame_out, ucn_vjp = jax.vjp(ucn_apply, ucn, frame_in)  # UCN forward.
  if ucn_offset is not None:
    frame_out = frame_out + ucn_offset

  def loss_of(p, out):
    return tail_loss(spec, p, from_wire(out, perm, rot)[:r], block[1:])

  loss, (g_tln_tail, g_out) = jax.value_and_grad(loss_of, argnums=(0, 1))(tln, frame_out)
  if spec.grad_clip > 0:
    g_out = mitigate(spec, g_out, k_mit)
  g_ucn, g_in = ucn_vjp(g_out)  # UCN backward; g_in travels back to the TLN.
  (g_tln_fwd,) = fwd_vjp(from_wire(g_in, perm, rot)[:r])
  g_tln = jax.tree.map(jnp.add, g_tln_tail, g_tln_fwd)

  tln_tx, ucn_tx = _optimizers(spec)
  upd, tln_opt = tln_tx.update(g_tln, state["tln_opt"], tln)
  tln = optax.apply_updates(tln, upd)
  upd, ucn_opt = ucn_tx.update(g_ucn, state["ucn_opt"], ucn)
  ucn = optax.apply_updates(ucn, upd)
  pool = jax.lax.dynamic_update_slice(state["pool"], jax.lax.stop_gradient(real),
                                      (state["ptr"], 0))
  new_state = {"tln": tln, "ucn": ucn, "tln_opt": tln_opt, "ucn_opt": ucn_opt, "pool": pool,
               "ptr": (state["ptr"] + r) % spec.pool_size}
  return new_state, {"forward": frame_in, "gradient": g_out, "perm": perm, "loss": loss}


@functools.partial(jax.jit, static_argnames=("spec",))
def run_steps(spec: SplitSpec, state: dict, blocks: jax.Array, keys: jax.Array):
  """`lax.scan` of `step` over blocks [n, R + 1] and keys [n]; outputs stacked on axis 0."""
  return jax.lax.scan(lambda s, xs: step(spec, s, *xs), state, (blocks, keys))


@functools.partial(jax.jit, static_argnames=("spec",))
def heldout_ce(spec: SplitSpec, tln: dict, ucn: dict, blocks: jax.Array, key: jax.Array):
  """Mean next-token CE of the deployed pipeline on held-out blocks [N, R + 1].

  The forward protection (clip + noise, fixed key) stays on: it is part of the model the
  TLN would deploy. Decoys and the gauge are skipped: the UCN is row-wise and commutes with
  rotation and permutation (tested), so they cannot change the real rows' outputs.
  """
  def one(b, k):
    return tail_loss(spec, tln, ucn_apply(ucn, encode(spec, tln, b[:-1], k)), b[1:])
  return jax.vmap(one)(blocks, jax.random.split(key, blocks.shape[0])).mean()


def train(spec: SplitSpec, state: dict, blocks: np.ndarray, key: jax.Array, chunk: int = 256,
          log=None):
  """Trains both nodes over blocks [S, R + 1] from `state` and returns everything the UCN saw.

  Args:
    key: the run key; step s uses the s-th of `jax.random.split(key, S)`.
    chunk: steps per compiled scan call (bounds the memory of the stacked frames).
    log: optional callable(steps done, mean loss of the chunk).

  Returns:
    (state, capture) with capture = numpy {forward [S, M, D], gradient [S, M, D],
    perm [S, M] int32, loss [S]}.
  """
  keys = jax.random.split(key, len(blocks))
  outs = []
  for start in range(0, len(blocks), chunk):
    state, out = run_steps(spec, state, jnp.asarray(blocks[start:start + chunk]),
                           keys[start:start + chunk])
    outs.append(jax.device_get(out))
    if log is not None:
      log(start + len(out["loss"]), float(np.mean(out["loss"])))
  capture = {name: np.concatenate([o[name] for o in outs]) for name in outs[0]}
  return state, capture
