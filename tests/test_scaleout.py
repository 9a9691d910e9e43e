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

import dataclasses
import hashlib
import importlib.util
import itertools
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

pytestmark = pytest.mark.slow

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
  a shared stage first, and what XLA compiled: a worker may find an executable in the
  shared persistent cache that the local run compiled)."""
  out = {k: v for k, v in record.items()
         if k not in ("wall_s", "compile_s", "jax_compile", "provenance")}
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
  # The nodes start without glibc's arena limit (tests/conftest.py sets it for the suite's
  # processes): the sweep's driver must hand it to Ray's workers itself.
  env.pop("GLIBC_TUNABLES", None)
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
  # Ray's workers run their threads before they import lla; the environment the sweep
  # gives them holds malloc to one arena (lla.allocator.environment_for_workers).
  arenas = {json.loads((ray_dir / "study" / entry["record"]).read_text())
            ["provenance"]["allocator"]["arenas"] for c in cells for entry in c["attacks"]}
  assert arenas == {1}


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
  # One line, no traceback (a StudyError is an input error: experiments.cli).
  assert "Traceback" not in refused.stderr, refused.stderr[-3000:]
  assert refused.stderr.strip().splitlines()[-1].startswith(
      f"error: {changed}: missing or changed"), refused.stderr[-3000:]


def test_a_cell_made_by_another_attack_revision_is_not_resumed(ray_sweep, monkeypatch):
  """A finished cell whose record another revision of its attack made (a fix since) is
  refused, naming both revisions; at the revision that made it, the cell is reused."""
  from lla.attacks import registry  # pylint: disable=g-import-not-at-top
  from lla.sweep import cells as cells_lib  # pylint: disable=g-import-not-at-top
  from lla.sweep import study as study_lib  # pylint: disable=g-import-not-at-top
  _, local_dir, _, _ = ray_sweep
  study = str(local_dir / "study")
  path = sorted((local_dir / "study" / "cells").glob("*.json"))[0]
  stored = json.loads(path.read_text())
  cell = cells_lib.Cell(stored["cell_id"], stored["config"], stored["group"])
  assert study_lib.finished(study, cell) == stored
  ridge = registry.get("ridge")  # the attack as a later checkout would register it
  monkeypatch.setitem(registry._REGISTRY, "ridge",  # pylint: disable=protected-access
                      dataclasses.replace(ridge, spec=dataclasses.replace(ridge.spec, revision=2)))
  with pytest.raises(study_lib.StudyError,
                     match=rf"{path}: ridge ran at revision 1, the registered one is revision 2"):
    study_lib.finished(study, cell)


def test_frontier_report_matches_an_independent_computation(ray_sweep, tmp_path):
  """lla.sweep.frontier on the local sweep's study: each point's token recovery, each
  family's Pareto set and each pair's differences at its common FLOP levels recomputed here
  with numpy."""
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
  # Levels: none in this sweep's config, so a ladder x2.25 apart from 1.5 x the cheapest run;
  # an attack's run at a level is its nearest within x1.5 (ties: the cheaper).
  low = min(p["flops"] for p in table["points"])
  levels = table["summary"]["levels"]
  assert levels[0] == pytest.approx(1.5 * low)
  assert all(b / a == pytest.approx(2.25) for a, b in zip(levels, levels[1:]))
  near = lambda runs, level: min(
      (p for p in runs if abs(np.log(p["flops"] / level)) <= np.log(1.5) + 1e-9),
      key=lambda p: (abs(np.log(p["flops"] / level)), p["flops"]), default=None)
  # Every pair of the three attacks has a row: the loop below sees them all.
  attacks = sorted({p["attack"] for p in table["points"]})
  assert [(row["a"], row["b"]) for row in table["pairwise"]] == list(
      itertools.combinations(attacks, 2))
  compared = 0
  for row in table["pairwise"]:
    runs = {a: [p for p in table["points"] if p["attack"] == row[a]] for a in ("a", "b")}
    expected = [(level, near(runs["a"], level), near(runs["b"], level)) for level in levels]
    expected = [(level, pa, pb) for level, pa, pb in expected if pa and pb]
    assert [c["level"] for c in row["comparisons"]] == [level for level, _, _ in expected]
    if not expected:
      assert "no common level" in row["note"] or "ratio" in row
      continue
    compared += 1
    for entry, (_, pa, pb) in zip(row["comparisons"], expected):
      diff = per_doc[(row["b"], pb["cell_id"])] - per_doc[(row["a"], pa["cell_id"])]
      assert entry["diff_pp"] == pytest.approx(100 * diff.mean(), abs=1e-9)
      assert entry["lo_pp"] <= entry["diff_pp"] <= entry["hi_pp"]
  print(f"\npairs compared at a common level: {compared} of {len(table['pairwise'])}")
  assert compared > 0
  assert table["summary"]["compared"] == compared


# --- defended sweep cells ---------------------------------------------------------------
#
# Cells whose capture goes through a defense that draws a secret (a Haar projection of h at
# k = 2): two attack seeds on one defended capture (two groups, so two Ray actors may make
# that capture and draw its secret at the same time) and one undefended cell on the same
# documents. The secret comes from the defender's key store in the sweep's workdir.

DEFENDED_GRIDS = ("((('defense.name',('projection',)),('defense.param',('enabled',)),"
                  "('defense.strength',(True,)),('attacks',(('ridge,gradient_only',),)),"
                  "('seed',(0,1))),(('attacks',(('ridge',),)),))")
KEY_STORE = pathlib.Path("defender") / "secrets.json"  # lla.study.defense_sweep.KEY_STORE


def defended_command(work: pathlib.Path, workdir: pathlib.Path, *extra: str,
                     grids: str = DEFENDED_GRIDS) -> list[str]:
  return [sys.executable, "-m", "experiments.sweep", "--config=configs/sweep.py:test",
          f"--config.cell.target.hf_dir={work / 'hf'}",
          f"--config.cell.pretrained.hf_dir={work / 'hf'}",
          f"--config.cell.data.tokens_npy={work / 'tokens.npy'}",
          f"--config.cell.data.calibration_npy={work / 'cal.npy'}",
          "--config.cell.capture_batch_size=6", f"--config.grids={grids}",
          f"--workdir={workdir}", *extra]


@pytest.fixture(scope="module")
def defended_local(work, tmp_path_factory) -> pathlib.Path:
  """The defended sweep on the local backend, with a fresh key store; its workdir."""
  workdir = tmp_path_factory.mktemp("defended_sweep") / "local"
  subprocess.run(defended_command(work, workdir), cwd=REPO, env=environment(work),
                 check=True, timeout=TIMEOUT_S)
  return workdir


def _captures(workdir: pathlib.Path, defense: str) -> list[pathlib.Path]:
  return sorted((workdir / "captures").glob(f"k2_{defense}_*"))


def check_defended(workdir: pathlib.Path) -> None:
  """One secret for the one defended capture, the defender's own, and the defense applied."""
  defended, = _captures(workdir, "projection")
  plain, = _captures(workdir, "none")
  # Drawn from the OS: 128 random bits (below 2^64 with probability 2^-64), named by its
  # capture, its hash alone in the capture; its digits in no file of the study or captures.
  keys = json.loads((workdir / KEY_STORE).read_text())
  assert list(keys) == [f"captures/{defended.name}"]
  value = int(keys[f"captures/{defended.name}"])
  assert 2**64 <= value < 2**128
  target = json.loads((defended / "metadata.json").read_text())["protocol"]["T"]
  assert target["defense"] == "projection"
  assert target["defense_seed_sha256"] == hashlib.sha256(
      f"lla.defense.seed/{value}".encode()).hexdigest()
  assert target["defense_params"]["secret_source"] == "os_random_128"
  assert target["defense_params"]["label"] == "projection_enabledTrue"
  for path in [*(workdir / "study").rglob("*"), *(workdir / "captures").rglob("*")]:
    assert not path.is_file() or str(value).encode() not in path.read_bytes(), path
  # The defense was applied: h' = h R with R orthogonal, so h' differs from the undefended
  # capture's h of the same documents while every inner product of rows is kept.
  h = load_file(str(plain / "messages.safetensors"))["activations"].astype(np.float64)
  hp = load_file(str(defended / "messages.safetensors"))["activations"].astype(np.float64)
  rows, rows_p = h.reshape(-1, h.shape[-1]), hp.reshape(-1, hp.shape[-1])
  assert np.abs(rows_p - rows).max() > 0.1 * np.abs(rows).max()
  np.testing.assert_allclose(rows_p @ rows_p.T, rows @ rows.T,
                             atol=1e-4 * np.abs(rows @ rows.T).max())
  cells = [json.loads(p.read_text()) for p in (workdir / "study" / "cells").glob("*.json")]
  assert sorted(c["config"]["defense"]["name"] for c in cells) == ["none", "projection",
                                                                   "projection"]
  for cell in cells:
    for entry in cell["attacks"]:
      record = json.loads((workdir / "study" / entry["record"]).read_text())
      assert record["status"] == "ok", record
      assert record["defense"] == cell["config"]["defense"]["name"]
  assert len(study_results(workdir)) == 2 * 2 + 1


