"""Shared, lazily computed stages of a replay, batched over documents.

Attacks on one capture share stages (the ridge decoder, activation candidates, the
gradient ranking). A `Workspace` computes each once, in document chunks sized to a memory
budget, sharded over the devices of a mesh axis `docs` when there are several, and
records each stage's FLOPs so that every attack is charged the full cost of the stages
it uses, as if it had run alone.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lla.attacks import candidates as cand_lib
from lla.attacks import ridge
from lla.model import split
from lla.model.gpt2 import GPT2Config


@dataclasses.dataclass(frozen=True)
class StageCost:
  flops: float
  source: str        # "xla" or "analytic"
  analytic: float


def xla_flops(lowered) -> float | None:
  """FLOPs from XLA's cost analysis of a lowered computation; None where unavailable."""
  try:
    cost = lowered.compile().cost_analysis()
  except Exception:  # Backends without cost analysis raise assorted errors.
    return None
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  flops = (cost or {}).get("flops")
  return float(flops) if flops and flops > 0 else None


def document_mesh() -> Mesh | None:
  """A 1-D mesh over every device (axis `docs`), or None on a single device."""
  devices = jax.devices()
  return Mesh(np.array(devices), ("docs",)) if len(devices) > 1 else None


def map_documents(fn: Callable, arrays: tuple, chunk: int, mesh: Mesh | None,
                  cost_of: Callable | None = None):
  """Applies fn to document chunks of `arrays` (all [B, ...]) and concatenates.

  Every chunk is padded to the same size (one compilation) and, with a mesh, to a
  multiple of the device count and placed with a `docs`-sharded NamedSharding so that jit
  partitions the batch; the scheduling is XLA's. Outputs are identical for any chunking
  because every function passed here treats documents independently.

  Returns:
    (outputs, flops of all chunks or None). `cost_of(lowered)` turns one chunk's lowered
    computation into FLOPs.
  """
  num_docs = arrays[0].shape[0]
  devices = 1 if mesh is None else mesh.devices.size
  chunk = max(devices, min(chunk, num_docs) // devices * devices)
  chunk = int(math.ceil(chunk / devices) * devices)
  num_chunks = int(math.ceil(num_docs / chunk))
  outputs, flops = [], None
  for i in range(num_chunks):
    piece = [np.asarray(a[i * chunk:(i + 1) * chunk]) for a in arrays]
    real = piece[0].shape[0]
    if real < chunk:
      piece = [np.concatenate([p, np.repeat(p[-1:], chunk - real, axis=0)]) for p in piece]
    if mesh is not None:
      piece = [jax.device_put(p, NamedSharding(mesh, PartitionSpec("docs"))) for p in piece]
    if i == 0 and cost_of is not None:
      one = cost_of(*piece)
      flops = None if one is None else one * num_chunks
    result = fn(*piece)
    outputs.append(jax.tree_util.tree_map(lambda x: np.asarray(x)[:real], result))
  return jax.tree_util.tree_map(lambda *xs: np.concatenate(xs), *outputs), flops


@dataclasses.dataclass
class Workspace:
  """One capture, one attacker. Arrays are numpy on the host.

  Attributes:
    activations: [B, T, d] observed forward messages.
    gradients: [B, T, d] observed backward messages or None.
    params, cfg: the attacker's copy of the model (exact client weights under `public`
      knowledge, pre-trained ones under `trained`).
    cut: k.
    calibration_tokens: [N, T] int32 public calibration documents.
    ridge_alpha: ridge strength relative to trace(Hc^T Hc)/d.
    memory_budget_bytes: per-chunk working-set budget.
    mesh: document mesh or None.
    calibration_transform: for defense-aware attackers, the defense's mechanism with the
      attacker's own randomness, applied to the calibration activations [N, T, d] before
      the ridge fit; None for a defense-unaware attacker.
  """

  activations: np.ndarray
  gradients: np.ndarray | None
  params: dict
  cfg: GPT2Config
  cut: int
  calibration_tokens: np.ndarray
  ridge_alpha: float = 1e-3
  memory_budget_bytes: int = 2 << 30
  mesh: Mesh | None = None
  calibration_transform: Callable[[np.ndarray], np.ndarray] | None = None
  costs: dict = dataclasses.field(default_factory=dict)
  _cache: dict = dataclasses.field(default_factory=dict)

  @property
  def num_docs(self) -> int:
    return self.activations.shape[0]

  @property
  def seq_len(self) -> int:
    return self.activations.shape[1]

  @property
  def wte(self) -> jax.Array:
    return split.wte(self.params)

  def chunk_for(self, bytes_per_doc: float) -> int:
    return max(1, int(self.memory_budget_bytes // max(bytes_per_doc, 1.0)))

  def charge(self, stages, own_xla: float | None = None, own_analytic: float = 0.0):
    """(flops, source, analytic) of an attack's own work plus the full cost of the shared
    stages it used: XLA's count when every part has one, else the analytic count."""
    costs = [self.costs[s] for s in stages]
    analytic = own_analytic + sum(c.analytic for c in costs)
    if own_analytic and own_xla is None or any(c.source != "xla" for c in costs):
      return analytic, "analytic", analytic
    return (own_xla or 0.0) + sum(c.flops for c in costs), "xla", analytic

  def _record(self, stage: str, xla: float | None, analytic: float) -> None:
    self.costs[stage] = StageCost(xla if xla is not None else analytic,
                                  "xla" if xla is not None else "analytic", analytic)

  @functools.cached_property
  def decoder(self) -> ridge.RidgeDecoder:
    h_cal = np.asarray(split.client(self.params, self.cfg, jnp.asarray(self.calibration_tokens),
                                    self.cut))
    if self.calibration_transform is not None:
      h_cal = np.asarray(self.calibration_transform(h_cal), np.float32)
    e_cal = np.asarray(self.wte)[self.calibration_tokens]
    d = self.cfg.n_embd
    num_rows = self.calibration_tokens.size
    lowered = split.client.lower(self.params, self.cfg, jnp.asarray(self.calibration_tokens),
                                 self.cut)
    client_analytic = 2.0 * num_rows * self.cut * (12 * d * d + self.seq_len * d)
    xla = xla_flops(lowered)
    self._record("ridge", None if xla is None else xla + ridge.ridge_flops(num_rows, d, d),
                 client_analytic + ridge.ridge_flops(num_rows, d, d))
    return ridge.fit_ridge(h_cal, e_cal, self.ridge_alpha)

  @functools.cached_property
  def baseline_token(self) -> int:
    """The calibration corpus's most common token (ties: lower id)."""
    return int(np.bincount(self.calibration_tokens.reshape(-1)).argmax())

  def activation_ranked(self, num: int) -> np.ndarray:
    """[B, T, num] nearest tokens to the decoded embeddings (stage `activation_candidates`)."""
    key = ("activation", num)
    if key not in self._cache:
      decoder, wte = self.decoder, self.wte
      vocab = self.cfg.vocab_size
      fn = lambda h: cand_lib.nearest_tokens(decoder.decode(h), wte, num)
      # wte is an argument of the lowered function: as a closed-over constant XLA would
      # constant-fold it (tens of seconds for GPT-2) on every cost analysis.
      cost_fn = lambda h, w: cand_lib.nearest_tokens(decoder.decode(h), w, num)
      cost = lambda h: xla_flops(jax.jit(cost_fn).lower(h, wte))
      out, xla = map_documents(fn, (self.activations,),
                               self.chunk_for(8.0 * self.seq_len * vocab), self.mesh, cost)
      positions = self.num_docs * self.seq_len
      self._record("activation_candidates", xla,
                   cand_lib.candidate_flops(positions, vocab, self.cfg.n_embd)
                   + 2.0 * positions * self.cfg.n_embd**2)
      self._cache[key] = out
    return self._cache[key]

  def gradient_ranked(self, num: int, gradients: np.ndarray, stage: str) -> np.ndarray:
    """[B, T, num] tokens ranked by <-g[t-1], wte[v]> (stage `stage`)."""
    key = (stage, num)
    if key not in self._cache:
      wte, vocab = self.wte, self.cfg.vocab_size
      fn = lambda g: cand_lib.gradient_ranked_tokens(g, wte, num)
      cost = lambda g: xla_flops(jax.jit(cand_lib.gradient_ranked_tokens,
                                         static_argnames=("num",)).lower(g, wte, num=num))
      out, xla = map_documents(fn, (gradients,), self.chunk_for(8.0 * self.seq_len * vocab),
                               self.mesh, cost)
      self._record(stage, xla, cand_lib.candidate_flops(self.num_docs * self.seq_len, vocab,
                                                        self.cfg.n_embd))
      self._cache[key] = out
    return self._cache[key]
