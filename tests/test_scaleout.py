"""Scale-out, for real: one replay across two processes (jax.distributed over gloo), a killed
peer, and sweeps on a 2-node Ray cluster and on submitit, all on loopback.

Nothing is mocked and every job runs in subprocesses: this pytest process imports neither
JAX nor Ray (forking a process that holds JAX's threads can deadlock). The inputs are a
random tiny GPT-2 (V = 512, d = 32, 3 layers) and a 12-document training capture at k = 2
(tests/scaleout_inputs.py). Every server these jobs start (the JAX coordination service,
gloo, Ray's GCS and raylets, Ray workers) is checked to listen on loopback only.

With CI=true in the environment, a missing `ray` or `submitit` fails the tests that need it
instead of skipping them.
"""

import importlib.util
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

import scaleout_net

REPO = pathlib.Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
ATTACKS = "ridge,activation,gradient_only"
TIMEOUT_S = 240
EXIT_JOB_FAILED = 75  # lla.dist.EXIT_JOB_FAILED (not imported: lla.dist imports JAX)


def require(module: str) -> None:
  """Skips without `module`, or fails when the environment says CI=true."""
  if importlib.util.find_spec(module) is None:
    message = f"{module} is not installed (pip install -e \".[ray,slurm]\")"
    if os.environ.get("CI") == "true":
      pytest.fail(f"CI=true: {message}", pytrace=False)
    pytest.skip(message)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> pathlib.Path:
  """The shared inputs, and a compilation cache every subprocess of this module shares."""
  root = tmp_path_factory.mktemp("scaleout")
  subprocess.run([sys.executable, str(TESTS / "scaleout_inputs.py"), str(root)], check=True,
                 env=environment(root), timeout=TIMEOUT_S)
  return root


def environment(root: pathlib.Path, **extra) -> dict:
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(TESTS)]),
             JAX_PLATFORMS="cpu", LLA_COMPILATION_CACHE_DIR=str(root / "jax_cache"))
  env.pop("JAX_NUM_CPU_DEVICES", None)
  env.update(extra)
  return env


def replay_command(work: pathlib.Path, run: pathlib.Path, attacks: str = ATTACKS,
                   *extra: str) -> list[str]:
  return [sys.executable, "-m", "experiments.replay", "--config=configs/replay.py",
          f"--config.capture_dir={work / 'cap'}", f"--config.attacker.hf_dir={work / 'hf'}",
          "--config.attacker.checkpoint=", f"--config.calibration.tokens_npy={work / 'cal.npy'}",
          f"--config.attacks={attacks}", "--config.budget.candidates=8", f"--workdir={run}",
          *extra]


def start_job(command: list[str], env: dict, logs: pathlib.Path) -> list[subprocess.Popen]:
  """The same command as two processes of one job on 127.0.0.1."""
  port = free_port()
  processes = []
  for rank in range(2):
    with open(logs / f"process{rank}.log", "w") as log:
      processes.append(subprocess.Popen(
          command + [f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                     f"--process_id={rank}"], cwd=REPO, env=env, stdout=log,
          stderr=subprocess.STDOUT))
  return processes


def wait_all(processes, timeout_s: float, sample=None) -> list[int]:
  deadline = time.monotonic() + timeout_s
  while any(p.poll() is None for p in processes):
    if time.monotonic() > deadline:
      for p in processes:
        p.kill()
      pytest.fail(f"job did not finish within {timeout_s} s")
    if sample is not None:
      sample()
    time.sleep(0.3)
  return [p.returncode for p in processes]


def prediction_bytes(run: pathlib.Path) -> dict[str, bytes]:
  return {p.name: p.read_bytes() for p in sorted((run / "predictions").glob("*.npy"))}


def log_events(run: pathlib.Path) -> list[dict]:
  return [json.loads(line)["event"] for line in (run / "log.jsonl").read_text().splitlines()]


