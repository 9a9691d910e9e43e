"""FSHA (Pasquini, Ateniese, Bernaschi, CCS'21) adapted to GPT-2: pilot, decoder, critic, losses.

The server trains a pilot encoder f~ and its inverse (the decoder) on public text, and a
critic D that tells the client's activations from pilot features. Instead of dL/dh it
returns the gradient of L_f = mean_b D(h_b), which pulls the client's layers into the
pilot's feature space; the decoder then inverts h. Losses, signs, update order and the
WGAN-GP penalty follow the official code (`pasquini-dario/SplitNN_FSHA`, `FSHA.py`); the
token-level networks are the design of notes/active-server.md section 4.4:

  normalised activations  n(h) = (h - off) / scale, per-dimension statistics of the first h
                          the server observes (it sees them anyway), so that neither the
                          critic nor the pilot wins on scale or outlier dimensions alone;
  pilot                   f~(x')[t] = sqrt(d) u / |u|, u = E[x'_t] + P[t]: the token-level
                          analogue of the official linear pilot (unit-RMS rows like n(h));
  decoder                 logits[t] = tau n_t E^T + b, tied to the pilot's E (token CE
                          replaces the official image MSE);
  critic                  D(n) = mean_t MLP([n_t, n_{t-1}]), 2d -> H -> H -> 1, GELU, no
                          normalisation layers (the official critic has none): the previous
                          position gives it context, without which it matches only the
                          marginal distribution of rows and cannot pin the token mapping.

Every function is pure; the server's state is a dict of arrays.
Shapes: x' [B, T] int32, h / n / z [B, T, d], logits [B, T, V].
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class FSHASpec:
  """FSHA's hyper-parameters (hashable: a static jit argument).

  Attributes:
    vocab_size, seq_len, width: V, T and d of the split.
    critic_hidden: H, the critic MLP's width (notes 4.8: 256).
    gp_weight: w_gp of the WGAN-GP penalty (official: 500).
    lr_pilot: Adam lr of pilot + decoder during the hijack (official lr_tilde 1e-5).
    lr_critic: Adam lr of the critic (official lr_D 1e-4).
    critic_steps: critic updates per client step on the same batches (official 1).
    train_pilot: keep training pilot/decoder on L_ae during the hijack (official). Where
      pre-training already drives L_ae to 0 in float32 its gradient is 0 and the update
      changes nothing, so turning it off only saves the V-wide softmax.
    alpha: scale of the returned gradient (official 1; FSHA_distcor's alpha2 = 50).
    stats_steps: the first steps whose h set the per-dimension statistics (their running
      mean); frozen afterwards, so that the pilot's feature space is a fixed target in h
      space (statistics that follow h would move the target as the client moves).
    zero_last_row: return g[:, T-1] = 0, like an honest gradient (h[:, T-1] reaches no loss
      term), instead of a free tell.
  """

  vocab_size: int
  seq_len: int
  width: int
  critic_hidden: int = 256
  gp_weight: float = 500.0
  lr_pilot: float = 1e-5
  lr_critic: float = 1e-4
  critic_steps: int = 1
  train_pilot: bool = True
  alpha: float = 1.0
  stats_steps: int = 1
  zero_last_row: bool = True


# --- pilot and decoder ---------------------------------------------------------------------


def init_pilot(spec: FSHASpec, key: jax.Array) -> dict:
  """E [V, d] ~ N(0, 1) (random unit-variance rows already invert almost perfectly in
  d dimensions), P [T, d] ~ N(0, 0.1^2), decoder temperature tau and bias b [V]."""
  k_emb, k_pos = jax.random.split(key)
  return {"emb": jax.random.normal(k_emb, (spec.vocab_size, spec.width), jnp.float32),
          "pos": 0.1 * jax.random.normal(k_pos, (spec.seq_len, spec.width), jnp.float32),
          "tau": jnp.ones((), jnp.float32),
          "bias": jnp.zeros((spec.vocab_size,), jnp.float32)}


def unit_rms(u: jax.Array) -> jax.Array:
  """Rows [..., d] scaled to RMS 1 (norm sqrt(d))."""
  return u * jax.lax.rsqrt(jnp.mean(u * u, axis=-1, keepdims=True) + 1e-12)


def pilot_features(pilot: dict, tokens: jax.Array) -> jax.Array:
  """f~: tokens [B, T] -> normalised features [B, T, d]."""
  return unit_rms(pilot["emb"][tokens] + pilot["pos"][: tokens.shape[-1]])


def decoder_logits(decoder: dict, n: jax.Array) -> jax.Array:
  """f~^-1 before the softmax: normalised features [..., d] -> logits [..., V]."""
  return decoder["tau"] * (n @ decoder["emb"].T) + decoder["bias"]


def autoencoder_loss(pilot: dict, tokens: jax.Array) -> jax.Array:
  """L_ae: mean token CE of decoding the pilot's own features of public tokens [B, T]."""
  logits = decoder_logits(pilot, pilot_features(pilot, tokens))
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()


# --- normalisation of h -----------------------------------------------------------------------


def init_stats(spec: FSHASpec) -> dict:
  return {"off": jnp.zeros((spec.width,), jnp.float32),
          "scale": jnp.ones((spec.width,), jnp.float32),
          "count": jnp.zeros((), jnp.int32)}


def update_stats(spec: FSHASpec, stats: dict, h: jax.Array) -> dict:
  """The per-dimension mean and std of h [B, T, d], averaged over the first
  `spec.stats_steps` batches, then left unchanged."""
  mean = jnp.mean(h, axis=(0, 1))
  std = jnp.sqrt(jnp.var(h, axis=(0, 1)) + 1e-6)
  count = stats["count"]
  weight = jnp.where(count < spec.stats_steps, 1.0 / (count + 1.0), 0.0)
  return {"off": (1 - weight) * stats["off"] + weight * mean,
          "scale": (1 - weight) * stats["scale"] + weight * std,
          "count": jnp.minimum(count + 1, spec.stats_steps)}


def normalise(stats: dict, h: jax.Array) -> jax.Array:
  """n(h) = (h - off) / scale; the statistics are constants (no gradient flows into them)."""
  off, scale = jax.lax.stop_gradient(stats["off"]), jax.lax.stop_gradient(stats["scale"])
  return (h - off) / scale


# --- critic ---------------------------------------------------------------------------------


def init_critic(spec: FSHASpec, key: jax.Array) -> dict:
  """LeCun-normal kernels (Keras/Flax default), zero biases."""
  d2, hid = 2 * spec.width, spec.critic_hidden
  k1, k2, k3 = jax.random.split(key, 3)
  dense = lambda k, i, o: {"w": jax.random.normal(k, (i, o), jnp.float32) / math.sqrt(i),
                           "b": jnp.zeros((o,), jnp.float32)}
  return {"l1": dense(k1, d2, hid), "l2": dense(k2, hid, hid), "l3": dense(k3, hid, 1)}


def critic_one(critic: dict, n: jax.Array) -> jax.Array:
  """D of one sequence: n [T, d] -> scalar mean_t MLP([n_t, n_{t-1}]) (n_{-1} = 0)."""
  prev = jnp.concatenate([jnp.zeros_like(n[:1]), n[:-1]], axis=0)
  x = jnp.concatenate([n, prev], axis=-1)
  x = jax.nn.gelu(x @ critic["l1"]["w"] + critic["l1"]["b"])
  x = jax.nn.gelu(x @ critic["l2"]["w"] + critic["l2"]["b"])
  return jnp.mean(x @ critic["l3"]["w"] + critic["l3"]["b"])


def critic_scores(critic: dict, n: jax.Array) -> jax.Array:
  """D per sequence: [B, T, d] -> [B]."""
  return jax.vmap(critic_one, in_axes=(None, 0))(critic, n)


def gradient_penalty(critic: dict, real: jax.Array, fake: jax.Array, key: jax.Array) -> jax.Array:
  """GP = mean_b (||dD(x^_b)/dx^_b|| - 1)^2, x^ = e real + (1 - e) fake, e ~ U(0, 1) per
  sample; the norm is over the whole [T, d] sample (official `gradient_penalty`)."""
  e = jax.random.uniform(key, (real.shape[0], 1, 1), real.dtype)
  mixed = e * real + (1.0 - e) * fake
  grads = jax.vmap(jax.grad(critic_one, argnums=1), in_axes=(None, 0))(critic, mixed)
  norms = jnp.sqrt(jnp.sum(grads * grads, axis=(1, 2)))
  return jnp.mean((norms - 1.0) ** 2)


def critic_loss(spec: FSHASpec, critic: dict, n_client: jax.Array, z_pilot: jax.Array,
                key: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(L_D, GP): L_D = mean D(z') - mean D(n(h)) + w_gp GP(n(h), z') (official signs: the
  critic scores pilot features low and client features high)."""
  gp = gradient_penalty(critic, n_client, z_pilot, key)
  return (jnp.mean(critic_scores(critic, z_pilot)) - jnp.mean(critic_scores(critic, n_client))
          + spec.gp_weight * gp), gp


def client_objective(critic: dict, stats: dict, h: jax.Array) -> jax.Array:
  """L_f = mean_b D(n(h_b)): what the hijacked client is made to minimise."""
  return jnp.mean(critic_scores(critic, normalise(stats, h)))


def adversarial_gradient(spec: FSHASpec, critic: dict, stats: dict,
                         h: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(L_f, g = alpha dL_f/dh [B, T, d]), the last row of g zeroed if `spec.zero_last_row`."""
  value, g = jax.value_and_grad(client_objective, argnums=2)(critic, stats, h)
  g = spec.alpha * g
  if spec.zero_last_row:
    g = g.at[:, -1].set(0.0)
  return value, g


# --- the server's state and one hijacking step --------------------------------------------------


def optimizers(spec: FSHASpec):
  """(pilot, critic) Adam with Keras defaults (official: Adam for all three networks)."""
  return optax.adam(spec.lr_pilot), optax.adam(spec.lr_critic)


def init_state(spec: FSHASpec, pilot: dict, key: jax.Array) -> dict:
  """The server's FSHA state: a (pre-trained) pilot/decoder, a fresh critic, statistics."""
  critic = init_critic(spec, key)
  pilot_tx, critic_tx = optimizers(spec)
  return {"pilot": pilot, "critic": critic, "stats": init_stats(spec),
          "pilot_opt": pilot_tx.init(pilot), "critic_opt": critic_tx.init(critic)}


def hijack_step(spec: FSHASpec, state: dict, h: jax.Array, public: jax.Array, key: jax.Array):
  """One FSHA server step on the observed h [B, T, d] and a public batch [B, T].

  Order as the official `train_step`: g from the pre-update critic (after the statistics
  take in this h), then one pilot/decoder step on L_ae and `critic_steps` critic steps on
  L_D (official: one; the k-th uses the key folded with k for its interpolation draw).

  Returns:
    (new state, g [B, T, d], log {ae_loss (if the pilot trains), critic_loss, gp,
    critic_client (= L_f), critic_pilot}): the critic's scores are the pre-update critic's.
  """
  stats = update_stats(spec, state["stats"], h)
  objective, g = adversarial_gradient(spec, state["critic"], stats, h)
  n_client = normalise(stats, h)
  z_pilot = pilot_features(state["pilot"], public)
  pilot_tx, critic_tx = optimizers(spec)
  pilot, pilot_opt, log = state["pilot"], state["pilot_opt"], {}
  if spec.train_pilot:
    ae, g_pilot = jax.value_and_grad(autoencoder_loss)(pilot, public)
    upd, pilot_opt = pilot_tx.update(g_pilot, pilot_opt, pilot)
    pilot = optax.apply_updates(pilot, upd)
    log["ae_loss"] = ae
  critic, critic_opt = state["critic"], state["critic_opt"]
  for i in range(spec.critic_steps):
    (loss, gp), g_critic = jax.value_and_grad(critic_loss, argnums=1, has_aux=True)(
        spec, critic, n_client, z_pilot, jax.random.fold_in(key, i))
    if i == 0:
      ld, gp0 = loss, gp
    upd, critic_opt = critic_tx.update(g_critic, critic_opt, critic)
    critic = optax.apply_updates(critic, upd)
  log.update(critic_loss=ld, gp=gp0, critic_client=objective,
             critic_pilot=jnp.mean(critic_scores(state["critic"], z_pilot)))
  new = {"pilot": pilot, "critic": critic, "stats": stats, "pilot_opt": pilot_opt,
         "critic_opt": critic_opt}
  return new, g, log


# --- pre-training the pilot/decoder on public text -------------------------------------------


def pretrain_step(pilot: dict, opt_state, tokens: jax.Array, lr: float):
  """One Adam step of L_ae on public tokens [B, T]: (pilot, opt_state, loss)."""
  tx = optax.adam(lr)
  loss, grads = jax.value_and_grad(autoencoder_loss)(pilot, tokens)
  upd, opt_state = tx.update(grads, opt_state, pilot)
  return optax.apply_updates(pilot, upd), opt_state, loss


pretrain_step_jit = jax.jit(pretrain_step, static_argnames=("lr",))


def pretrain(pilot: dict, batches, lr: float) -> tuple[dict, list[float]]:
  """Pilot/decoder pre-training on an iterable of public batches [B, T]: (pilot, losses)."""
  opt_state = optax.adam(lr).init(pilot)
  losses = []
  for tokens in batches:
    pilot, opt_state, loss = pretrain_step_jit(pilot, opt_state, tokens, lr=lr)
    losses.append(loss)
  return pilot, [float(x) for x in jax.device_get(losses)]


# --- the attack: invert h --------------------------------------------------------------------


def decoder_of(state: dict) -> dict:
  """What the attack needs to invert h: the decoder and the statistics that normalise h."""
  return {"emb": state["pilot"]["emb"], "tau": state["pilot"]["tau"],
          "bias": state["pilot"]["bias"], "off": state["stats"]["off"],
          "scale": state["stats"]["scale"]}


@jax.jit
def invert(emb, tau, bias, off, scale, h):
  """argmax_v f~^-1(n(h)) per position: h [B, T, d] -> tokens [B, T] int32."""
  n = (h - off) / scale
  return jnp.argmax(tau * (n @ emb.T) + bias, axis=-1).astype(jnp.int32)


def invert_flops(positions: int, vocab: int, width: int) -> float:
  return 2.0 * positions * vocab * width
