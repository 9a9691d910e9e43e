"""Throughput of lla's split GPT-2 against transformers' PyTorch GPT-2 on this machine.

  python -m experiments.bench_model [--batch=256 --seq_len=32 --cut=6 --torch_batch=32]
      [--out_json=PATH]

GPT-2 124M with random weights, the same weights on both sides (lla's are exported with
`save_hf_dir` and read by `GPT2LMHeadModel.from_pretrained`), and a check that both compute
the same `h`. Two workloads, in tokens/s:
  client forward: h = blocks[:cut](embed(x)), what a client does per document;
  (h, g) capture: h plus g = dL/dh through blocks[cut:], ln_f, head and the mean
    next-token CE, what a capture records per training step.
Neither computes parameter gradients. lla runs jit-compiled (compilation excluded, every
timing ends in block_until_ready); torch runs eagerly with as many threads as cores. torch
may run a smaller batch (--torch_batch): its tokens/s is then per token, extrapolated to
--batch assuming linear scaling, and the output says so. torch is imported here only.
"""

import json
import os
import statistics
import tempfile
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from lla.model import hf_io, split
from lla.model.gpt2 import GPT2Config, init_params

_BATCH = flags.DEFINE_integer("batch", 256, "Documents per call (lla).")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 32, "Tokens per document.")
_CUT = flags.DEFINE_integer("cut", 6, "Cut depth k.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed calls per measurement (median reported).")
_TORCH_BATCH = flags.DEFINE_integer("torch_batch", 32, "Documents per call for torch.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the random weights and tokens.")
_OUT_JSON = flags.DEFINE_string("out_json", None, "Where to write the results as JSON.")


def _median_seconds(fn, repeats: int) -> float:
  """Median wall time of fn() over `repeats` calls after one untimed warm-up call."""
  fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _torch_fns(model, tokens_np: np.ndarray, k: int):
  """HF GPT-2 split at k by hand: (client forward, (h, g) capture) closures."""
  import torch
  import torch.nn.functional as F

  tokens = torch.from_numpy(tokens_np).long()
  positions = torch.arange(tokens.shape[1])
  net = model.transformer

  def client():
    with torch.no_grad():
      x = net.wte(tokens) + net.wpe(positions)
      for block in net.h[:k]:
        x = block(x)
    return x

  def capture():
    h = client().requires_grad_()
    x = h
    for block in net.h[k:]:
      x = block(x)
    logits = model.lm_head(net.ln_f(x))
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    (g,) = torch.autograd.grad(loss, h)
    return h, g

  return client, capture


def main(argv):
  del argv
  import torch  # Only the benchmark needs torch; lla never imports it.
  import transformers

  transformers.logging.set_verbosity_error()
  torch.set_num_threads(os.cpu_count())
  batch, seq_len, k, torch_batch = _BATCH.value, _SEQ_LEN.value, _CUT.value, _TORCH_BATCH.value
  load_before = os.getloadavg()

  cfg = GPT2Config.gpt2_124m()
  params = init_params(cfg, jax.random.key(_SEED.value))
  tokens = np.random.default_rng(_SEED.value).integers(0, cfg.vocab_size, (batch, seq_len),
                                                       dtype=np.int32)
  with tempfile.TemporaryDirectory() as tmp:
    hf_io.save_hf_dir(params, cfg, tmp)
    model = transformers.GPT2LMHeadModel.from_pretrained(tmp).eval().requires_grad_(False)

  tokens_jax = jnp.asarray(tokens)
  lla_client = lambda: split.client(params, cfg, tokens_jax, k).block_until_ready()
  lla_capture = lambda: jax.block_until_ready(split.boundary_messages(params, cfg, tokens_jax, k))
  torch_client, torch_capture = _torch_fns(model, tokens[:torch_batch], k)

  # Both sides must compute the same messages, or the comparison means nothing.
  h_lla, g_lla = split.boundary_messages(params, cfg, tokens_jax[:torch_batch], k)
  h_pt, g_pt = (t.detach().numpy() for t in torch_capture())
  agreement = {
      "h_max_rel_err": float(np.abs(h_lla - h_pt).max() / np.abs(h_pt).max()),
      "g_max_rel_err": float(np.abs(g_lla - g_pt).max() / np.abs(g_pt).max()),
  }

  lla_tokens, torch_tokens = batch * seq_len, min(torch_batch, batch) * seq_len
  rows = {}
  for name, lla_fn, torch_fn in [("client_forward", lla_client, torch_client),
                                 ("hg_capture", lla_capture, torch_capture)]:
    lla_s = _median_seconds(lla_fn, _REPEATS.value)
    torch_s = _median_seconds(torch_fn, _REPEATS.value)
    rows[name] = {
        "lla_seconds_per_call": lla_s, "torch_seconds_per_call": torch_s,
        "lla_tokens_per_s": lla_tokens / lla_s, "torch_tokens_per_s": torch_tokens / torch_s,
        "ratio_lla_over_torch": (lla_tokens / lla_s) / (torch_tokens / torch_s),
    }

  results = {
      "model": "gpt2-124m (random weights)", "batch": batch, "seq_len": seq_len, "cut": k,
      "torch_batch": min(torch_batch, batch), "repeats": _REPEATS.value,
      "jax_backend": jax.default_backend(), "jax_version": jax.__version__,
      "torch_version": torch.__version__, "torch_threads": torch.get_num_threads(),
      "cpu_count": os.cpu_count(), "loadavg_before": load_before,
      "loadavg_after": os.getloadavg(), "agreement_at_torch_batch": agreement,
      "results": rows,
  }

  print(f"GPT-2 124M, cut k={k}, T={seq_len}; lla batch {batch} on {jax.default_backend()}, "
        f"torch batch {min(torch_batch, batch)} on CPU with {torch.get_num_threads()} threads")
  if torch_batch < batch:
    print(f"torch tokens/s measured at batch {torch_batch} and taken per token as the rate at "
          f"batch {batch} (linear-scaling extrapolation)")
  print(f"{'workload':<16}{'lla tok/s':>14}{'torch tok/s':>14}{'lla/torch':>11}")
  for name, row in rows.items():
    print(f"{name:<16}{row['lla_tokens_per_s']:>14,.0f}{row['torch_tokens_per_s']:>14,.0f}"
          f"{row['ratio_lla_over_torch']:>11.2f}")
  print(f"h/g agreement lla vs torch (max rel err): {agreement['h_max_rel_err']:.1e} / "
        f"{agreement['g_max_rel_err']:.1e}")
  print(f"load average before/after: {load_before[0]:.1f} / {results['loadavg_after'][0]:.1f} "
        f"on {os.cpu_count()} cores (a shared machine: other jobs slow both sides)")
  if _OUT_JSON.value:
    with open(_OUT_JSON.value, "w") as f:
      json.dump(results, f, indent=2, sort_keys=True)
    print(f"wrote {_OUT_JSON.value}")


if __name__ == "__main__":
  app.run(main)
