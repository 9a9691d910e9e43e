"""lla.attacks.memory: the working-set formulas against XLA's own memory analysis of the
compiled stages, the estimate's chunks against the Workspace's chunking, and the resident
parameters against the leaves of every family's parameter tree."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lla.attacks.seed import beam
from lla.attacks import memory
from lla.attacks import candidates as cand_lib
from lla.attacks.workspace import Workspace, chunk_plan
from lla.capture import store
from lla.model import cost, decoder, gpt2
from lla.model.decoder import DecoderConfig
from lla.model.gpt2 import GPT2Config
from tests.test_attacks_families import CONFIGS as FAMILY_CONFIGS
from tests.test_attacks_units import random_params

CFG = GPT2Config(vocab_size=1000, n_positions=32, n_embd=64, n_head=4, n_layer=3)
# MQA: one KV head for four query heads, so the beam's caches are a quarter of GPT-2's.
MQA = DecoderConfig(family="llama", vocab_size=1000, n_positions=32, n_embd=64, n_layer=3,
                    n_head=4, n_kv_head=1, head_dim=16, d_ff=128, tie_embeddings=False)
DOCS, T, CUT = 4, 32, 2


def xla_bytes(lowered) -> int:
  """Temporaries plus outputs of a compiled executable (what a chunk adds to memory)."""
  stats = lowered.compile().memory_analysis()
  return stats.temp_size_in_bytes + stats.output_size_in_bytes


def test_formulas_bound_xla_memory_within_a_factor_of_three():
  """XLA's temporaries and outputs of each chunked stage lie between a third of the formula
  and the formula (5% slack for XLA's alignment and the small outputs)."""
  d, v = CFG.n_embd, CFG.vocab_size
  h = jnp.zeros((DOCS, T, d))
  params = random_params(CFG, seed=0)
  cases = {
      "ranking": (cand_lib.decoded_nearest_tokens.lower(
          jnp.zeros((d, d)), jnp.zeros(d), jnp.zeros(d), jnp.zeros((v, d)), h, num=32),
                  memory.ranking_bytes_per_doc(T, v, d, 32, materialised=True)),
      "gradient_ranking": (cand_lib.gradient_ranked_tokens.lower(jnp.zeros((v, d)), h, num=32),
                           memory.ranking_bytes_per_doc(T, v, d, 32, materialised=True)),
      "random_fill": (cand_lib.random_fill_candidates.lower(
          jax.random.key(0), jnp.zeros((DOCS, T, 32), jnp.int32), jnp.arange(DOCS),
          c_a=16, c_g=16, vocab_size=v), memory.random_fill_bytes_per_doc(T, v)),
      "beam_step": (beam.step.lower(
          params, beam.start(h, cfg=CFG, k=CUT, width=2), jnp.int32(3),
          jnp.zeros((DOCS, 8), jnp.int32), jnp.zeros((DOCS, d)), cfg=CFG),
                    memory.beam_bytes_per_doc(d, CUT, T, 2, 8)),
      # Without the KV width the formula would count d-wide keys: 4x what XLA holds.
      "beam_step_mqa": (beam.step.lower(
          decoder.random_params(MQA, 0), beam.start(h, cfg=MQA, k=CUT, width=2), jnp.int32(3),
          jnp.zeros((DOCS, 8), jnp.int32), jnp.zeros((DOCS, d)), cfg=MQA),
                        memory.beam_bytes_per_doc(d, CUT, T, 2, 8, cost.kv_width(MQA))),
  }
  for name, (lowered, per_doc) in cases.items():
    measured = xla_bytes(lowered)
    assert per_doc * DOCS / 3 <= measured <= 1.05 * per_doc * DOCS, (name, measured, per_doc * DOCS)


def test_estimate_chunks_like_the_workspace():
  h = np.zeros((37, T, CFG.n_embd), np.float32)
  ws = Workspace(h, h, {}, CFG, CUT, np.zeros((2, T), np.int32), memory_budget_bytes=3 << 20)
  budget = {"candidates": 32, "beam_width": 2, "c_a": 16, "c_g": 16}
  rows = memory.estimate(["ridge", "joint", "random_candidates", "some_plugin"], CFG, CUT, 37, T,
                         budget, ws.memory_budget_bytes, materialised=True)
  assert [(r.attack, r.stage) for r in rows] == [
      ("ridge", "activation_candidates"), ("joint", "activation_candidates"),
      ("joint", "gradient_ranking"), ("joint", "beam_search"),
      ("random_candidates", "activation_candidates"), ("random_candidates", "random_fill"),
      ("random_candidates", "beam_search"), ("some_plugin", "(no estimate)")]
  for r in rows[:-1]:
    size, count = chunk_plan(37, ws.chunk_for(r.bytes_per_doc), None)
    assert (r.chunk_docs, r.chunks) == (size, count), r
  assert any(r.chunks > 1 for r in rows)  # the budget is small enough to chunk
  text = memory.format_estimate(rows, 1 << 20, ws.memory_budget_bytes, "test")
  assert "random_fill" in text and "peak (resident + largest chunk)" in text


def test_chunk_budget_on_cpu_is_the_configured_one():
  assert memory.chunk_budget_bytes(123 << 20) == (123 << 20, "configured (CPU)")
  assert memory.materialised_rankings("cpu") and not memory.materialised_rankings("gpu")


def test_describe_replay_reads_shapes_without_the_messages(tmp_path):
  h = np.ones((5, T, CFG.n_embd), np.float32)
  store.write_capture(tmp_path / "cap", h, h, np.zeros((5, T), np.int32),
                      {"document_ids": list(range(5)), "protocol": {"T": {"cut": CUT}}})
  text = memory.describe_replay(str(tmp_path / "cap"), CFG, ["activation"],
                                {"candidates": 32, "beam_width": 2}, 1 << 30, "test")
  want = memory.ranking_bytes_per_doc(T, CFG.vocab_size, CFG.n_embd, 32) / 2**20
  assert f"{want:10.2f}" in text and "beam_search" in text
  assert f"{memory.resident_bytes(CFG, 5, T, True) / 2**20:.0f} MiB" in text


# Every family's tiny config, plus a RoPE config with the options none of them has:
# LayerNorm, a gelu (ungated) MLP, o and MLP biases, Qwen3's q/k norms, GQA.
PARAMETER_CONFIGS = dict(
    FAMILY_CONFIGS, mqa=MQA,
    options=DecoderConfig(family="llama", vocab_size=50, n_positions=8, n_embd=24, n_layer=2,
                          n_head=3, n_kv_head=1, head_dim=10, d_ff=40, norm="layernorm",
                          mlp="gelu", qkv_bias=True, o_bias=True, mlp_bias=True, qk_norm=True,
                          tie_embeddings=False))


@pytest.mark.parametrize("family", list(PARAMETER_CONFIGS))
def test_resident_parameters_are_the_leaves_of_the_parameter_tree(family):
  """lla.model.cost.param_count (what resident_bytes holds) against the entries of every
  leaf of the family's parameter tree (GQA's narrower k and v, a gated MLP's three
  matrices, an untied head, biases and norms)."""
  cfg = PARAMETER_CONFIGS[family]
  init = gpt2.init_params if isinstance(cfg, GPT2Config) else decoder.init_params
  shapes = jax.eval_shape(lambda key: init(cfg, key), jax.random.key(0))
  leaves = sum(int(np.prod(leaf.shape)) for leaf in jax.tree_util.tree_leaves(shapes))
  assert cost.param_count(cfg) == leaves
  if isinstance(cfg, DecoderConfig):  # random_params draws the same tree
    drawn = decoder.random_params(cfg, 0)
    assert sum(leaf.size for leaf in jax.tree_util.tree_leaves(drawn)) == leaves
  docs, seq_len = 3, 5
  messages = docs * seq_len * cfg.n_embd
  assert memory.resident_bytes(cfg, docs, seq_len, True) == 4.0 * leaves + 8.0 * messages
  assert memory.resident_bytes(cfg, docs, seq_len, False) == 4.0 * leaves + 4.0 * messages
