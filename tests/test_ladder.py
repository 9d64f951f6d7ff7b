"""The ladder end to end on the CPU: real rungs in real child processes, real reports."""
import dataclasses
import datetime
import json
import shutil
import signal
import subprocess
import sys
import time

from tests.conftest import REPO, ladder, ladder_command, records


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
    for key in ("torch", "cudnn", "triton", "onnxruntime", "gpu", "cpu", "host_cpu"):
        assert key in doc["environment"]
    host = doc["environment"]["host_cpu"]
    assert 0 < host["p10_ms"] <= host["median_ms"] <= host["p90_ms"] and host["p90_over_p10"] >= 1
    assert set(doc["definitions"]) >= {"latency_ms", "memory", "cold", "parity", "e2e_ms", "host_overhead_us",
                                       "measured_at", "source"}
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


def test_compile_reports_compiler_facts(python_rungs):
    facts = next(r for r in records(python_rungs) if r["tier"] == "compile")["build_stats"]
    assert facts["graphs"] >= 1 and facts["graph_breaks"] == 0
    assert facts["guards"] > 0 and facts["guard_check_us"] > 0
    assert facts["recompiles_on_batch_change"] >= 0 and facts["batch_change"] == "2 -> 3"


def test_markdown_report(python_rungs):
    md = (python_rungs / "ladder.md").read_text()
    table = [line for line in md.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| rung | batch | res | dtype | status | median ms")
    assert len(table) == 1 + 4  # header + one row per cell
    assert any(line.startswith("| compile(default) | 2 | 32 | fp32 | ok |") for line in table)


def test_crashing_rungs_do_not_stop_the_ladder(tmp_path):
    proc = ladder(tmp_path, "--tiers", "test-segfault,test-raises,test-hangs,test-wrong,eager", "--batch", "1",
                  "--res", "32", "--timeout", "60", extra_tiers=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    by = {r["tier"]: r for r in records(tmp_path)}
    assert by["test-segfault"]["status"] == "crashed"
    assert signal.Signals.SIGSEGV.name in by["test-segfault"]["reason"]
    assert by["test-raises"]["status"] == "error"
    assert by["test-raises"]["reason"] == "RuntimeError: deliberate failure in build"
    assert by["test-hangs"]["status"] == "timeout" and "build" in by["test-hangs"]["reason"]
    assert by["test-wrong"]["status"] == "parity-fail" and by["test-wrong"].get("latency_ms") is None
    assert by["eager"]["status"] == "ok"
    # every cell was recorded as it finished, not only at the end
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 5


def test_ctrl_c_keeps_every_finished_cell(tmp_path):
    argv, env = ladder_command(tmp_path, "--tiers", "eager,test-hangs", "--batch", "1", "--res", "32",
                               extra_tiers=True)
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results, deadline = tmp_path / "results.jsonl", time.time() + 600
    while not (results.exists() and results.read_text().strip()) and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(2)  # the hanging cell's child is running now
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted: 1 of 2 cells recorded" in out
    assert [r["tier"] for r in records(tmp_path)] == ["eager"]  # the report of what was measured is written


def test_resume_skips_recorded_cells(tmp_path):
    assert ladder(tmp_path, "--tiers", "eager", "--batch", "1", "--res", "32").returncode == 0
    first = (tmp_path / "results.jsonl").read_text().splitlines()
    proc = ladder(tmp_path, "--tiers", "eager,torchscript", "--batch", "1", "--res", "32")
    assert proc.returncode == 0 and "1 already recorded" in proc.stdout
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert lines[0] == first[0] and len(lines) == 2
    assert [r["tier"] for r in records(tmp_path)] == ["eager", "torchscript"]


def test_unavailable_rung_is_reported_and_skipped_cells_say_why(tmp_path):
    proc = ladder(tmp_path, "--tiers", "eager", "--batch", "1", "--res", "32", "--dtype", "fp32,bf16")
    assert proc.returncode == 0
    bf16 = next(r for r in records(tmp_path) if r["dtype"] == "bf16")
    assert bf16["status"] == "skipped" and "only fp32" in bf16["reason"]


def test_report_merges_a_cell_run_with_its_rung_default_option_and_without(python_rungs, tmp_path):
    """`--option onnxruntime:conv-algo-search=EXHAUSTIVE` (ORT's default) names the same cell as no option: a merged
    report keeps the later run's record of it, and a real variant (HEURISTIC) as a cell of its own."""
    from tiers.base import Cell

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
    proc = ladder(tmp_path, "--tiers", "onnxruntime", "--batch", "2", "--res", "32",
                  "--option", "onnxruntime:conv-algo-search=EXHAUSTIVE")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "1 already recorded" in proc.stdout
    assert (tmp_path / "results.jsonl").read_text() == (python_rungs / "results.jsonl").read_text()
