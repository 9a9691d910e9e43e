"""Working sets of the attack stages, the document chunks they give, and the device budget.

The Workspace runs every per-document stage in chunks of `budget // bytes_per_doc`
documents. The bytes-per-document formulas live here, so that the chunking and the
estimate printed before a run (`estimate`, `format_estimate`) are the same arithmetic:

  ridge decode            4 T d               the decoded embeddings [T, d] float32
  vocabulary ranking      8 T V               materialised: the [T, V] float32 scores and
                                              lax.top_k's copy (CPU, the reference)
                          4 T (2 d + 4 s)     the kernel (GPU, TPU): inputs and s >= C
                                              (key, index) slots, sorted once; no [T, V]
  random-candidate fill  18 T V               random bits, Gumbel noise, the exclusion
                                              mask, the masked noise and top-k's copy
  beam search             4 (3 W k 2 T d_kv   KV caches of W beams (old, gathered, new)
                          + W C (2 k d_kv       and the W*C one-token steps (their new keys
                                 + 8 d))        and values, activations)

(T tokens per document, d width, d_kv = H_kv D the key width (d for GPT-2, less under
GQA), V vocabulary, k cut, W beam width, C candidates.) Besides its chunk, a replay holds
the attacker's parameters and the capture's messages for the whole run (`resident_bytes`:
the parameter count read from the config, lla.model.cost.param_count: GQA's narrower k and
v, a gated MLP's three matrices, an untied head).

The chunk budget: on CPU the configured one; on GPU and TPU, where the device reports its
memory, half of what is free on each device (XLA's pool less what is in use), summed over
the devices that share the documents.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Callable

import jax
from safetensors import safe_open

from lla.attacks import registry
from lla.capture import store
from lla.evidence import files
from lla.model import cost
from lla.model.gpt2 import GPT2Config

DEVICE_FRACTION = 0.5  # of a device's free memory given to one chunk's working set


def materialised_rankings(platform: str | None = None) -> bool:
  """Whether vocabulary rankings materialise [T, V] scores: on CPU (the reference);
  on GPU and TPU the kernel does not."""
  return (platform or jax.default_backend()) not in ("gpu", "cuda", "rocm", "tpu")


def decode_bytes_per_doc(seq_len: int, d: int) -> float:
  return 4.0 * seq_len * d


def ranking_bytes_per_doc(seq_len: int, vocab: int, d: int, num: int,
                          materialised: bool | None = None) -> float:
  """One document's vocabulary ranking (top-`num` of V rows)."""
  if materialised is None:
    materialised = materialised_rankings()
  if materialised:
    return 8.0 * seq_len * vocab
  slots = 1 << (max(num, 1) - 1).bit_length()
  return 4.0 * seq_len * (2 * d + 4 * slots)


def random_fill_bytes_per_doc(seq_len: int, vocab: int) -> float:
  # 12 T V before: XLA's memory analysis of the compiled fill shows ~17 bytes per entry.
  return 18.0 * seq_len * vocab


def beam_bytes_per_doc(d: int, cut: int, seq_len: int, width: int, num_candidates: int,
                       kv: int | None = None) -> float:
  """One document's beam-search step: caches (old, gathered, new) and the W*C steps.
  `kv` is the key (and value) width H_kv D, d when not given (GPT-2)."""
  kv = d if kv is None else kv
  return 4.0 * (3 * width * cut * 2 * seq_len * kv
                + width * num_candidates * (2 * cut * kv + 8 * d))


def resident_bytes(cfg: GPT2Config, num_docs: int, seq_len: int, gradients: bool) -> float:
  """Held for the whole replay: float32 parameters (every one, from the config: GPT-2's
  V d + n_positions d + L (12 d^2 + 13 d) + 2 d), h (and g) of every document."""
  params = cost.param_count(cfg)
  return 4.0 * params + 4.0 * num_docs * seq_len * cfg.n_embd * (2 if gradients else 1)


def chunk_budget_bytes(configured: int, devices=None, fraction: float = DEVICE_FRACTION
                       ) -> tuple[int, str]:
  """(bytes, where from) of one chunk's working set: `configured` on CPU, else `fraction`
  of each device's free memory summed over `devices` (default: every local device), or
  `configured` when a device does not report its memory."""
  devices = jax.local_devices() if devices is None else devices
  if all(d.platform == "cpu" for d in devices):
    return int(configured), "configured (CPU)"
  free = 0
  for device in devices:
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
      return int(configured), f"configured ({device.device_kind} reports no memory)"
    free += stats["bytes_limit"] - stats.get("bytes_in_use", 0)
  return int(fraction * free), f"{fraction:.0%} of free device memory ({len(devices)} devices)"


