"""What a person reads: the terminal at 80 columns, the plots beside ladder.md, the CSV, and compare's verdicts."""
import contextlib
import csv
import io
import json
import os
import subprocess
import sys

import pytest

from conftest import FAST, REPO
from harness.cli import main
from harness.results import compare, plots, report, tables

ENV80 = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "80"}
# The two sweeps that compare judges run each cell on one intra-op thread. With two threads on a 2-core host, a cell
# shares its second core with the ladder's own process and the test runner: the same eager batch-2 cell measured
# 9 ms in one run and 18 ms in the next (beyond the CPU noise floor), as whatever else ran took that core or not.
ONE_THREAD = {**ENV80, "OMP_NUM_THREADS": "1"}


def harness(*args: str, env=ENV80, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def reads(*args: str) -> subprocess.CompletedProcess:
    """A command that only reads records (compare, tiers) through harness.cli.main in this process, in an
    80-column terminal: what `harness` returns, without a child that imports torch again (5-8 s a call on 2
    cores)."""
    out, err = io.StringIO(), io.StringIO()
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "80"
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = main(list(args))
            except SystemExit as e:  # argparse's refusals
                status = e.code
    finally:
        os.environ.pop("COLUMNS") if columns is None else os.environ.update(COLUMNS=columns)
    return subprocess.CompletedProcess(args, status, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """A real CPU sweep over two rungs and two batch sizes, in an 80-column terminal."""
    out = tmp_path_factory.mktemp("sweep")
    proc = harness("sweep", "--device", "cpu", "--tiers", "eager,onnxruntime,tensorrt", "--model", "resnet18",
                   "--batch", "1,2", "--res", "32", "--out", str(out), "--csv", str(out / "ladder.csv"), *FAST,
                   env=ONE_THREAD)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stdout


def test_final_table_fits_80_columns_with_whole_header_words(sweep):
    _, stdout = sweep
    assert max(len(line) for line in stdout.splitlines()) <= 80
    final = stdout[stdout.index("resnet18 on cpu"):]
    header = next(line for line in final.splitlines() if line.startswith("rung"))
    assert header.split() == ["rung", "batch", "dtype", "layout", "median", "ms", "img/s", "vs", "eager", "vs", "fw",
                              "bound", "parity"]
    assert "tensorrt 2 cells: unavailable: TensorRT needs an NVIDIA GPU" in final  # one line, not one per cell
    assert "batch 2 fp32 nchw res 32: fastest" in final


def test_plots_are_written_and_linked_from_the_markdown(sweep):
    out, _ = sweep
    md = (out / "ladder.md").read_text()
    for stem in ("throughput", "latency", "overhead", "first_result", "memory"):
        png = out / "plots" / f"{stem}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", stem
        assert f"](plots/{stem}.png)" in md
    assert not (out / "plots" / "tflops.png").exists()  # no matmul peak on the CPU: nothing to draw


def test_plots_never_mix_tasks_resolutions_or_layouts(tmp_path):
    """A merged document of inference and training, two resolutions and two layouts: every panel holds one of
    each, a rung's line has one point per batch, the per-call and memory panels one batch each, and the panels say
    which task they show."""
    def rec(task, res, channels_last, batch, label):
        ms = batch * (3.0 if task == "train" else 1.0) * res / 64
        return {"tier": label, "label": label, "task": task, "model": "resnet50", "batch": batch, "res": res,
                "dtype": "bf16", "channels_last": channels_last, "cuda_graph": False, "device": "cuda",
                "options": {}, "status": "ok", "latency_ms": {"median": ms}, "host_overhead_us": {"median": 50.0},
                "throughput_img_s": batch / ms * 1e3, "memory": {"allocator_peak_bytes": batch * 2**30}}

    records = [rec(t, res, cl, b, label) for t in ("infer", "train") for res in (64, 224) for cl in (False, True)
               for b in (1, 8) for label in ("eager", "cudnn")]
    panels = plots._by_panel(records)
    assert len(panels) == 8
    for key, group in panels.items():
        assert len({(r["task"], r["res"], r["channels_last"], r["dtype"]) for r in group}) == 1
        for _, line in plots._by_rung(group):
            assert sorted(r["batch"] for r in line) == [1, 8]
    names = [plots._panel_name(k, list(panels)) for k in panels]
    assert "training bf16 nhwc res 224" in names and "inference bf16 nchw res 64" in names
    assert all(len({r["batch"] for r in g}) == 1 for g in plots._at_batch(records, min).values())
    doc = {"results": records, "environment": {"gpu": {"name": "H100"}}}
    written = dict(plots.write_plots(doc, tmp_path))
    assert {"Latency against batch size", "Memory per rung"} <= set(written)


def test_csv_holds_numbers_and_plain_words(sweep):
    out, _ = sweep
    rows = list(csv.DictReader((out / "ladder.csv").open()))
    assert {r["status"] for r in rows} == {"ok", "unavailable"}
    for r in rows:
        if r["status"] == "ok":
            assert float(r["latency_median_ms"]) > 0 and float(r["throughput_img_s"]) > 0
            assert int(r["batch"]) in (1, 2) and float(r["speedup_vs_eager"]) > 0
            assert r["parity_ok"] == "True" and r["speedup_cross_run"] == "False"
        else:
            assert r["latency_median_ms"] == "" and "NVIDIA GPU" in r["reason"]


def test_compare_same_cells_within_noise_and_a_slower_run_fails(sweep, tmp_path):
    """A run against itself is within noise, three times as slow a regression (beyond the CPU's 100% floor), three
    times as fast an improvement; a cell measured beside another busy process is not judged."""
    doc = json.loads((sweep[0] / "ladder.json").read_text())
    for r in doc["results"]:  # as measured on a quiet host (a busy CI host may flag some)
        r.setdefault("contention", {})["flagged"] = False
    a = tmp_path / "a.json"
    a.write_text(json.dumps(doc))
    same = reads("compare", str(a), str(a), "--markdown", str(tmp_path / "same.md"))
    assert same.returncode == 0, same.stdout + same.stderr
    assert "0 regressions, 0 improvements, 4 within noise" in " ".join(same.stdout.split())
    busy = json.loads(a.read_text())
    next(r for r in busy["results"] if r["status"] == "ok")["contention"]["flagged"] = True
    rows = compare.compare([doc["results"]], [busy["results"]], 0.03)
    (flagged,) = [r for r in rows if r["verdict"] == compare.CONTENDED]
    assert flagged["a_ms"] > 0 and flagged["b_ms"] > 0 and flagged["ratio"] is None  # shown, not judged
    assert [r["verdict"] for r in rows].count("within noise") == 3
    (anyway,) = [r for r in compare.compare([doc["results"]], [busy["results"]], 0.03, include_contended=True)
                 if r["rung"] == flagged["rung"] and r["batch"] == flagged["batch"]]
    assert anyway["verdict"] == "within noise" and anyway["basis"].endswith(", contended")
    only_busy = tmp_path / "busy.json"
    for r in busy["results"]:
        r.setdefault("contention", {})["flagged"] = True
    only_busy.write_text(json.dumps(busy))
    nothing = reads("compare", str(a), str(only_busy))
    assert nothing.returncode == compare.NOTHING_JUDGED and "6 not judged" in " ".join(nothing.stdout.split())
    assert "nothing judged: none of the 6 cells" in " ".join(nothing.stdout.split())
    assert reads("compare", str(a), str(only_busy), "--include-contended").returncode == 0
    other = json.loads(a.read_text())
    for r in other["results"]:
        r["batch"] += 100
    disjoint = tmp_path / "disjoint.json"
    disjoint.write_text(json.dumps(other))
    apart = reads("compare", str(a), str(disjoint))
    assert apart.returncode == compare.NOTHING_JUDGED and "the runs share no cell" in apart.stdout
    shifted = json.loads(a.read_text())  # every cell 30% slower: inside each CPU cell's floor, not the run's
    for r in shifted["results"]:
        if r["status"] == "ok":
            r["latency_samples_ms"] = [v * 1.3 for v in r["latency_samples_ms"]]
            r["latency_ms"]["median"] *= 1.3
    (tmp_path / "shifted.json").write_text(json.dumps(shifted))
    shift = reads("compare", str(a), str(tmp_path / "shifted.json"))
    assert shift.returncode == 1, shift.stdout + shift.stderr
    assert "0 regressions, 0 improvements, 4 within noise" in " ".join(shift.stdout.split())
    assert "run level, cpu cells (4): B/A geometric mean 1.300" in shift.stdout and "regression" in shift.stdout
    assert "run level, cpu cells (4): B/A geometric mean 1.000" in same.stdout
    for r in doc["results"]:
        if r["status"] == "ok":
            r["latency_samples_ms"] = [v * 3 for v in r["latency_samples_ms"]]
            r["latency_ms"]["median"] *= 3
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps(doc))
    worse = reads("compare", str(a), str(slow), "--threshold", "3%")
    assert worse.returncode == 1
    assert "4 regressions" in " ".join(worse.stdout.split())
    better = reads("compare", str(slow), str(a))
    assert better.returncode == 0 and "4 improvements" in " ".join(better.stdout.split())
    assert "| verdict |" in (tmp_path / "same.md").read_text()


@pytest.mark.quick
def test_bootstrap_interval_brackets_one_for_one_distribution_and_excludes_it_for_a_shift():
    import numpy as np

    rng = np.random.default_rng(1)
    a, b = rng.normal(10, 0.2, 50), rng.normal(10, 0.2, 50)
    ratio, low, high = compare.ratio_ci([list(a)], [list(b)])
    assert low < 1 < high and compare.verdict(ratio, low, high, 0.03) == "within noise"
    ratio, low, high = compare.ratio_ci([list(a)], [list(b * 1.05)])
    assert low > 1 and compare.verdict(ratio, low, high, 0.03) == "regression"
    assert compare.verdict(ratio, low, high, 0.10) == "within noise"  # real, but under the threshold


@pytest.mark.quick
def test_several_runs_a_side_put_the_spread_between_runs_into_the_interval():
    """Two runs a side whose medians differ by 10% between processes: B is 5% slower in each pair. One pair alone
    is a tight, clear 'regression'; over both runs a side the interval covers the runs' spread and brackets 1."""
    import numpy as np

    rng = np.random.default_rng(2)
    a = [list(rng.normal(10, 0.05, 60)), list(rng.normal(11, 0.05, 60))]
    b = [list(rng.normal(10.5, 0.05, 60)), list(rng.normal(11.55, 0.05, 60))]
    ratio, low, high = compare.ratio_ci(a[:1], b[:1])
    assert low > 1 and compare.verdict(ratio, low, high, 0.03) == "regression"
    ratio, low, high = compare.ratio_ci(a, b)
    assert abs(ratio - 1.05) < 0.01 and low < 1 < high
    ratio, low, high = compare.ratio_ci(a, [[v * 1.5 for v in s] for s in a])  # a change larger than the spread
    assert low > 1.2 and compare.verdict(ratio, low, high, 0.03) == "regression"


@pytest.mark.quick
def test_noise_floor_by_class_and_host_share():
    """One run a side: a GPU-bound cell needs the GPU floor, a cell paced by its host the host floor, a CPU cell the
    CPU floor."""
    def rec(host_ms: float, device: str = "cuda") -> dict:
        return {"status": "ok", "device": device, "latency_ms": {"median": 1.0},
                "host_overhead_us": {"median": host_ms * 1e3}}

    floor = compare.NOISE_FLOOR
    assert compare.noise_floor([rec(0.1), rec(0.4)]) == (floor["gpu"], "gpu")
    assert compare.noise_floor([rec(0.1), rec(0.55)]) == (floor["host"], "host")  # the noisier of the two runs
    assert compare.noise_floor([rec(1.0, "cpu"), rec(1.0, "cpu")]) == (floor["cpu"], "cpu")
    assert floor["gpu"] < floor["host"] < floor["cpu"]  # as noise_floor ranks them


@pytest.fixture(scope="module")
def sweep_again(tmp_path_factory):
    """`sweep`'s eager and ONNX Runtime cells, run again: the same code on the same machine."""
    out = tmp_path_factory.mktemp("sweep-again")
    proc = harness("sweep", "--device", "cpu", "--tiers", "eager,onnxruntime", "--model", "resnet18",
                   "--batch", "1,2", "--res", "32", "--out", str(out), *FAST, env=ONE_THREAD)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_two_runs_of_the_same_code_are_neither_a_regression_nor_an_improvement(sweep, sweep_again, tmp_path):
    """Host-bound cells (the CPU computes them) of two real runs, one a side: the noise floor applies and says so;
    the same runs twice a side use the spread between them instead; a real slow-down still shows both ways."""
    a, b = sweep[0] / "ladder.json", sweep_again / "ladder.json"
    busy = [r for path in (a, b) for r in json.loads(path.read_text())["results"]
            if r["tier"] == "eager" and compare.contended([r])]
    if busy:  # a cell measured beside other load says nothing about the code; the test needs an idle host
        pytest.skip(f"the host was busy while {len(busy)} eager cells were timed (other CPUs busy "
                    f"{max(r['contention']['other_cpus_busy'] for r in busy):.2f}): not a comparison of the code")
    one = reads("compare", str(a), str(b), "--markdown", str(tmp_path / "one.md"))
    assert one.returncode == 0, one.stdout + one.stderr
    assert "0 regressions, 0 improvements" in " ".join(one.stdout.split())
    (level,) = compare.run_shifts(compare.compare(compare.load_side([a]), compare.load_side([b]), 0.03), 0.03)
    assert level["class"] == "cpu" and level["verdict"] == "within noise", level
    assert max(map(len, one.stdout.splitlines())) <= 80 and "\neager " in one.stdout and "…" not in one.stdout
    rows = compare.compare(compare.load_side([a]), compare.load_side([b]), 0.03)
    timed = [r for r in rows if r["basis"]]
    assert all(r["verdict"] == "within noise" for r in timed) and len(timed) == 4
    assert all(r["basis"] == f"floor {compare.NOISE_FLOOR['cpu']:.0%} cpu" for r in timed)
    eager = [r for r in compare.compare(compare.load_side([a, b]), compare.load_side([b, a]), 0.03)
             if r["rung"] == "eager"]
    assert all(r["basis"] == "2+2 runs" and r["verdict"] == "within noise" for r in eager)
    slow = []
    for i, path in enumerate((a, b)):
        doc = json.loads(path.read_text())
        for r in doc["results"]:
            if r["status"] == "ok":
                r["latency_samples_ms"] = [v * 3 for v in r["latency_samples_ms"]]
                r["latency_ms"]["median"] *= 3
        slow.append(tmp_path / f"slow{i}.json")
        slow[-1].write_text(json.dumps(doc))
    worse = reads("compare", str(a), str(b), "--", *map(str, slow))
    assert worse.returncode == 1, worse.stdout
    judged = [r for r in compare.compare(compare.load_side([a, b]), compare.load_side(slow), 0.03) if r["basis"]]
    assert judged and all(r["verdict"] == "regression" for r in judged)


def test_compare_refuses_sides_it_cannot_split(sweep):
    a = str(sweep[0] / "ladder.json")
    for argv in ((a, a, a), (a, "--"), ("--", a)):
        proc = reads("compare", *argv)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, (argv, proc.stderr)


def test_compare_refuses_a_file_that_is_not_results(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    proc = reads("compare", str(bad), str(bad))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "not a ladder JSON document" in proc.stderr


def test_tiers_fits_80_columns():
    proc = reads("tiers")
    assert proc.returncode == 0
    table = proc.stdout.split("Why not:")[0]
    assert max(len(line) for line in table.splitlines()) <= 80
    assert "cudnn" in table and "Why not:" in proc.stdout


@pytest.mark.quick
def test_markdown_table_takes_every_key_of_rows_that_differ():
    # The cuDNN microbenchmark's rows differ: only an unfused layer says why it is unfused.
    rows = [{"layer": "conv1", "fused": False, "unfused_reason": "faster unfused", "median_ms": 0.3066},
            {"layer": "conv2", "fused": True, "median_ms": 0.1}]
    lines = tables.markdown_table(rows)
    assert lines[0] == "| layer | fused | unfused_reason | median_ms |"
    assert lines[2] == "| conv1 | False | faster unfused | 0.307 |"
    assert lines[3] == "| conv2 | True |  | 0.100 |"


def test_the_markdown_opens_with_rungs_by_dtype_and_drops_empty_columns(sweep):
    """A real CPU sweep's markdown: a rung x dtype table per batch size first (median ms; img/s and speed-up at the
    largest batch), within 100 columns; rungs with nothing measured named once; then every cell, without the GPU
    columns a CPU run leaves empty."""
    out, _ = sweep
    md = (out / "ladder.md").read_text().splitlines()
    first = md.index("### infer, batch 1, res 32: median ms per call")
    assert md[first + 2] == "| rung | fp32 |" and md[first + 4].startswith("| eager | ")
    assert "Not measured here (the reasons: below): onnxruntime, tensorrt." in md or any(
        line.startswith("Not measured here") and "tensorrt" in line for line in md)
    largest = md.index("### infer, batch 2, res 32: median ms per call, img/s and speed-up over eager")
    eager = md[largest + 4].replace(" (contended)", "")  # marked so where the host was busy while it was timed
    assert eager.startswith("| eager | ") and eager.endswith(" img/s, 1.00x |") and " ms, " in eager
    assert any(line.startswith("- batch 2 fp32 nchw res 32: fastest ") for line in md[:first])  # the sentence
    assert "TFLOP/s" not in md[md.index("## Every cell") + 2]  # a GPU figure, left out on the CPU
    assert all(len(line) <= 100 for line in md[first:md.index("## Every cell")])
    header = md[md.index("## Every cell") + 2]
    assert "GPU MiB (NVML)" not in header and "alloc MiB" not in header and "median ms" in header


@pytest.mark.quick
def test_micro_training_table_fits_100_columns_with_whole_layer_names():
    """The cudnn rung's training micro table, from a real H100 run's rows (290 steps, names up to 21 characters):
    at 100 columns every line fits and no layer name is cut or folded."""
    import io

    from rich.console import Console

    from harness.results.micro_tables import micro_table

    rows = json.loads((REPO / "results/nvidia-h100-80gb-hbm3/train/cudnn/micro/"
                       "micro_train_cudnn_b256_bf16.json").read_text())["rows"]
    console = Console(width=100, record=True, file=io.StringIO())
    console.print(micro_table("cudnn: training step", rows))
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 100
    shown = {line.split()[0] for line in lines if line.strip() and line.split()[0] in {r["layer"] for r in rows}}
    assert shown == {r["layer"] for r in rows}


@pytest.mark.quick
def test_a_training_micro_sums_each_pass_over_the_network():
    """micro --task train's per-pass totals: each layer's ms times its count, per rung column; `all` only for a
    column every pass has (the batch norm's PyTorch and Inductor columns are not the convolutions'); rows without
    a count (cudnn's, the whole schedule) count once; an `alternative` pass (another way of running passes that
    other rows time) has its total but stays out of `all`; an inference micro has none."""
    from harness.results.micro_tables import markdown, pass_totals

    rows = [{"layer": "a", "pass": "forward", "count": 3, "triton_ms": 1.0, "cudnn_ms": 0.5},
            {"layer": "b", "pass": "forward", "count": 1, "triton_ms": 2.0, "cudnn_ms": 1.0},
            {"layer": "a", "pass": "bn forward", "count": 3, "triton_ms": 0.25, "inductor_ms": 0.5}]
    assert pass_totals(rows) == [
        {"pass": "forward", "triton_ms": "5.00", "cudnn_ms": "2.50", "inductor_ms": ""},
        {"pass": "bn forward", "triton_ms": "0.75", "cudnn_ms": "", "inductor_ms": "1.50"},
        {"pass": "all", "triton_ms": "5.75", "cudnn_ms": "", "inductor_ms": ""}]
    assert "| all | 5.75 |" in markdown("t", rows)
    fused = {"layer": "a", "pass": "forward+stats", "count": 3, "triton_ms": 1.5, "alternative": True}
    assert pass_totals(rows + [fused])[-2:] == [
        {"pass": "forward+stats", "triton_ms": "4.50", "cudnn_ms": "", "inductor_ms": ""},
        {"pass": "all", "triton_ms": "5.75", "cudnn_ms": "", "inductor_ms": ""}]
    assert pass_totals([{"layer": "a", "pass": "dgrad", "median_ms": 0.5}] * 2)[-1] == {"pass": "all",
                                                                                         "median_ms": "1.00"}
    assert pass_totals([{"layer": "a", "triton_ms": 1.0}]) == []
    # a layer that could not run (cudnn's norm-conv probe where no engine runs it): no total for its pass, and an
    # empty cell, not "None", in the markdown
    probe = [{"layer": layer, "pass": "forward, norm prologue", "median_ms": ms, "replaces_ms": 0.6,
              "alternative": True}
             for layer, ms in (("a", 0.5), ("b", None))]
    assert pass_totals(probe)[0] == {"pass": "forward, norm prologue", "median_ms": "", "replaces_ms": "1.20"}
    assert "None" not in markdown("t", probe)


@pytest.mark.quick
def test_a_hand_written_cell_is_stated_against_the_best_framework_cell_of_its_dtype():
    """vs fw divides the fastest framework cell (any layout, mode or option; never a hand-written one) at the same
    task, batch, res and dtype (bf16 for fp8); the fastest line names it; the CSV and the JSON carry both."""
    from harness.results.columns import rows
    from harness.results.derive import best_framework, fastest_lines, speedups

    def rec(tier, ms, dtype="bf16", channels_last=True, options=None, batch=256):
        label = tier + (f"({','.join(options.values())})" if options else "")
        return {"key": f"{label}-{dtype}-{channels_last}-{batch}", "tier": tier, "label": label, "task": "infer",
                "model": "resnet50", "batch": batch, "res": 224, "dtype": dtype, "channels_last": channels_last,
                "cuda_graph": False, "device": "cuda", "options": options or {}, "status": "ok",
                "latency_ms": {"median": ms}, "host_overhead_us": {"median": 50.0},
                "throughput_img_s": batch / ms * 1e3}

    records = [rec("eager", 16.0), rec("eager", 20.0, channels_last=False), rec("compile", 11.0),
               rec("compile", 9.0, channels_last=False, options={"compile-mode": "max-autotune"}),
               rec("cudnn", 6.4), rec("triton", 6.0), rec("triton", 5.5, dtype="fp8"), rec("eager", 5.0, dtype="tf32"),
               rec("compile", 4.0, batch=32)]
    assert best_framework(records, records[5])["label"] == "compile(max-autotune)"
    assert best_framework(records, records[6])["label"] == "compile(max-autotune)"  # fp8 against bf16
    by_label = {(r["label"], r["dtype"]): row for r, row in zip(records, rows(records))}
    assert by_label[("triton", "bf16")]["vs fw"] == "1.50x" and by_label[("triton", "bf16")]["vs eager"] == "2.67x"
    assert by_label[("compile(max-autotune)", "bf16")]["vs fw"] == "1.00x"
    assert by_label[("triton", "fp8")]["vs fw"] == "1.64x§" and by_label[("triton", "fp8")]["vs eager"] == "2.91x§"
    line = next(x for x in fastest_lines(records) if x.startswith("batch 256 bf16 nhwc"))
    assert "fastest triton 6.00 ms, 2.67x eager, 1.50x the best framework cell (compile(max-autotune) bf16 nchw, " \
           "9.00 ms)" in line, line
    assert speedups(records, records[5])["best_framework"] == records[3]["key"]
    csv_triton = next(x for x in csv.DictReader(io.StringIO(report.to_csv({"results": records})))
                      if x["rung"] == "triton" and x["dtype"] == "bf16")
    assert csv_triton["speedup_vs_best_framework"] == "1.5" and csv_triton["best_framework"] == "compile(max-autotune)"
    md = report.markdown({"results": records, "environment": {}, "generated": "now"})
    assert "§ a mixed comparison: this cell's dtype over a bf16 cell" in md


@pytest.mark.quick
def test_a_run_level_shift_needs_its_cells_to_move_together_beyond_the_class_floor():
    def rows(ratios, cls="cpu"):
        return [{"verdict": "within noise", "ratio": x, "class": cls} for x in ratios]

    (uniform,) = compare.run_shifts(rows([1.29, 1.31, 1.3, 1.3]), 0.03)
    assert uniform["verdict"] == "regression" and uniform["ratio"] == pytest.approx(1.3, abs=1e-3)
    (faster,) = compare.run_shifts(rows([0.7, 0.72, 0.69]), 0.03)
    assert faster["verdict"] == "improvement"
    (scattered,) = compare.run_shifts(rows([1.4, 0.7, 1.1, 0.9]), 0.03)
    assert scattered["verdict"] == "within noise"
    (small,) = compare.run_shifts(rows([1.21, 1.2, 1.22, 1.2]), 0.03)  # together, as a host's draw moves a run
    assert small["verdict"] == "within noise"
    (gpu,) = compare.run_shifts(rows([1.05, 1.06, 1.05], "gpu"), 0.03)
    assert gpu["verdict"] == "regression"
    assert compare.run_shifts(rows([1.3, 1.3]), 0.03) == []  # too few cells to speak for the run
    # one rung beyond the floor and the other not, as two sweeps of the same code gave on a 2-core VM (these
    # ratios; docs/notes/compare-noise-floor.md): one rung's draw; every rung moved together: the run's
    rungs = ("eager",) * 2 + ("ort",) * 2
    one_rung = [{**r, "rung": rung} for r, rung in zip(rows([1.27, 1.136, 1.498, 1.675]), rungs)]
    (drawn,) = compare.run_shifts(one_rung, 0.03)
    assert drawn["verdict"] == "within noise" and drawn["ratio"] > 1.3 and drawn["ci_low"] > 1, drawn
    assert "by rung eager 1.20, ort 1.58" in compare.shift_line(drawn)
    both = [{**r, "rung": rung} for r, rung in zip(rows([1.29, 1.31, 1.3, 1.32]), rungs)]
    assert compare.run_shifts(both, 0.03)[0]["verdict"] == "regression"


@pytest.mark.quick
def test_the_stage_column_reads_records_from_before_and_after_the_code_share():
    """A stage check recorded before the e4m3 code share (its norm only) and one after it (figure and measure):
    both committed runs still render."""
    from harness.results import columns
    from harness.results.load import load_records

    before, _ = load_records([REPO / "results/nvidia-h200/checks/fp8-stage-ladder/results.jsonl"])
    after, _ = load_records([REPO / "results/nvidia-h200/fp8/e4m3-boundaries/results.jsonl"])
    shown = {row["stage err"] for row in columns.rows(before) + columns.rows(after)}
    assert "4.6e-03 layer3.0" in shown and "6.6e-02 layer3.0 (codes)" in shown, shown
