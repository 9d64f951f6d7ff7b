"""Where the rungs run (harness/run/executor.py), for real: the ladder through a real Ray instance (started as a
cluster's head) against the local executor, resume, a rung's process killed mid-cell under Ray, a Ray worker lost
mid-cell, and the local executor with two slots side by side."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, ladder, ladder_command, records

pytest.importorskip("ray", reason="the Ray executor's extra: pip install -e '.[ray]'")

CELLS = ("--tiers", "eager,onnxruntime", "--model", "resnet18", "--batch", "1,2", "--res", "32")  # 18: less to export
RAY = str(Path(sys.executable).with_name("ray"))  # Ray's command line, installed beside this Python
# Set in the environment of the Ray instance this module starts, which its raylet, workers and their children
# inherit: a test kills only processes that carry it, never another job's that happen to match by name.
OWNER = f"LADDER_TEST_RAY={os.getpid()}-{time.time_ns()}"


@pytest.fixture(scope="module")
def cluster():
    """A real Ray instance on this host, started as a cluster's head is (`ray start --head`); each ladder joins it
    with --ray-address auto, as on a cluster."""
    name, value = OWNER.split("=")
    start = subprocess.run([RAY, "start", "--head", "--num-cpus", "2", "--include-dashboard", "false",
                            "--disable-usage-stats"], capture_output=True, text=True, timeout=120,
                           env={**os.environ, name: value})
    assert start.returncode == 0, start.stdout + start.stderr
    yield ("--executor", "ray", "--ray-address", "auto")
    subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=120)


def cells_of(out: Path) -> dict[tuple, dict]:
    return {(r["tier"], r["batch"]): r for r in records(out)}


def processes_with(words: str) -> list[int]:
    """PIDs of the processes this module's Ray instance started (they carry OWNER in their environment: Ray's
    workers are the raylet's children, not the ladder's) whose command line holds `words`."""
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if (words in (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                        and OWNER.encode() in (p / "environ").read_bytes().split(b"\0")):
                    found.append(int(p.name))
            except OSError:  # ended, or another user's
                continue
    return found


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_ray_gives_the_records_local_does(cluster, tmp_path):
    """The issue's check: the same cells, statuses, starts and parity through Ray as locally, each record naming
    the host that measured it; run again, the ladder finds every cell recorded and measures none."""
    local, ray = tmp_path / "local", tmp_path / "ray"
    assert ladder(local, *CELLS).returncode == 0
    proc = ladder(ray, *CELLS, *cluster)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Ray: " in proc.stdout and " tasks; to start one " in proc.stdout
    a, b = cells_of(local), cells_of(ray)
    assert a.keys() == b.keys() and len(a) == 4
    for key in a:
        for field in ("status", "start", "process_position"):
            assert a[key][field] == b[key][field], (key, field)
        # the rung's process inherits the driver's OMP_NUM_THREADS, not the 1 Ray gives its workers
        assert a[key]["where"]["omp_num_threads"] == b[key]["where"]["omp_num_threads"] == os.environ.get(
            "OMP_NUM_THREADS")
        assert b[key]["parity"]["ok"] and b[key]["where"]["host"] == os.uname().nodename
        assert b[key]["ray"]["dispatch_s"] >= 0 and b[key]["ray"]["return_s"] >= 0 and "ray" not in a[key]
    again = ladder(ray, *CELLS, *cluster)
    assert again.returncode == 0 and "4 already recorded" in again.stdout
    assert len((ray / "results.jsonl").read_text().splitlines()) == 4


def test_a_rungs_process_killed_mid_cell_under_ray_costs_its_cell(cluster, tmp_path):
    argv, env = ladder_command(tmp_path, "--tiers", "test-hangs,eager", "--batch", "1", "--res", "32", *cluster,
                               extra_tiers=True)
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline, hanging = time.time() + 300, []
    while time.time() < deadline and not hanging and proc.poll() is None:
        hanging = processes_with("harness.child.worker --tier test-hangs")
        time.sleep(0.2)
    assert hanging, "the hanging cell never started"
    time.sleep(2)
    for pid in hanging:
        os.kill(pid, signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    by = {r["tier"]: r for r in records(tmp_path)}
    assert by["test-hangs"]["status"] == "crashed" and "SIGKILL" in by["test-hangs"]["reason"]
    assert by["eager"]["status"] == "ok"


def test_a_lost_ray_worker_is_retried_and_costs_no_cell(cluster, tmp_path):
    """The Ray worker itself killed while its rung's process measures: Ray runs the task again, and every cell
    ends with a record of its own."""
    argv, env = ladder_command(tmp_path, "--tiers", "eager", "--batch", "1,2", "--res", "64", *cluster)
    argv[argv.index("--min-time") + 1] = "3"  # timed for long enough to be caught mid-cell
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline, children = time.time() + 300, []
    while time.time() < deadline and not children and proc.poll() is None:
        children = processes_with("-m harness.child.worker")  # its cells in one process: `--cells LISTING`
        time.sleep(0.2)
    assert children, "the rung's process never started"
    worker = parent(children[0])  # the Ray worker that started it (the launcher execs the child in place)
    assert "ray" in Path(f"/proc/{worker}/cmdline").read_bytes().decode(errors="replace").lower()
    os.kill(worker, signal.SIGKILL)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert [(r["batch"], r["status"]) for r in records(tmp_path)] == [(1, "ok"), (2, "ok")]


def test_two_local_slots_measure_two_rungs_side_by_side(tmp_path):
    """The local executor's several-GPU path, on two slots of this host: every cell recorded once, whole, with the
    same statuses as one slot gives (run here on the CPU, where the slots share the host)."""
    from harness.child.contract import Protocol
    from harness.run import executor
    from harness.run.context import Context
    from harness.run.measure import ordered
    from harness.run.plan import LadderConfig, plan
    from harness.run.prepare import prepare
    from harness.run.rundir import RunDir

    cells = plan(LadderConfig(tiers=["eager", "onnxruntime"], batch=[1], res=[32]), "cpu")
    run = RunDir(tmp_path, "resnet50", "cpu")
    run.write_weights("infer")
    ctx = Context(run=run, protocol=Protocol(iters=3, min_time_s=0, warmup_max=2, warmup_s=0, util_s=0.05))
    groups = ordered(cells)
    prepare(ctx, groups, 2, on_progress=lambda s: None)
    got: list[dict] = []
    executor.run_local(ctx, list(groups.values()), got.append, [None, None])
    assert sorted((r["tier"], r["batch"], r["status"]) for r in got) == [("eager", 1, "ok"), ("onnxruntime", 1, "ok")]


def test_a_ray_worker_takes_the_raylets_tree_as_the_ladders_own(cluster):
    """The contention check's 'ours' under Ray: the raylet that started every worker of this host, so that the
    ladder's cells on a host's other GPUs are not another user's load (they were, and a Ray run on two H100s flagged
    77 of 84 cells contended). Found from inside a real worker of the running instance."""
    import ray

    from harness.run.contention import ancestor_named, process_tree

    def probe() -> tuple:
        root = ancestor_named("raylet")
        return root, Path(f"/proc/{root}/comm").read_text().strip(), os.getpid() in process_tree(root)

    ray.init(address="auto", runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}}, log_to_driver=False)
    try:
        root, comm, inside = ray.get(ray.remote(num_cpus=1, max_calls=1)(probe).remote(), timeout=120)
    finally:
        ray.shutdown()
    assert comm == "raylet" and inside
    assert ancestor_named("raylet") is None  # outside Ray: the process's own tree, as before
