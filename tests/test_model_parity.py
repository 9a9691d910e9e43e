"""lla's GPT-2 against transformers' PyTorch GPT2LMHeadModel, number for number.

Each reference model is a randomly initialised HF model saved with `save_pretrained` and
read back with `load_hf_dir`, so the checks cover the conversion as well as the maths.
Tolerances are relative to the largest magnitude of the reference tensor.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from lla.model import hf_io, split
from lla.model.gpt2 import GPT2Config

transformers.logging.set_verbosity_error()

B, T = 2, 16

CONFIGS = {
    "gpt2_124m": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257),
    "odd_3x48": dict(n_layer=3, n_embd=48, n_head=3, vocab_size=101, n_positions=40),
    "odd_5x40_eps": dict(n_layer=5, n_embd=40, n_head=5, vocab_size=97, n_positions=24,
                         layer_norm_epsilon=1e-6),
}
# Cuts whose (h, g) are checked. Each cut is its own XLA compile, seconds at 124M on a
# CPU, so the 124M model is checked at the paper's k = 6 and the small ones at 1, 2 and
# n_layer - 1.
CUTS = {"gpt2_124m": (6,), "odd_3x48": (1, 2), "odd_5x40_eps": (1, 2, 4)}


def hf_model(seed: int, **config) -> transformers.GPT2LMHeadModel:
  """A random HF GPT-2 in eval mode (no dropout) with frozen weights."""
  torch.manual_seed(seed)
  eos = config["vocab_size"] - 1
  model = transformers.GPT2LMHeadModel(
      transformers.GPT2Config(bos_token_id=eos, eos_token_id=eos, **config)).eval()
  with torch.no_grad():
    for p in model.parameters():
      # HF initialises LayerNorms to (1, 0) and every bias to 0, which would hide a
      # swapped, dropped or transposed one.
      if p.ndim == 1:
        p.add_(0.1 * torch.randn_like(p))
  return model.requires_grad_(False)


def assert_close(actual, reference, rtol, what=""):
  """max |actual - reference| <= rtol * max |reference|."""
  actual, reference = np.asarray(actual, np.float64), np.asarray(reference, np.float64)
  assert actual.shape == reference.shape, (what, actual.shape, reference.shape)
  err, scale = np.max(np.abs(actual - reference)), np.max(np.abs(reference))
  assert err <= rtol * scale, f"{what}: max error {err:.3g} > {rtol:g} * {scale:.3g}"


def hf_boundary(model, tokens: torch.Tensor, k: int):
  """(h, g), both [B, T, d]: HF's forward message at cut k and dL/dh for HF's `labels=` loss.

  A forward hook replaces block k-1's output by a leaf tensor, so autograd stops there and
  its `.grad` is exactly dL/dh.
  """
  leaf = {}

  def cut(module, inputs, output):
    leaf["h"] = output.detach().requires_grad_()
    return leaf["h"]

  handle = model.transformer.h[k - 1].register_forward_hook(cut)
  try:
    loss = model(tokens, labels=tokens).loss
  finally:
    handle.remove()
  loss.backward()
  return leaf["h"].detach().numpy(), leaf["h"].grad.numpy()


class Ref(NamedTuple):
  name: str
  model: transformers.GPT2LMHeadModel
  params: dict
  cfg: GPT2Config
  tokens: jax.Array  # [B, T] int32
  tokens_pt: torch.Tensor  # the same, int64


@pytest.fixture(scope="module", params=list(CONFIGS))
def ref(request, tmp_path_factory) -> Ref:
  """One HF model per config, built and loaded once per module (the 124M takes seconds)."""
  config = CONFIGS[request.param]
  model = hf_model(seed=0, **config)
  directory = tmp_path_factory.mktemp(request.param)
  model.save_pretrained(directory)
  params, cfg = hf_io.load_hf_dir(directory)
  tokens = np.random.default_rng(0).integers(0, config["vocab_size"], (B, T), dtype=np.int32)
  return Ref(request.param, model, params, cfg, jnp.asarray(tokens),
             torch.from_numpy(tokens).long())


@pytest.fixture(params=["named", "stacked"])
def params(request, ref) -> dict:
  """The parameters in either form: the HF-named tree (blocks unrolled) or its computation
  form (the blocks stacked, a range of them one scanned block body)."""
  return ref.params if request.param == "named" else split.computation_form(ref.params, ref.cfg)


def test_config_read(ref):
  cfg, hf = ref.cfg, ref.model.config
  assert (cfg.vocab_size, cfg.n_positions, cfg.n_embd, cfg.n_layer, cfg.n_head) == (
      hf.vocab_size, hf.n_positions, hf.n_embd, hf.n_layer, hf.n_head)
  assert cfg.layer_norm_epsilon == hf.layer_norm_epsilon


def test_logits_and_hidden_states(ref, params):
  cfg = ref.cfg
  with torch.no_grad():
    out = ref.model(ref.tokens_pt, output_hidden_states=True)
  assert_close(split.logits(params, cfg, ref.tokens), out.logits, 1e-4, "logits")
  ours = jax.jit(split.hidden_states, static_argnums=1)(params, cfg, ref.tokens)
  assert len(ours) == len(out.hidden_states) == cfg.n_layer + 1
  for i, (a, r) in enumerate(zip(ours, out.hidden_states)):
    assert_close(a, r, 1e-4, f"hidden state {i}")


def test_boundary_messages(ref, params):
  for k in CUTS[ref.name]:
    h_ref, g_ref = hf_boundary(ref.model, ref.tokens_pt, k)
    h, g = split.boundary_messages(params, ref.cfg, ref.tokens, k)
    assert_close(h, h_ref, 1e-4, f"h at k={k}")
    assert_close(g, g_ref, 1e-4, f"g at k={k}")


def test_server_loss_is_hf_loss(ref, params):
  cfg, tokens = ref.cfg, ref.tokens
  with torch.no_grad():
    out = ref.model(ref.tokens_pt, labels=ref.tokens_pt)
  k = CUTS[ref.name][-1]
  loss, logits = split.server_loss(params, cfg, split.client(params, cfg, tokens, k), tokens, k)
  assert_close(loss, out.loss, 1e-5, "server loss")
  assert_close(logits, out.logits, 1e-4, "server logits")
  assert_close(split.lm_loss(params, cfg, tokens), out.loss, 1e-5, "lm_loss")
