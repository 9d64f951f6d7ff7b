"""Where the rungs run (harness/executor.py), for real: the ladder through a real local Ray instance against the
local executor, a rung's process killed mid-cell under Ray, a Ray worker lost mid-cell, resume, and the local
executor with two slots side by side."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, ladder, ladder_command, records

pytest.importorskip("ray", reason="the Ray executor's extra: pip install -e '.[ray]'")

CELLS = ("--tiers", "eager,onnxruntime", "--batch", "1,2", "--res", "32")


def cells_of(out: Path) -> dict[tuple, dict]:
    return {(r["tier"], r["batch"]): r for r in records(out)}


def processes_with(words: str) -> list[int]:
    """PIDs whose command line holds `words` (Ray's workers are the raylet's children, not the ladder's)."""
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if words in (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(p.name))
            except OSError:
                continue
    return found


def test_ray_gives_the_records_local_does(tmp_path):
    """The issue's check: the same cells, statuses, starts and parity through Ray as locally, each record naming
    the host that measured it."""
    local, ray = tmp_path / "local", tmp_path / "ray"
    assert ladder(local, *CELLS).returncode == 0
    proc = ladder(ray, *CELLS, "--executor", "ray")
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = cells_of(local), cells_of(ray)
    assert a.keys() == b.keys() and len(a) == 4
    for key in a:
        for field in ("status", "start", "process_position"):
            assert a[key][field] == b[key][field], (key, field)
        assert b[key]["parity"]["ok"] and b[key]["where"]["host"] == os.uname().nodename
    assert len((ray / "results.jsonl").read_text().splitlines()) == 4


def test_a_rungs_process_killed_mid_cell_under_ray_costs_its_cell(tmp_path):
    argv, env = ladder_command(tmp_path, "--tiers", "test-hangs,eager", "--batch", "1", "--res", "32",
                               "--executor", "ray", extra_tiers=True)
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline, hanging = time.time() + 300, []
    while time.time() < deadline and not hanging:
        hanging = processes_with("harness.worker --tier test-hangs")
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


def test_a_lost_ray_worker_is_retried_and_costs_no_cell(tmp_path):
    """The Ray worker itself killed while its rung's process measures: Ray runs the task again, and every cell
    ends with a record of its own."""
    argv, env = ladder_command(tmp_path, "--tiers", "eager", "--batch", "1,2", "--res", "64", "--executor", "ray")
    argv[argv.index("--min-time") + 1] = "3"  # timed for long enough to be caught mid-cell
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline, workers = time.time() + 300, []
    while time.time() < deadline and not workers:
        if processes_with("harness.worker --tier eager"):
            workers = processes_with("ray::measure_unit")
        time.sleep(0.2)
    assert workers, "no Ray worker measured the rung"
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert [(r["batch"], r["status"]) for r in records(tmp_path)] == [(1, "ok"), (2, "ok")]


def test_resume_under_ray_skips_recorded_cells(tmp_path):
    assert ladder(tmp_path, "--tiers", "eager", "--batch", "1", "--res", "32", "--executor", "ray").returncode == 0
    proc = ladder(tmp_path, "--tiers", "eager,torchscript", "--batch", "1", "--res", "32", "--executor", "ray")
    assert proc.returncode == 0 and "1 already recorded" in proc.stdout
    assert [json.loads(line)["tier"] for line in (tmp_path / "results.jsonl").read_text().splitlines()] == [
        "eager", "torchscript"]


def test_two_local_slots_measure_two_rungs_side_by_side(tmp_path):
    """The local executor's several-GPU path, on two slots of this host: every cell recorded once, whole, with the
    same statuses as one slot gives (run here on the CPU, where the slots share the host)."""
    from harness import executor
    from harness.context import Context
    from harness.contract import Protocol
    from harness.measure import ordered
    from harness.plan import LadderConfig, plan
    from harness.prepare import prepare
    from harness.rundir import RunDir

    cells = plan(LadderConfig(tiers=["eager", "onnxruntime"], batch=[1, 2], res=[32]), "cpu")
    run = RunDir(tmp_path, "resnet50", "cpu")
    run.write_weights("infer")
    ctx = Context(run=run, protocol=Protocol(iters=3, min_time_s=0, warmup_max=2, warmup_s=0, util_s=0.05))
    groups = ordered(cells)
    prepare(ctx, groups, 2, on_progress=lambda s: None)
    got: list[dict] = []
    executor.run_local(ctx, list(groups.values()), got.append, [None, None])
    assert sorted((r["tier"], r["batch"], r["status"]) for r in got) == [
        ("eager", 1, "ok"), ("eager", 2, "ok"), ("onnxruntime", 1, "ok"), ("onnxruntime", 2, "ok")]