def test_defended_cells_on_the_local_backend(defended_local):
  check_defended(defended_local)


def test_defended_cells_on_ray_draw_one_secret_and_match_local(work, tmp_path):
  """On a 2-node Ray cluster (two actors, which may make the one defended capture at once):
  one secret is drawn and the capture holds its hash; the local backend given the same
  key store (the defender's secrets handed over) writes the same results."""
  require("ray")
  home = tmp_path / "home"
  home.mkdir()
  env = environment(work, HOME=str(home), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
  report = tmp_path / "cluster.json"
  subprocess.run([sys.executable, str(TESTS / "scaleout_ray.py"), str(report),
                  *defended_command(work, tmp_path / "ray", "--backend=ray")], cwd=REPO,
                 env=env, check=True, timeout=TIMEOUT_S)
  cluster = json.loads(report.read_text())
  assert cluster["returncode"] == 0 and len(cluster["nodes"]) == 2
  assert all(scaleout_net.is_loopback(a) for a in cluster["listening"])
  check_defended(tmp_path / "ray")
  (tmp_path / "local" / KEY_STORE).parent.mkdir(parents=True)
  shutil.copyfile(tmp_path / "ray" / KEY_STORE, tmp_path / "local" / KEY_STORE)
  subprocess.run(defended_command(work, tmp_path / "local"), cwd=REPO, env=environment(work),
                 check=True, timeout=TIMEOUT_S)
  assert study_results(tmp_path / "ray") == study_results(tmp_path / "local")


def test_defended_cell_refuses_a_capture_made_with_a_lost_secret(defended_local, work,
                                                                 tmp_path):
  """The key store lost: a new cell on the same defended capture draws a new secret, and
  the capture made with the old one is refused, naming the secret's hash; nothing is
  written for that cell."""
  workdir = tmp_path / "lost"
  shutil.copytree(defended_local, workdir)
  old = json.loads((workdir / KEY_STORE).read_text())
  (workdir / KEY_STORE).unlink()
  defended, = _captures(workdir, "projection")
  before = {p.name: p.read_bytes() for p in defended.iterdir()}
  grids = DEFENDED_GRIDS.replace("('seed',(0,1))", "('seed',(0,1,2))")
  done = subprocess.run(defended_command(work, workdir, grids=grids), cwd=REPO,
                        env=environment(work), capture_output=True, text=True,
                        timeout=TIMEOUT_S)
  assert done.returncode != 0
  last = done.stderr.strip().splitlines()[-1]
  assert last.startswith("error: 1 of 4 cells failed"), done.stderr[-2000:]
  new = json.loads((workdir / KEY_STORE).read_text())
  assert list(new) == list(old) and new != old
  commit = lambda keys: hashlib.sha256(
      f"lla.defense.seed/{int(keys[f'captures/{defended.name}'])}".encode()).hexdigest()
  assert "CaptureError" in last
  assert f"T.defense_seed_sha256 (stored '{commit(old)}', expected '{commit(new)}')" in last
  assert {p.name: p.read_bytes() for p in defended.iterdir()} == before
  assert len(list((workdir / "study" / "cells").glob("*.json"))) == 3
