"""Benchmark: the same user-facing command under several memory allocators (issue 23).

Three workloads (--workload): `replay` (the default, below); `pretrain`, the first
--pretrain_steps steps of the main job's pre-training (`python -m experiments.pretrain
--config=configs/pretrain.py`: the embedded model, 16 x 128 tokens a step, each step
allocating and freeing about 3 GB), whose checkpoint hash must be identical across runs;
and `main_table`, the whole tiny main job (`python -m experiments.main_table
--config=configs/main_table.py:tiny`: 13 phases and 21 defended jobs, where the heap's free
pages may be given back), whose base checkpoint and undefended captures must be identical
across runs (the defended ones depend on secrets each run draws from the OS).

Builds a random small GPT-2 (--n_layer x --n_embd, GPT-2's vocabulary, an HF directory), a
training capture of --docs WikiText-2 evaluation documents at cut --cut
(`python -m experiments.capture`), then runs one command, exactly as a user launches it,

  python -m experiments.replay --config=configs/replay.py --config.capture_dir=CAP \
      --config.attacker.checkpoint= --config.attacker.hf_dir=HF --config.attacker.n_layer=4 \
      --config.attacks=activation,joint,sipit,tag,lamp --config.budget.tag_steps=100 \
      --config.budget.lamp_steps=100 --workdir=RUN

as a subprocess under each allocator configuration, alternating (the order rotates each
round), after one untimed warm-up that fills a private persistent compilation cache. Per run:
wall time, the child's user and system CPU time, minor page faults and peak RSS (os.wait4),
the load average, the allocator the run's records name in their provenance, and the
sha256 of every prediction file, which must be byte-identical across all runs.

Configurations (--configs):
  glibc     $LLA_ALLOCATOR=system: glibc malloc with its defaults (lla before issue 23)
  tuned     the command as is: lla's default (lla/allocator.py: mallopt at `import lla`)
  tcache_off  lla's settings with glibc's per-thread cache off ($GLIBC_TUNABLES
            glibc.malloc.tcache_count=0: what lla did by restarting each binary until 2026-12-02)
  trim_2gib lla's settings with the heap trimmed above 2 GiB - 1 (lla's earlier threshold)
  release_always  lla's settings with the heap's free pages given back at every phase and
            defended job of a long job ($LLA_RESIDENT_FREE_MB=0: lla until 2026-12-04)
  tcmalloc  LD_PRELOAD of TCMalloc (--tcmalloc; Debian: apt-get install libtcmalloc-minimal4)
  jemalloc  LD_PRELOAD of jemalloc with its defaults (--jemalloc; else the system one, else the
            one Ray ships in ray/core)
  mimalloc  LD_PRELOAD of mimalloc with its defaults (--mimalloc)
  glibc_env glibc's environment tunables MALLOC_MMAP_THRESHOLD_ (32 MiB, its maximum) and
            MALLOC_TRIM_THRESHOLD_ (2 GiB - 1), lla's tuning off
A configuration whose library is absent is skipped with a note.

  LLA_DATA_DIR=/work/shared/data python -m experiments.bench_alloc --repeats=2 \
      --out_json=/tmp/bench_alloc.json
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from pathlib import Path
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

from absl import app, flags

from lla.model import gpt2, hf_io

_CONFIGS = flags.DEFINE_list("configs", ["glibc", "tuned", "tcache_off", "tcmalloc"],
                             "Allocator configurations, run in turn (module docstring).")
_REPEATS = flags.DEFINE_integer("repeats", 2, "Timed runs per configuration.")
_ATTACKS = flags.DEFINE_string("attacks", "activation,joint,sipit,tag,lamp", "Replayed attacks.")
_STEPS = flags.DEFINE_integer("steps", 100, "tag_steps and lamp_steps (where requested).")
_DOCS = flags.DEFINE_integer("docs", 8, "Captured WikiText-2 evaluation documents.")
_CUT = flags.DEFINE_integer("cut", 2, "Cut k.")
_N_LAYER = flags.DEFINE_integer("n_layer", 4, "Blocks of the random GPT-2.")
_N_EMBD = flags.DEFINE_integer("n_embd", 128, "Width of the random GPT-2.")
_N_HEAD = flags.DEFINE_integer("n_head", 4, "Heads of the random GPT-2.")
_TCMALLOC = flags.DEFINE_string("tcmalloc", "", "TCMalloc library (empty: look in the usual "
                                "library directories).")
_JEMALLOC = flags.DEFINE_string("jemalloc", "", "jemalloc library (empty: look).")
_MIMALLOC = flags.DEFINE_string("mimalloc", "", "mimalloc library (empty: look, also in the "
                                "cmeel-mimalloc wheel's cmeel.prefix/lib).")
_WORKDIR = flags.DEFINE_string("workdir", "", "Where the model, capture and runs go (empty: a "
                               "temporary directory, removed afterwards).")
_CACHE = flags.DEFINE_string("compilation_cache_dir", "", "Persistent compilation cache (empty: "
                             "WORKDIR/jax_cache).")
_WARMUP = flags.DEFINE_bool("warmup", True, "One untimed run first (fills the compilation "
                            "cache; skip only with an already filled --compilation_cache_dir).")
_OUT_JSON = flags.DEFINE_string("out_json", "", "Where to write the results (JSON).")
_WORKLOAD = flags.DEFINE_enum("workload", "replay", ["replay", "pretrain", "main_table"],
                              "What each run does (module docstring).")
_PRETRAIN_STEPS = flags.DEFINE_integer("pretrain_steps", 60, "Steps of the pretrain workload.")

REPO_ROOT = Path(__file__).resolve().parents[1]
_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
             "/usr/local/lib")
# Variables that select an allocator or its settings: cleared before each configuration's own.
_ALLOCATOR_ENV = ("LD_PRELOAD", "LLA_ALLOCATOR", "LLA_MALLOPT", "LLA_RESIDENT_FREE_MB",
                  "MALLOC_MMAP_THRESHOLD_",
                  "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_",
                  "MALLOC_ARENA_MAX", "GLIBC_TUNABLES")


def find_library(explicit: str, names: tuple[str, ...]) -> str:
  if explicit:
    return explicit if os.path.exists(explicit) else ""
  for directory in _LIB_DIRS:
    for name in names:
      if os.path.exists(os.path.join(directory, name)):
        return os.path.join(directory, name)
  return ""


def configurations() -> dict[str, dict[str, str] | None]:
  """name -> the environment it sets (None: unavailable here)."""
  tcmalloc = find_library(_TCMALLOC.value, ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"))
  jemalloc = find_library(_JEMALLOC.value, ("libjemalloc.so.2",))
  ray_jemalloc = os.path.join(sysconfig.get_paths()["purelib"], "ray", "core", "libjemalloc.so")
  if not _JEMALLOC.value and not jemalloc and os.path.exists(ray_jemalloc):
    jemalloc = ray_jemalloc  # the build Ray ships for its own processes
  wheel = os.path.join(sysconfig.get_paths()["purelib"], "cmeel.prefix", "lib", "libmimalloc.so")
  mimalloc = find_library(_MIMALLOC.value, ("libmimalloc.so.2", "libmimalloc.so"))
  if not _MIMALLOC.value and os.path.exists(wheel):
    mimalloc = wheel
  return {
      "glibc": {"LLA_ALLOCATOR": "system"},
      "tuned": {},
      "tcache_off": {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"},
      "trim_2gib": {"LLA_MALLOPT": f"trim_threshold={2**31 - 1}"},
      "release_always": {"LLA_RESIDENT_FREE_MB": "0"},
      "tcmalloc": {"LD_PRELOAD": tcmalloc, "LLA_ALLOCATOR": "system"} if tcmalloc else None,
      "jemalloc": {"LD_PRELOAD": jemalloc, "LLA_ALLOCATOR": "system"} if jemalloc else None,
      "mimalloc": {"LD_PRELOAD": mimalloc, "LLA_ALLOCATOR": "system"} if mimalloc else None,
      "glibc_env": {"LLA_ALLOCATOR": "system", "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
                    "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1)},
  }


def timed(cmd: list[str], env: dict[str, str], log: Path) -> dict:
  """Runs `cmd`; wall, user, system seconds, minor faults, peak RSS of the child."""
  load = os.getloadavg()[0]
  start = time.perf_counter()
  with open(log, "w") as out:
    process = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    _, status, usage = os.wait4(process.pid, 0)
  wall = time.perf_counter() - start
  code = os.waitstatus_to_exitcode(status)
  if code != 0:
    raise SystemExit(f"{' '.join(cmd)} exited {code}; see {log}:\n{log.read_text()[-3000:]}")
  return {"wall_s": wall, "user_s": usage.ru_utime, "sys_s": usage.ru_stime,
          "minflt": usage.ru_minflt, "maxrss_mb": usage.ru_maxrss / 1024,
          "load_before": load, "load_after": os.getloadavg()[0]}


def prediction_hashes(run_dir: Path) -> dict[str, str]:
  return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted((run_dir / "predictions").glob("*.npy"))}


def recorded_allocator(run_dir: Path) -> dict:
  record = json.loads(next(iter(sorted((run_dir / "records").glob("*.json")))).read_text())
  return record["provenance"].get("allocator", {})


def prepare(root: Path, env: dict[str, str]) -> tuple[Path, Path]:
  """The random model (HF directory) and its training capture."""
  cfg = gpt2.GPT2Config(vocab_size=50257, n_positions=128, n_embd=_N_EMBD.value,
                        n_layer=_N_LAYER.value, n_head=_N_HEAD.value)
  hf_dir, capture = root / "hf", root / "capture"
  hf_io.save_hf_dir(gpt2.random_params(cfg, 0), cfg, hf_dir)
  model = [f"--config.model.checkpoint=", f"--config.model.hf_dir={hf_dir}",
           f"--config.model.n_layer={_N_LAYER.value}", f"--config.model.n_embd={_N_EMBD.value}",
           f"--config.model.n_head={_N_HEAD.value}"]
  timed([sys.executable, "-m", "experiments.capture", "--config=configs/capture.py", *model,
         f"--config.cut={_CUT.value}", f"--config.data.n_eval={_DOCS.value}",
         f"--workdir={capture}"], env, root / "capture.log")
  return hf_dir, capture


def replay_command(hf_dir: Path, capture: Path, run_dir: Path) -> list[str]:
  attacks = _ATTACKS.value.split(",")
  steps = [f"--config.budget.{a}_steps={_STEPS.value}" for a in ("tag", "lamp") if a in attacks]
  return [sys.executable, "-m", "experiments.replay", "--config=configs/replay.py",
          f"--config.capture_dir={capture}", "--config.attacker.checkpoint=",
          f"--config.attacker.hf_dir={hf_dir}", f"--config.attacker.n_layer={_N_LAYER.value}",
          f"--config.attacker.n_embd={_N_EMBD.value}", f"--config.attacker.n_head={_N_HEAD.value}",
          f"--config.attacks={_ATTACKS.value}", *steps, f"--workdir={run_dir}"]


def pretrain_command(run_dir: Path) -> list[str]:
  return [sys.executable, "-m", "experiments.pretrain", "--config=configs/pretrain.py",
          f"--config.num_steps={_PRETRAIN_STEPS.value}", "--config.eval_windows=32",
          "--config.export_hf=false", f"--workdir={run_dir}"]


def main_table_command(run_dir: Path) -> list[str]:
  return [sys.executable, "-m", "experiments.main_table", "--config=configs/main_table.py:tiny",
          f"--workdir={run_dir}"]


def checkpoint_hash(run_dir: Path) -> dict[str, str]:
  metadata = json.loads((run_dir / "checkpoint" / "metadata.json").read_text())
  return {"params_sha256": metadata["params_sha256"]}


def main_table_hashes(run_dir: Path) -> dict[str, str]:
  """The base model's params hash and the sha256 of every undefended capture's messages."""
  hashes = checkpoint_hash(run_dir / "pretrain")
  for messages in sorted((run_dir / "captures").glob("*/messages.safetensors")):
    if not messages.parent.name.startswith("def_"):
      hashes[messages.parent.name] = hashlib.sha256(messages.read_bytes()).hexdigest()
  return hashes


def summarise(runs: list[dict]) -> dict:
  out = {}
  for key in ("wall_s", "user_s", "sys_s", "minflt", "maxrss_mb"):
    values = [r[key] for r in runs]
    out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
  out["sys_share"] = statistics.median(r["sys_s"] / (r["user_s"] + r["sys_s"]) for r in runs)
  return out


def main(argv):
  del argv
  available = configurations()
  unknown = [c for c in _CONFIGS.value if c not in available]
  if unknown:
    raise SystemExit(f"--configs: unknown {unknown}; known {sorted(available)}")
  names = []
  for name in _CONFIGS.value:
    if available[name] is None:
      print(f"bench_alloc: {name} skipped: its library was not found", file=sys.stderr)
    else:
      names.append(name)
  with tempfile.TemporaryDirectory(prefix="lla-bench-alloc-") as tmp:
    root = Path(_WORKDIR.value or tmp)
    root.mkdir(parents=True, exist_ok=True)
    base = {k: v for k, v in os.environ.items() if k not in _ALLOCATOR_ENV}
    base["LLA_COMPILATION_CACHE_DIR"] = _CACHE.value or str(root / "jax_cache")
    if _WORKLOAD.value == "replay":
      hf_dir, capture = prepare(root, base)
      command = lambda run_dir: replay_command(hf_dir, capture, run_dir)
      identity, allocator_of = prediction_hashes, recorded_allocator
    elif _WORKLOAD.value == "pretrain":
      command = pretrain_command
      # The checkpoint records no provenance: the configuration's environment says it.
      identity, allocator_of = checkpoint_hash, lambda _: None
    else:
      command = main_table_command
      identity = main_table_hashes
      allocator_of = lambda run_dir: recorded_allocator(run_dir / "study")
    print("command:\n  " + " ".join(command(Path("RUN"))[1:]))
    if _WARMUP.value:
      timed(command(root / "warmup"), base, root / "warmup.log")
    runs, hashes = {n: [] for n in names}, {}
    for r in range(_REPEATS.value):
      for name in names[r % len(names):] + names[:r % len(names)]:
        run_dir = root / f"run_{name}_{r}"
        result = timed(command(run_dir), {**base, **available[name]},
                       root / f"{run_dir.name}.log")
        result["allocator"] = allocator_of(run_dir) or available[name]
        hashes[run_dir.name] = identity(run_dir)
        runs[name].append(result)
        print(f"  round {r} {name:10s} wall {result['wall_s']:7.1f} s  user "
              f"{result['user_s']:7.1f}  sys {result['sys_s']:6.1f}  minflt "
              f"{result['minflt'] / 1e6:6.2f} M  load {result['load_before']:.1f}", flush=True)
  reference = next(iter(hashes.values()))
  identical = bool(reference) and all(h == reference for h in hashes.values())
  summary = {n: summarise(runs[n]) for n in names}
  baseline = "tcmalloc" if "tcmalloc" in summary else names[0]
  print(f"\n{'config':10s} {'wall s':>8s} {'user s':>8s} {'sys s':>7s} {'sys %':>6s} "
        f"{'minflt M':>9s} {'rss MB':>7s} {'wall/' + baseline:>14s}")
  for n in names:
    s = summary[n]
    s["wall_ratio_to_" + baseline] = s["wall_s"]["median"] / summary[baseline]["wall_s"]["median"]
    print(f"{n:10s} {s['wall_s']['median']:8.1f} {s['user_s']['median']:8.1f} "
          f"{s['sys_s']['median']:7.1f} {100 * s['sys_share']:5.1f}% "
          f"{s['minflt']['median'] / 1e6:9.2f} {s['maxrss_mb']['median']:7.0f} "
          f"{s['wall_ratio_to_' + baseline]:14.2f}")
  print(f"outputs byte-identical across all {len(hashes)} runs: {identical}")
  if _OUT_JSON.value:
    results = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
               "cpus": os.cpu_count(), "workload": _WORKLOAD.value,
               "command": command(Path("RUN")),
               "configs": {n: available[n] for n in names}, "runs": runs, "summary": summary,
               "baseline": baseline, "predictions_identical": identical,
               "prediction_sha256": reference}
    Path(_OUT_JSON.value).write_text(json.dumps(results, indent=2) + "\n")
  if not identical:
    raise SystemExit("outputs differ between allocator configurations")


if __name__ == "__main__":
  app.run(main)
