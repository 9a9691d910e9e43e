"""The client/server boundary of lla.active: server code cannot reach the client's data."""

import ast
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

from lla.active import client, protocol

ROOT = pathlib.Path(__file__).resolve().parent.parent
SERVER_MODULES = ("lla/active/servers.py", "lla/active/fsha.py", "lla/active/protocol.py",
                  "lla/active/parts.py")
# What server code may import from lla: the model, the shared optimiser, its own modules.
ALLOWED = ("lla.active.fsha", "lla.active.parts", "lla.active.protocol", "lla.model.gpt2",
           "lla.model.split", "lla.train.loop")
FORBIDDEN = ("lla.data", "lla.active.client", "lla.active.run", "lla.active.public",
             "lla.capture", "lla.train.finetune", "lla.decoy", "lla.attacks")


def _imports(path: pathlib.Path) -> set[str]:
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      names |= {f"{base}.{a.name}" if base == "lla" or base.startswith("lla.") and
                base.count(".") == 1 else base for a in node.names}
  return {n for n in names if n == "lla" or n.startswith("lla.")}


@pytest.mark.parametrize("module", SERVER_MODULES)
def test_server_modules_import_only_the_model_and_their_own_code(module):
  imported = _imports(ROOT / module)
  assert imported <= set(ALLOWED), f"{module} imports {sorted(imported - set(ALLOWED))}"


def test_servers_run_with_the_private_loaders_poisoned():
  """A subprocess where importing or touching the client's modules or any data loader
  raises: the servers still import and take a step on synthetic messages, and the modules
  they loaded include none of those."""
  code = textwrap.dedent("""
      import sys, types
      class Poison(types.ModuleType):
        def __getattr__(self, name):
          raise RuntimeError(f"server code touched {self.__name__}.{name}")
      FORBIDDEN = %r
      for name in FORBIDDEN:
        sys.modules[name] = Poison(name)
      import jax, jax.numpy as jnp, json
      from lla.active import fsha, parts, servers
      from lla.active.protocol import Forward
      from lla.model import gpt2, split
      cfg = gpt2.GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=2, n_head=2)
      params = gpt2.init_params(cfg, jax.random.key(0))
      h = jax.random.normal(jax.random.key(1), (2, 8, 16))
      labels = jax.random.randint(jax.random.key(2), (2, 8), 0, 32)
      oracle = lambda logits: split.next_token_loss(logits, labels)
      opt = json.dumps({"lr": 1e-3, "warmup_steps": 1, "decay": "cosine",
                        "end_lr_fraction": 0.1, "b1": 0.9, "b2": 0.999, "eps": 1e-8,
                        "weight_decay": 0.01, "clip_norm": 1.0}, sort_keys=True)
      honest = servers.HonestServer(cfg, 1, opt, 4)
      spec = fsha.FSHASpec(vocab_size=32, seq_len=8, width=16, critic_hidden=8)
      hijack = servers.FSHAServer(spec)
      mixed = servers.MixedFSHAServer(honest, hijack, 0.5)
      fwd = Forward(h=h, step=jnp.int32(0), run_id=jnp.int32(0))
      tail = parts.tail_params(params, cfg, 1)
      pilot = fsha.init_pilot(spec, jax.random.key(3))
      for server, state in ((honest, honest.init(tail)),
                            (hijack, hijack.init(pilot, jax.random.key(4))),
                            (mixed, mixed.init(tail, pilot, jax.random.key(4)))):
        step = jax.jit(lambda s, f, p, k, server=server: server.step(s, f, oracle, p, k))
        _, back, _ = step(state, fwd, labels, jax.random.key(5))
        assert back.g.shape == h.shape
      loaded = [m for m in sys.modules if m.startswith("lla.")
                and not isinstance(sys.modules[m], Poison)]
      leaked = [m for m in loaded if any(m.startswith(f + ".") for f in FORBIDDEN)]
      assert not leaked, leaked
      print("ok")
      """) % (FORBIDDEN,)
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
  assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-2000:]


def test_only_a_forward_crosses_and_the_oracle_is_opaque():
  h = jnp.zeros((2, 4, 8))
  protocol.check_forward(protocol.Forward(h=h, step=jnp.int32(0), run_id=jnp.int32(0)))
  with pytest.raises(TypeError, match="only a Forward"):
    protocol.check_forward({"h": h, "tokens": jnp.zeros((2, 4), jnp.int32)})
  with pytest.raises(TypeError, match=r"\[B, T, d\]"):
    protocol.check_forward(protocol.Forward(h=h[0], step=jnp.int32(0), run_id=jnp.int32(0)))
  oracle = client.oracle_for(jnp.ones((2, 4), jnp.int32), jnp.int32(0), 8)
  public = [a for a in dir(oracle) if not a.startswith("_")]
  assert public == ["tree_flatten", "tree_unflatten"], public
  with pytest.raises(AttributeError):
    oracle.labels  # pylint: disable=pointless-statement
  assert jnp.isfinite(oracle(jax.random.normal(jax.random.key(0), (2, 4, 8))))