def test_replay_two_processes_writes_what_one_process_writes(work, tmp_path):
  """experiments.replay as two processes (one CPU device each) against one process with two
  CPU devices: the same global device count, so the same per-device shapes. Predictions
  byte-identical; FLOPs equal up to the partitioner's own few operations."""
  one = subprocess.Popen(replay_command(work, tmp_path / "one"), cwd=REPO,
                         env=environment(work, JAX_NUM_CPU_DEVICES="2"),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  two = start_job(replay_command(work, tmp_path / "two"), environment(work), tmp_path)
  listening = set()

  def sample():
    pids = set().union(*(scaleout_net.descendants(p.pid) for p in two))
    listening.update(scaleout_net.listening_addresses(pids))

  assert wait_all(two, TIMEOUT_S, sample) == [0, 0], (tmp_path / "process0.log").read_text()
  assert one.wait(TIMEOUT_S) == 0, one.stdout.read().decode()

  one_bytes, two_bytes = prediction_bytes(tmp_path / "one"), prediction_bytes(tmp_path / "two")
  assert sorted(two_bytes) == [f"{a}.npy" for a in sorted(ATTACKS.split(","))]
  assert two_bytes == one_bytes
  for attack in ATTACKS.split(","):
    records = [json.loads((tmp_path / run / "records" / f"{attack}.json").read_text())
               for run in ("one", "two")]
    assert records[1]["provenance"]["device_count"] == 2
    assert records[1]["flops"] == pytest.approx(records[0]["flops"], rel=1e-5)
  # Process 1 wrote nothing: one predictions event per attack, in one verifiable log.
  events = log_events(tmp_path / "two")
  assert sum(e["type"] == "predictions" for e in events) == len(ATTACKS.split(","))
  assert "process 1 of 2, 1 local of 2 devices" in (tmp_path / "process1.log").read_text()
  # The coordination service and gloo listened, on loopback only.
  assert listening and all(scaleout_net.is_loopback(a) for a in listening), listening


def test_replay_peer_killed_mid_job_fails_fast_without_partial_results(work, tmp_path):
  """Process 1 is SIGKILLed inside its first chunk of the second attack (tests/
  scaleout_plugins.py): process 0 stops at once with EXIT_JOB_FAILED and a message naming
  the lost peer; the first attack's finished results stay, nothing of the others exists."""
  command = replay_command(work, tmp_path / "run", "ridge,peer_dies,activation",
                           "--config.plugins=scaleout_plugins")
  processes = start_job(command, environment(work), tmp_path)
  start = time.monotonic()
  codes = wait_all(processes, TIMEOUT_S)
  assert codes == [EXIT_JOB_FAILED, -9], (tmp_path / "process0.log").read_text()
  assert time.monotonic() - start < 60
  log = (tmp_path / "process0.log").read_text()
  assert "a peer process died or became unreachable" in log
  run = tmp_path / "run"
  assert sorted(p.name for p in (run / "predictions").iterdir()) == ["ridge.npy"]
  assert sorted(p.name for p in (run / "records").iterdir()) == ["ridge.json"]
  assert not [p for p in run.rglob("*") if p.name.startswith(".tmp")]
  assert [e["type"] for e in log_events(run)].count("record") == 1


# --- sweeps -----------------------------------------------------------------------------

SWEEP_ATTACKS = "ridge,gradient_only"


def sweep_command(work: pathlib.Path, workdir: pathlib.Path, *extra: str) -> list[str]:
  """An 8-cell sweep: cut x C x (with / without `dies_once`, which kills its worker the
  first time it runs)."""
  marker = work / "dies_once_marker"
  plain = f"(('cut',(1,2)),('budget.candidates',(4,8)),('attacks',(('{SWEEP_ATTACKS}',),)))"
  dying = (f"(('cut',(1,2)),('budget.candidates',(4,8)),"
           f"('attacks',(('{SWEEP_ATTACKS},dies_once',),)),"
           f"('budget.dies_once_marker',('{marker}',)))")
  return [sys.executable, "-m", "experiments.sweep", "--config=configs/sweep.py:test",
          f"--config.cell.target.hf_dir={work / 'hf'}",
          f"--config.cell.pretrained.hf_dir={work / 'hf'}",
          f"--config.cell.data.tokens_npy={work / 'tokens.npy'}",
          f"--config.cell.data.calibration_npy={work / 'cal.npy'}",
          "--config.cell.capture_batch_size=6", "--config.cell.plugins=scaleout_plugins",
          f"--config.grids=({plain},{dying})", f"--workdir={workdir}", *extra]


def comparable(record: dict) -> dict:
  """A record without what legitimately differs between runs (timing, host, who computed
  a shared stage first)."""
  out = {k: v for k, v in record.items() if k not in ("wall_s", "compile_s", "provenance")}
  out["stages"] = {name: {k: v for k, v in stage.items()
                          if k not in ("wall_s", "compile_s", "computed_by")}
                   for name, stage in record["stages"].items()}
  return out


def study_results(workdir: pathlib.Path) -> dict:
  study = workdir / "study"
  out = {}
  for path in sorted((study / "cells").glob("*.json")):
    cell = json.loads(path.read_text())
    for entry in cell["attacks"]:
      record = json.loads((study / entry["record"]).read_text())
      out[entry["run_id"]] = (comparable(record), (study / entry["predictions"]).read_bytes())
  return out


@pytest.fixture(scope="module")
def ray_sweep(work, tmp_path_factory):
  """The 8-cell sweep on a 2-node Ray cluster (it kills one worker), then the same sweep on
  the local backend; returns (ray workdir, local workdir, the cluster's report)."""
  require("ray")
  root = tmp_path_factory.mktemp("ray_sweep")
  home = root / "home"
  home.mkdir()
  env = environment(work, HOME=str(home), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
  report = root / "cluster.json"
  subprocess.run([sys.executable, str(TESTS / "scaleout_ray.py"), str(report),
                  *sweep_command(work, root / "ray", "--backend=ray")], cwd=REPO, env=env,
                 check=True, timeout=TIMEOUT_S)
  subprocess.run(sweep_command(work, root / "local"), cwd=REPO, env=environment(work),
                 check=True, timeout=TIMEOUT_S)
  return root / "ray", root / "local", json.loads(report.read_text()), work


def test_sweep_on_two_node_ray_cluster_matches_local(ray_sweep):
  ray_dir, local_dir, cluster, _ = ray_sweep
  assert cluster["returncode"] == 0
  assert len(cluster["nodes"]) == 2 and {n["address"] for n in cluster["nodes"]} == {"127.0.0.1"}
  assert cluster["listening"] and all(scaleout_net.is_loopback(a) for a in cluster["listening"])
  ray_results, local_results = study_results(ray_dir), study_results(local_dir)
  assert len({run_id.split("/")[0] for run_id in ray_results}) == 8
  assert ray_results == local_results
  # Both nodes ran cells.
  cells = [json.loads(p.read_text()) for p in (ray_dir / "study" / "cells").glob("*.json")]
  assert {c["worker"]["node_id"] for c in cells} == {n["id"] for n in cluster["nodes"]}


def test_sweep_worker_killed_mid_cell_is_retried_and_written_once(ray_sweep):
  ray_dir, _, _, work = ray_sweep
  # The first `dies_once` cell killed its worker process; Ray restarted the actor and ran
  # the cell again: two attempts from two processes, then one attempt per later cell.
  attempts = (work / "dies_once_marker.attempts").read_text().split()
  dead = (work / "dies_once_marker").read_text()
  assert attempts[0] == dead and attempts.count(dead) == 1
  ray_attempts = 4 + 1  # 4 cells with dies_once on Ray, one of them twice
  assert len(attempts) == ray_attempts + 4  # + the local run's 4
  events = log_events(ray_dir / "study")
  written = [e["cell"] for e in events if e["type"] == "cell"]
  assert len(written) == len(set(written)) == 8
  predictions = [e["file"] for e in events if e["type"] == "predictions"]
  assert len(predictions) == len(set(predictions)) == 8 * 2 + 4


def test_sweep_on_submitit_local_executor_matches_local(ray_sweep, tmp_path):
  """One group of the same sweep (two cells) as a submitit job (LocalExecutor: a separate
  process)."""
  require("submitit")
  _, local_dir, _, work = ray_sweep
  local = study_results(local_dir)
  stored = [json.loads(p.read_text()) for p in sorted((local_dir / "study" / "cells").glob("*"))]
  group = stored[0]["group"]
  chosen = sorted(c["cell_id"] for c in stored if c["group"] == group)
  assert len(chosen) == 2
  subprocess.run(sweep_command(work, tmp_path / "submitit", "--backend=submitit",
                               "--submitit_cluster=local", f"--cells={','.join(chosen)}"),
                 cwd=REPO, env=environment(work), check=True, timeout=TIMEOUT_S)
  results = study_results(tmp_path / "submitit")
  assert results and results == {k: v for k, v in local.items() if k.split("/")[0] in chosen}


def test_sweep_resumes_verified_cells_and_refuses_changed_ones(ray_sweep, tmp_path):
  _, local_dir, _, work = ray_sweep
  workdir = tmp_path / "copy"
  shutil.copytree(local_dir, workdir)
  log_lines = len((workdir / "study" / "log.jsonl").read_text().splitlines())
  done = subprocess.run(sweep_command(work, workdir), cwd=REPO, env=environment(work),
                        capture_output=True, text=True, timeout=TIMEOUT_S)
  assert done.returncode == 0, done.stderr[-2000:]
  assert "8 cells (8 finished before, 0 run)" in done.stdout
  assert len((workdir / "study" / "log.jsonl").read_text().splitlines()) == log_lines
  changed = sorted((workdir / "study" / "predictions").glob("*.npy"))[0]
  changed.write_bytes(changed.read_bytes()[:-4] + b"\0\0\0\0")
  refused = subprocess.run(sweep_command(work, workdir), cwd=REPO, env=environment(work),
                           capture_output=True, text=True, timeout=TIMEOUT_S)
  assert refused.returncode != 0
  assert f"{changed}: missing or changed" in refused.stderr


def test_frontier_report_matches_an_independent_computation(ray_sweep, tmp_path):
  """lla.sweep.frontier on the local sweep's study: each point's token recovery, each
  family's Pareto set and each pair's difference recomputed here with numpy."""
  _, local_dir, _, work = ray_sweep
  study, out = local_dir / "study", tmp_path / "frontier"
  code = ("import sys; from lla.sweep import frontier; "
          "frontier.report(sys.argv[1], sys.argv[2], n_replicates=2000)")
  subprocess.run([sys.executable, "-c", code, str(study), str(out)], cwd=REPO,
                 env=environment(work), check=True, timeout=TIMEOUT_S)
  table = json.loads((out / "frontier.json").read_text())
  assert (out / "frontier.png").stat().st_size > 10_000
  truth = load_file(str(work / "cap" / "truth.safetensors"))["tokens"]
  per_doc = {}
  for point in table["points"]:
    cell = json.loads((study / "cells" / f"{point['cell_id']}.json").read_text())
    entry, = [e for e in cell["attacks"] if e["attack"] == point["attack"]]
    record = json.loads((study / entry["record"]).read_text())
    assert point["flops"] == record["flops"]
    hits = np.load(study / entry["predictions"]) == truth
    if record["scored_positions"] == "t>=1":
      hits = hits[:, 1:]
    assert point["recovery"] == pytest.approx(hits.mean(), abs=1e-12)
    per_doc[(point["attack"], point["cell_id"])] = hits.mean(axis=1)
  assert {p["attack"] for p in table["points"]} == {"ridge", "gradient_only", "dies_once"}
  for family in {p["family"] for p in table["points"]}:
    members = [(p["flops"], p["recovery"]) for p in table["points"] if p["family"] == family]
    undominated = {p for p in members if not any(
        q[0] <= p[0] and q[1] >= p[1] and q != p for q in members)}
    assert {(p["flops"], p["recovery"]) for p in table["points"]
            if p["family"] == family and p["on_frontier"]} == undominated
  for row in table["pairwise"]:
    runs = {a: [p for p in table["points"] if p["attack"] == row[a]] for a in ("a", "b")}
    cap = min(max(p["flops"] for p in runs["a"]), max(p["flops"] for p in runs["b"]))
    assert row["flops_cap"] == cap
    within = {a: [p for p in runs[a] if p["flops"] <= cap] for a in ("a", "b")}
    if not (within["a"] and within["b"]):
      assert row["note"] == "no run of one of them within the other's largest budget"
      continue
    best = {a: max(within[a], key=lambda p: (p["recovery"], -p["flops"])) for a in ("a", "b")}
    diff = (per_doc[(row["b"], best["b"]["cell_id"])]
            - per_doc[(row["a"], best["a"]["cell_id"])])
    assert row["diff_pp"] == pytest.approx(100 * diff.mean(), abs=1e-9)
    assert row["lo_pp"] <= row["diff_pp"] <= row["hi_pp"]
