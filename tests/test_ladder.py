"""The ladder end to end on the CPU: real rungs in real child processes, real reports."""
import csv
import dataclasses
import datetime
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.run.rundir import read_jsonl as records_in
from tests.conftest import FAST, REPO, copy_run, ladder, ladder_command, other_load, records


def test_python_rungs_pass_parity(python_rungs):
    recs = records(python_rungs)
    assert {r["tier"] for r in recs} == {"eager", "torchscript", "compile", "onnxruntime"}
    for r in recs:
        assert r["status"] == "ok", (r["tier"], r.get("reason"))
        assert r["parity"]["ok"] and r["parity"]["rel_err"] < 1e-4 and r["parity"]["cosine"] > 0.99999
        assert r["latency_ms"]["n"] == len(r["latency_samples_ms"]) >= 3
        assert r["throughput_img_s"] == r["batch"] / r["latency_ms"]["median"] * 1e3


def test_json_schema(python_rungs):
    doc = json.loads((python_rungs / "ladder.json").read_text())
    assert doc["schema_version"] == 1
    for key in ("torch", "cudnn", "triton", "onnxruntime", "gpu", "cpu"):
        assert key in doc["environment"]
    assert doc["environment"]["host_cpu"] is None  # the host probe is an option (--host-probe)
    assert doc["command"].startswith("python -m harness ladder --device cpu") and doc["wall_s"] > 0
    assert doc["isolation"] == "rung"
    assert set(doc["definitions"]) >= {"latency_ms", "memory", "cold", "parity", "e2e_ms", "host_overhead_us",
                                       "measured_at", "source", "start", "isolation", "contention", "latency_stopped"}
    source = doc["environment"]["source"]
    assert len(source["digest"]) == 16
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    assert source["git_commit"] == (head.stdout.strip() if head.returncode == 0 else None)
    for r in doc["results"]:
        assert r["source"] == source["digest"]
        assert datetime.datetime.fromisoformat(r["measured_at"]) >= datetime.datetime.fromisoformat(
            doc["environment"]["started_utc"])
        for key in ("tier", "batch", "res", "dtype", "status", "parity", "latency_ms", "throughput_img_s", "cold",
                    "memory", "host_overhead_us", "pipelined", "tflops", "build_stats", "stream"):
            assert key in r, key
        assert r["dtype"] in ("fp32", "tf32", "fp16", "bf16")
        assert {"median", "p90", "p99", "min", "cv"} <= set(r["latency_ms"])
        assert r["cold"]["time_to_first_result_s"] >= r["cold"]["first_result_s"] > 0
        assert r["memory"]["rss_peak_bytes"] > 0
        assert r["tflops"]["flops_per_forward"] > 0
        assert r["isolation"] == "rung" and r["process_position"] == 0
        if r["tier"] in ("compile", "onnxruntime"):  # the prepare stage filled their caches cold (Inductor's;
            # the exported graph); the measured process started warm
            assert r["start"] == "warm-start" and r["prepared"]["start"] == "cold" and r["cache_bytes"] > 0
            assert r["prepared"]["time_to_first_result_s"] > r["cold"]["time_to_first_result_s"]
            if r["tier"] == "onnxruntime":  # exported once, in the prepare stage
                assert r["build_stats"]["onnx_file"] == "found in the rung's cache", r["build_stats"]
        else:
            assert r["start"] == "cold"
        assert r["latency_stopped"] in ("precision", "time", "iters")
        assert r["contention"]["window_s"] > 0 and r["contention"]["other_cpus_busy"] >= 0


def test_compile_reports_compiler_facts(python_rungs):
    rec = next(r for r in records(python_rungs) if r["tier"] == "compile")
    facts = rec["build_stats"]
    assert facts["graphs"] >= 1 and facts["graph_breaks"] == 0
    assert facts["guards"] > 0 and facts["guard_check_us"] > 0
    # the hot start: batch 2 -> 3 in the same process recompiles once (static shapes)
    assert rec["hot_start"]["batch_change"] == "2 -> 3" and rec["hot_start"]["recompiles"] == 1
    assert rec["hot_start"]["first_call_s"] > 0