@dataclasses.dataclass(frozen=True)
class StageEstimate:
  attack: str
  stage: str
  bytes_per_doc: float
  chunk_docs: int                 # documents per chunk (whole device multiples ignored)
  chunks: int

  @property
  def chunk_bytes(self) -> float:
    return self.bytes_per_doc * self.chunk_docs


def _chunking(bytes_per_doc: float, num_docs: int, budget: int) -> tuple[int, int]:
  chunk = min(num_docs, max(1, int(budget // max(bytes_per_doc, 1.0))))
  return chunk, math.ceil(num_docs / chunk)


# Attack name -> stages(cfg, cut, num_docs, seq_len, budget, materialised): the attack's
# (stage, bytes per document) list. Each attack module declares its own (`declare_stages`),
# so that this model imports no attack.
_STAGES: dict[str, Callable[..., list[tuple[str, float]]]] = {}


def declare_stages(name: str, stages: Callable[..., list[tuple[str, float]]]) -> None:
  """Declares attack `name`'s working set per stage (its `_defense_aware` variant shares it)."""
  if name in _STAGES:
    raise ValueError(f"memory stages of attack {name!r} are declared twice")
  _STAGES[name] = stages


def attack_stages(name: str, cfg: GPT2Config, cut: int, num_docs: int, seq_len: int,
                  budget: dict, materialised: bool) -> list[tuple[str, float]] | None:
  """(stage, bytes per document) of an attack; None for attacks that declare none
  (plugins and newer modules)."""
  registry.load_builtin()
  stages = _STAGES.get(name.removesuffix("_defense_aware"))
  if stages is None:
    return None
  return stages(cfg, cut, num_docs, seq_len, budget, materialised)


def estimate(attacks, cfg: GPT2Config, cut: int, num_docs: int, seq_len: int, budget: dict,
             chunk_budget: int, materialised: bool | None = None) -> list[StageEstimate]:
  """Per attack and stage: bytes per document, documents per chunk, chunks. Attacks
  without a formula get one row with stage "(no estimate)" and zero bytes."""
  if materialised is None:
    materialised = materialised_rankings()
  rows = []
  for name in attacks:
    stages = attack_stages(name, cfg, cut, num_docs, seq_len, dict(budget), materialised)
    if stages is None:
      rows.append(StageEstimate(name, "(no estimate)", 0.0, num_docs, 1))
      continue
    for stage, per_doc in stages:
      rows.append(StageEstimate(name, stage, per_doc, *_chunking(per_doc, num_docs, chunk_budget)))
  return rows


def format_estimate(rows: list[StageEstimate], resident: float, chunk_budget: int,
                    source: str) -> str:
  """The estimate as a table: one line per (attack, stage), then the peak."""
  mib = lambda b: b / 2**20
  lines = [f"memory estimate: chunk budget {mib(chunk_budget):.0f} MiB ({source}); "
           f"resident (parameters, messages) {mib(resident):.0f} MiB",
           f"  {'attack':28s}{'stage':24s}{'MiB/doc':>10s}{'docs/chunk':>11s}{'chunks':>8s}"
           f"{'MiB/chunk':>11s}"]
  for r in rows:
    lines.append(f"  {r.attack:28s}{r.stage:24s}{mib(r.bytes_per_doc):10.2f}{r.chunk_docs:11d}"
                 f"{r.chunks:8d}{mib(r.chunk_bytes):11.0f}")
  peak = resident + max((r.chunk_bytes for r in rows), default=0.0)
  lines.append(f"  peak (resident + largest chunk): {mib(peak):.0f} MiB")
  return "\n".join(lines)



def describe_replay(capture_dir: str, cfg: GPT2Config, attacks, budget: dict,
                    chunk_budget: int, source: str) -> str:
  """`format_estimate` for replaying `attacks` on a stored capture: reads its shapes and
  cut, not its messages, after the manifest check (a damaged capture raises replay's own
  one-line CaptureError)."""
  store.verify(capture_dir)
  with safe_open(os.path.join(capture_dir, store.MESSAGES_FILE), "numpy") as f:
    num_docs, seq_len, _ = f.get_slice("activations").get_shape()
    gradients = "gradients" in f.keys()
  metadata = files.read_json(os.path.join(capture_dir, store.METADATA_FILE))
  cut = int(metadata["protocol"]["T"]["cut"])
  rows = estimate(attacks, cfg, cut, num_docs, seq_len, budget, chunk_budget)
  return format_estimate(rows, resident_bytes(cfg, num_docs, seq_len, gradients),
                         chunk_budget, source)