def test_markdown_report(python_rungs):
    md = (python_rungs / "ladder.md").read_text()
    assert md.index("| rung | fp32 |") < md.index("## Every cell")  # the rung x dtype table first
    table = [line.replace(" (contended)", "") for line in md[md.index("## Every cell"):].splitlines()
             if line.startswith("| ")]  # a cell timed on a busy host is marked so
    assert table[0].startswith("| rung | task | batch | res | dtype | layout | start | status | median ms")
    assert len(table) == 1 + 4  # header + one row per cell
    assert any(line.startswith("| compile(default) | infer | 2 | 32 | fp32 | nchw | warm-start | ok |")
               for line in table)


def test_crashing_rungs_do_not_stop_the_ladder(tmp_path):
    # The hang costs the timeout: short on an idle host. Beside other load a rung's process takes longer than that
    # to start and fail its parity (beside a CPU burner, 25 s cut test-wrong's cell short: issue 57).
    timeout = "120" if other_load() else "25"
    proc = ladder(tmp_path, "--tiers", "test-segfault,test-raises,test-hangs,test-wrong,test-varies,eager", "--batch",
                  "1", "--res", "32", "--timeout", timeout, extra_tiers=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    by = {r["tier"]: r for r in records(tmp_path)}
    assert by["test-segfault"]["status"] == "crashed"
    assert signal.Signals.SIGSEGV.name in by["test-segfault"]["reason"]
    assert by["test-raises"]["status"] == "error"
    assert by["test-raises"]["reason"] == "RuntimeError: deliberate failure in build"
    assert by["test-hangs"]["status"] == "timeout" and "build" in by["test-hangs"]["reason"]
    assert by["test-wrong"]["status"] == "parity-fail" and by["test-wrong"].get("latency_ms") is None
    assert by["eager"]["status"] == "ok" and by["eager"]["repeatable"] is True
    # an output that varies from call to call passes parity and is flagged in the record and the table
    assert by["test-varies"]["status"] == "ok" and by["test-varies"]["repeatable"] is False
    assert "| test-varies |" in (md := (tmp_path / "ladder.md").read_text()) and " varies |" in md
    # every cell was recorded as it finished, not only at the end
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 6


def test_ctrl_c_keeps_every_finished_cell(tmp_path):
    argv, env = ladder_command(tmp_path, "--tiers", "eager,test-hangs", "--batch", "1", "--res", "32",
                               extra_tiers=True)
    # Ctrl-C's SIGINT at its default, as in a terminal's foreground job: a shell starts a background job with SIGINT
    # ignored, and Python (and so the ladder) keeps it ignored (CI run as `.ci/run &` failed here)
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    results, deadline = tmp_path / "results.jsonl", time.time() + 600
    while not (results.exists() and results.read_text().strip()) and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(2)  # the hanging cell's child is running now
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted: 1 of 2 cells recorded" in out
    # the report of what was measured is written, the cell in flight recorded as interrupted (a rerun retries it)
    assert [(r["tier"], r["status"]) for r in records(tmp_path)] == [("eager", "ok"), ("test-hangs", "interrupted")]


def test_resume_skips_recorded_cells(eager_cell_run, tmp_path):
    copy_run(eager_cell_run, tmp_path)
    first = (tmp_path / "results.jsonl").read_text().splitlines()
    proc = ladder(tmp_path, "--tiers", "eager,torchscript", "--batch", "1", "--res", "32")
    assert proc.returncode == 0 and "1 already recorded" in proc.stdout
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert lines[0] == first[0] and len(lines) == 2
    assert [r["tier"] for r in records(tmp_path)] == ["eager", "torchscript"]


def test_unavailable_rung_is_reported_and_skipped_cells_say_why(tmp_path):
    proc = ladder(tmp_path, "--tiers", "eager,tensorrt", "--batch", "1,2", "--res", "32", "--dtype", "fp32,bf16")
    assert proc.returncode == 0
    bf16 = next(r for r in records(tmp_path) if r["dtype"] == "bf16" and r["tier"] == "eager")
    assert bf16["status"] == "skipped" and "only fp32" in bf16["reason"]
    # the live progress says each reason once, and the final lines count the cells it covers
    assert proc.stdout.count("TensorRT needs an NVIDIA GPU") == 2, proc.stdout
    assert "tensorrt 4 cells: unavailable: TensorRT needs an NVIDIA GPU" in proc.stdout


def test_report_merges_a_cell_run_with_its_rung_default_option_and_without(python_rungs, tmp_path):
    """`--option onnxruntime:conv-algo-search=EXHAUSTIVE` (ORT's default) names the same cell as no option: a merged
    report keeps the later run's record of it, and a real variant (HEURISTIC) as a cell of its own."""
    from core.cell import Cell

    plain = next(r for r in records(python_rungs) if r["tier"] == "onnxruntime")

    def variant(search):
        cell = dataclasses.replace(Cell.of_record(plain), options=(("conv-algo-search", search),))
        return {**plain, "key": cell.key, "label": cell.label, "options": dict(cell.options)}

    runs = {"a": [plain], "b": [variant("EXHAUSTIVE"), variant("HEURISTIC")]}
    for name, recs in runs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    merged = tmp_path / "merged.json"
    proc = subprocess.run([sys.executable, "-m", "harness", "report", str(tmp_path / "a" / "results.jsonl"),
                           str(tmp_path / "b" / "results.jsonl"), "--json", str(merged)],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(merged.read_text())["results"]
    assert sorted((r["label"], r["run"]) for r in out) == [("onnxruntime(EXHAUSTIVE)", 1), ("onnxruntime(HEURISTIC)", 1)]


def test_resume_counts_an_option_at_its_rung_default_as_the_cell_already_run(python_rungs, tmp_path):
    for name in ("results.jsonl", "run.json"):
        shutil.copy(python_rungs / name, tmp_path / name)
    proc = ladder(tmp_path, "--tiers", "onnxruntime", "--model", "resnet18", "--batch", "2", "--res", "32",
                  "--option", "onnxruntime:conv-algo-search=EXHAUSTIVE")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "1 already recorded" in proc.stdout
    assert (tmp_path / "results.jsonl").read_text() == (python_rungs / "results.jsonl").read_text()


def test_one_process_per_rung_measures_its_cells_in_turn(tmp_path):
    """--isolation rung (default): the second cell runs in the process of the first (hot); --isolation cell: each
    in a fresh process (cold)."""
    assert ladder(tmp_path / "rung", "--tiers", "eager", "--batch", "1,2", "--res", "32").returncode == 0
    assert [(r["process_position"], r["start"]) for r in records(tmp_path / "rung")] == [(0, "cold"), (1, "hot")]
    proc = ladder(tmp_path / "cell", "--tiers", "eager", "--batch", "1,2", "--res", "32", "--isolation", "cell")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [(r["process_position"], r["start"]) for r in records(tmp_path / "cell")] == [(0, "cold"), (0, "cold")]
    assert all(r["isolation"] == "cell" for r in records(tmp_path / "cell"))


def test_ladder_runs_from_any_directory(tmp_path):
    """Relative --out from a foreign working directory: children get absolute paths."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _, env = ladder_command(tmp_path)
    argv = [sys.executable, "-m", "harness", "ladder", "--device", "cpu", "--tiers", "eager,onnxruntime", "--model",
            "resnet18", "--batch", "1", "--res", "32", "--out", "rel-out", *FAST]
    proc = subprocess.run(argv, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = elsewhere / "rel-out"
    assert [r["status"] for r in records(out)] == ["ok", "ok"]
    assert (out / "ladder.md").exists()


def test_rerun_with_another_protocol_is_refused(eager_cell_run, tmp_path):
    copy_run(eager_cell_run, tmp_path)
    proc = ladder(tmp_path, "--tiers", "eager", "--batch", "1", "--res", "32", "--isolation", "cell")
    assert proc.returncode == 2
    assert "holds a run with another isolation" in proc.stderr and "give another --out" in proc.stderr
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 1


def descendants(pid: int) -> set[int]:
    from harness.run.contention import process_tree

    return set(process_tree(pid)) - {pid}


def wait_for_hanging_child(proc, tmp_path) -> set[int]:
    """Waits until the ladder has recorded eager and started the hanging cell's child; returns its process tree."""
    deadline = time.time() + 600
    results = tmp_path / "results.jsonl"
    while time.time() < deadline:
        if results.exists() and results.read_text().strip():
            time.sleep(3)  # the hanging child is building now
            kids = descendants(proc.pid)
            if kids:
                return kids
        time.sleep(0.2)
    raise AssertionError("the hanging cell never started")


def alive(pids: set[int]) -> set[int]:
    left = set()
    for p in pids:
        try:
            state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            left.add(p)
    return left


def test_sigterm_ends_the_ladder_like_ctrl_c_and_leaves_no_child(tmp_path):
    argv, env = ladder_command(tmp_path, "--tiers", "eager,test-hangs", "--batch", "1", "--res", "32",
                               extra_tiers=True)
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    kids = wait_for_hanging_child(proc, tmp_path)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert not alive(kids)
    statuses = [r["status"] for r in map(json.loads, (tmp_path / "results.jsonl").read_text().splitlines())]
    assert statuses == ["ok", "interrupted"]
    assert [r["tier"] for r in records(tmp_path)] == ["eager", "test-hangs"]  # ladder.json written


def test_a_cell_stopped_in_its_hot_start_keeps_its_measurement(tmp_path):
    """The child writes its result before the hot start (which can take minutes): a ladder stopped there records
    the cell's timings, its hot start marked as stopped, and ends as interrupted."""
    argv, env = ladder_command(tmp_path, "--tiers", "test-slow-hot-start", "--batch", "1", "--res", "32",
                               extra_tiers=True)
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600
    while not list(tmp_path.glob("cells/**/result.json")) and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    (rec,) = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert rec["status"] == "ok" and rec["latency_ms"]["median"] > 0, rec.get("reason")
    assert rec["hot_start"] == {"error": "stopped during the hot start"}


def test_sigterm_in_the_prepare_stage_ends_the_ladder_at_once(tmp_path):
    """SIGTERM while the prepare stage builds and warms caches: the ladder ends within seconds, not when its
    jobs would have ended, and leaves no child."""
    argv, env = ladder_command(tmp_path, "--tiers", "eager,compile,libtorch", "--batch", "1", "--res", "32")
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline, kids = time.time() + 300, set()
    while time.time() < deadline and not kids:  # a job's process (a warm-up, a C++ build, a reference) runs
        kids = {p for p in descendants(proc.pid) if "harness.child.worker" in cmdline(p) or "cmake" in cmdline(p)}
        time.sleep(0.1)
    assert kids, "the prepare stage started no job"
    t = time.time()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    took = time.time() - t
    assert proc.returncode == 130, err[-2000:]
    assert took < 5, f"the ladder took {took:.1f} s to end"  # the 3 s, with room for a loaded CI host
    assert not alive(descendants(proc.pid) | kids)


def test_sigterm_while_the_reports_are_written_ends_at_once_and_leaves_them_valid(eager_cell_run, tmp_path):
    """A rerun of a finished ladder goes straight to its reports; SIGTERM as the table is shown, while the JSON,
    markdown and plots are written: one line, exit 130, within seconds, each report whole (old or new), no
    temporary file left."""
    copy_run(eager_cell_run, tmp_path)
    before = (tmp_path / "ladder.json").read_text()
    argv, env = ladder_command(tmp_path, "--tiers", "eager", "--batch", "1", "--res", "32")
    proc = subprocess.Popen(argv, cwd=REPO, env={**env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:  # the terminal table is printed first, then the files are written
        if line.lstrip().startswith("resnet50 on cpu"):
            break
    t = time.time()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    took = time.time() - t
    assert proc.returncode == 130, (proc.returncode, err[-2000:])
    assert err.strip().count("\n") == 0 and "interrupted while writing the reports" in err
    # Writing the reports in full takes about 3 s here, so the exit status and the message are what show the
    # interruption; the bound catches a ladder that waits on something after it (beside a CPU burner: 3.2 s).
    assert took < 10, f"the ladder took {took:.1f} s to end"
    assert json.loads((tmp_path / "ladder.json").read_text())["results"] == json.loads(before)["results"]
    assert not list(tmp_path.rglob("*.tmp"))


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_sigkill_of_the_ladder_kills_its_children(tmp_path):
    argv, env = ladder_command(tmp_path, "--tiers", "eager,test-hangs", "--batch", "1", "--res", "32",
                               extra_tiers=True)
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kids = wait_for_hanging_child(proc, tmp_path)
    proc.kill()
    proc.wait()
    deadline = time.time() + 10
    while alive(kids) and time.time() < deadline:
        time.sleep(0.1)
    assert not alive(kids)


def test_two_ladders_on_one_directory(tmp_path):
    argv, env = ladder_command(tmp_path, "--tiers", "eager,test-hangs", "--batch", "1", "--res", "32",
                               extra_tiers=True)
    first = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_hanging_child(first, tmp_path)
        second = ladder(tmp_path, "--tiers", "eager", "--batch", "1", "--res", "32")
        assert second.returncode == 2
        assert f"is in use by another ladder (PID {first.pid})" in second.stderr
    finally:
        first.kill()
        first.wait()
    # the dead holder's lock is taken over
    assert ladder(tmp_path, "--tiers", "eager", "--batch", "1", "--res", "32").returncode == 0


def test_a_reason_that_looks_like_markup_is_shown_verbatim(tmp_path):
    proc = ladder(tmp_path, "--tiers", "test-markup,eager", "--batch", "1", "--res", "32", extra_tiers=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    reason = "RuntimeError: cannot open [/tmp/x] in [bold]build[/bold]"
    assert records(tmp_path)[0]["reason"] == reason
    assert reason in proc.stdout
    rep = subprocess.run([sys.executable, "-m", "harness", "report", str(tmp_path / "ladder.json")], cwd=REPO,
                         capture_output=True, text=True, env={**__import__("os").environ, "COLUMNS": "200"})
    assert rep.returncode == 0 and reason in rep.stdout


def test_a_torn_results_file_is_read_and_resumed(eager_cell_run, tmp_path):
    copy_run(eager_cell_run, tmp_path)
    results = tmp_path / "results.jsonl"
    with open(results, "a") as f:
        f.write('{"key": "torchscript[]/resnet50/b1')  # a crash mid-write: torn, and no newline
    proc = ladder(tmp_path, "--tiers", "eager,torchscript", "--batch", "1", "--res", "32")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"{results}:2: skipped a line" in proc.stderr
    lines = results.read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[2])["tier"] == "torchscript"  # not glued to the torn line
    assert [r["tier"] for r in records(tmp_path)] == ["eager", "torchscript"]


def test_a_failing_reference_fails_only_its_cells(tmp_path):
    """densenet121 cannot run at resolution 8 (its pooling shrinks the map to nothing): those cells say so, and
    the resolution-64 cells are measured."""
    proc = ladder(tmp_path, "--model", "densenet121", "--tiers", "eager,torchscript", "--batch", "1", "--res", "8,64")
    assert proc.returncode == 0, proc.stderr[-2000:]
    by = {(r["tier"], r["res"]): r for r in records(tmp_path)}
    for tier in ("eager", "torchscript"):
        assert by[(tier, 8)]["status"] == "error" and "eager reference (batch 1, res 8) failed" in by[(tier, 8)]["reason"]
        assert by[(tier, 64)]["status"] == "ok"


def test_a_batch_that_cannot_fit_is_refused_before_any_work(tmp_path):
    proc = ladder(tmp_path, "--tiers", "eager", "--batch", "1,100000", "--res", "224")
    assert proc.returncode == 2
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("ladder: batch 100000 at res 224 needs about") and "the largest batch that fits is" in line
    assert not (tmp_path / "results.jsonl").exists() and not list(tmp_path.glob("*.safetensors"))


@pytest.mark.quick
def test_a_short_write_leaves_no_half_record_and_names_the_disk(tmp_path, monkeypatch):
    """The disk fills after half a record's line is written: the file is cut back to its last whole record, and
    the error names the cell and the disk."""
    from harness.run import rundir

    run = rundir.RunDir(tmp_path, "resnet18", "cpu")
    first = {"label": "eager", "batch": 1, "dtype": "fp32", "status": "ok"}
    run.append(first)
    write, calls = os.write, []

    def fills_up(fd, data):  # the first call takes half the bytes, the next finds the disk full
        calls.append(len(data))
        if len(calls) == 1:
            return write(fd, bytes(data[:len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(rundir.os, "write", fills_up)
    with pytest.raises(rundir.RecordNotSaved, match=r"^eager b2 fp32 not saved: writing .* failed \(No space left "
                                                     r"on device\) on the disk mounted at /"):
        run.append({**first, "batch": 2})
    monkeypatch.undo()
    assert len(calls) == 2 and run.results.read_text() == json.dumps(first) + "\n" and run.saved() == 1


@pytest.mark.quick
def test_the_free_space_check_counts_what_the_run_directory_holds(tmp_path):
    from harness.run.rundir import RunDir

    run = RunDir(tmp_path, "resnet18", "cpu")
    (tmp_path / "resnet18.weights.safetensors").write_bytes(b"\0" * (8 << 20))  # a resumed run's weights
    run.check_writable(shutil.disk_usage(tmp_path).free + (4 << 20))
    with pytest.raises(OSError, match="MiB free on its disk and 8 MiB held in it; a run here needs about"):
        run.check_writable(shutil.disk_usage(tmp_path).free + (12 << 20))


@pytest.mark.quick
def test_a_child_that_dies_on_a_full_disk_says_so(tmp_path):
    from harness.run.failures import failure_status

    status, reason = failure_status(1, None, "OSError: [Errno 28] No space left on device", disk=tmp_path)
    assert status == "error" and reason.startswith("disk full: the disk mounted at /") and "Errno 28" in reason
    assert failure_status(1, None, "", disk=tmp_path) == ("crashed", "exit code 1: no output")  # this disk has room


def test_a_disk_that_fills_mid_run_loses_no_record_silently(tmp_path):
    """results.jsonl on a tmpfs of one page, smaller than two records: the ladder stops at the cell whose record
    does not fit, saying it was not saved, on which disk, and how many cells are on disk (those before it, whole);
    nothing half-written stays."""
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(small)], capture_output=True,
                             text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({' '.join(mounted.stderr.split())}); the short write is injected "
                    "in test_a_short_write_leaves_no_half_record_and_names_the_disk")
    try:
        out = tmp_path / "run"
        out.mkdir()
        (out / "results.jsonl").symlink_to(small / "results.jsonl")
        proc = ladder(out, "--tiers", "eager", "--model", "resnet18", "--batch", "1,2", "--res", "32")
        assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
        line = " ".join(proc.stderr.split())
        said = re.search(rf"eager b([12]) fp32 not saved: writing {re.escape(str(out / 'results.jsonl'))} failed \(No "
                         rf"space left on device\) on the disk mounted at {re.escape(str(small))} \(0 MiB free\); "
                         rf"(\d) cells? (is|are) on disk", line)
        assert said, line  # a record is about 2.7-5 KB: the first or the second cell meets the full disk
        saved = [r["batch"] for r in records_in(out / "results.jsonl")]
        assert saved == list(range(1, int(said[1]))) and int(said[2]) == len(saved)
        kept = (small / "results.jsonl").read_text()
        assert kept == "" or kept.endswith("}\n")
        from harness.run.failures import failure_status
        status, reason = failure_status(1, None, "", disk=small)  # a child that died without a word on it
        assert status == "error" and reason.startswith(f"disk full: the disk mounted at {small} (0 MiB free)")
    finally:
        subprocess.run(["umount", str(small)], check=False)


def test_a_busy_child_of_the_ladder_that_ends_inside_the_window_is_still_its_own():
    """As a rung's process on another GPU ends while a cell is timed: its CPU time stays 'ours' (it passes to its
    parent when reaped), so neither its ticks before the window nor in it read as another process's."""
    from harness.run.contention import Contention

    if busy := other_load():
        pytest.skip(f"the host is busy (other processes keep {busy:.1f} CPUs busy): this test tells our child's CPU "
                    "time from another process's, which needs an idle host")
    check = Contention()
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 1.2: pass"])
    time.sleep(0.6)  # CPU time spent before the window opens
    check.begin()
    child.wait()  # it ends and is reaped inside the window
    time.sleep(0.3)
    check.end()
    assert check.result["other_cpus_busy"] < 0.5 and not check.result["flagged"], check.result


def test_a_cell_measured_beside_a_busy_process_is_marked_in_every_report_or_refused_on_request(tmp_path):
    """A busy loop outside the ladder's process tree: the cell is marked contended in the terminal, the fastest
    line, ladder.md and the CSV (warn), or refused (error)."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        argv = ("--tiers", "eager", "--model", "resnet18", "--batch", "1", "--res", "32", "--min-time", "0.5")
        refused = ladder(tmp_path / "error", *argv, "--isolation-check", "error")
        warned = ladder(tmp_path / "warn", *argv, "--csv", str(tmp_path / "warn" / "ladder.csv"))
    finally:
        busy.kill()
        busy.wait()
    assert refused.returncode == 0, refused.stderr[-2000:]
    (r,) = records(tmp_path / "error")
    assert r["contention"]["flagged"] and r["contention"]["other_cpus_busy"] > 0.5
    assert r["status"] == "contended" and "timings withheld" in r["reason"]
    assert "latency_ms" not in r or r.get("latency_ms") is None
    assert warned.returncode == 0, warned.stderr[-2000:]
    (r,) = records(tmp_path / "warn")
    assert r["status"] == "ok" and r["contention"]["flagged"]
    out = " ".join(warned.stdout.split())
    assert "fastest eager" in out and "eager (contended): measured beside other load" in out
    assert "1 of 1 measured cells ran beside other load" in out
    md = (tmp_path / "warn" / "ladder.md").read_text()
    assert "1 of 1 measured cells ran beside other load" in md and "| eager (contended) |" in md
    assert "(contended)" in md.split("## Every cell")[0].split("### infer")[1]  # the pivot's cell too
    (row,) = csv.DictReader(open(tmp_path / "warn" / "ladder.csv"))
    assert row["contended"] == "True" and float(row["other_cpus_busy"]) > 0.5


@pytest.mark.quick
def test_an_option_default_can_differ_by_device():
    """triton's launch path defaults to a recorded plan on the GPU and to Triton's own path on the CPU (whose
    interpreter compiles nothing to replay): each is the same cell as no option on its device, the other is not."""
    from core.cell import Cell
    from tiers import identity
    from tiers.triton import TIER

    for device, default, other in (("cuda", "plan", "jit"), ("cpu", "jit", "plan")):
        plain = Cell(tier="triton", device=device)
        assert TIER.setting(plain, "launch") == default
        assert identity(dataclasses.replace(plain, options=(("launch", default),))) == identity(plain)
        assert identity(dataclasses.replace(plain, options=(("launch", other),))) != identity(plain)
