"""The protocol's statistics and the parity verdicts, on real numbers."""
import json
import statistics

import numpy as np
import pytest
import torch

from harness.results import columns, derive, report

from harness.run import host_noise
from harness.run import record as records
from core.parity import TOLERANCES, compare
from core.stats import summarize


@pytest.mark.quick
def test_summary_matches_definitions():
    rng = np.random.default_rng(0)
    samples = list(rng.lognormal(0, 0.3, 501))
    s = summarize(samples)
    assert s["median"] == statistics.median(samples)
    assert s["min"] == min(samples) and s["max"] == max(samples) and s["n"] == 501
    assert s["cv"] == pytest.approx(statistics.stdev(samples) / statistics.mean(samples))
    ordered = sorted(samples)
    assert ordered[449] <= s["p90"] <= ordered[451]
    assert ordered[494] <= s["p99"] <= ordered[496]
    assert summarize([]) is None


def logits(seed=0, batch=16):
    return torch.randn(batch, 1000, generator=torch.Generator().manual_seed(seed)) * 10


@pytest.mark.quick
@pytest.mark.parametrize("dtype", list(TOLERANCES))
def test_parity_accepts_rounding_of_the_dtype(dtype):
    ref = logits()
    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(dtype, torch.float32)
    out = ref.to(torch_dtype).float()
    assert compare(out, ref, dtype)["ok"]


@pytest.mark.quick
def test_parity_rejects_a_different_function():
    ref = logits()
    out = ref.clone()
    out[:, 0] += 5.0  # one class shifted: the kind of error a missing bias produces
    verdict = compare(out, ref, "bf16")
    assert not verdict["ok"] and "rel err" in verdict["reason"]


@pytest.mark.quick
def test_parity_rejects_nan_and_wrong_shape():
    ref = logits()
    out = ref.clone()
    out[3, 7] = float("nan")
    assert not compare(out, ref, "fp32")["ok"]
    assert not compare(ref[:, :10], ref, "fp32")["ok"]


@pytest.mark.quick
def test_top1_checked_on_decisive_rows_only():
    ref = logits(batch=4)
    ref[0, 0] = ref[0].max() + 50  # a decisive row
    out = ref.clone()
    out[0, 0] = ref[0, 1] - 1  # flips the decisive row's top-1
    verdict = compare(out, ref, "bf16")
    assert not verdict["ok"] and verdict["top1_agreement_decisive"] < 1


def record(tier="eager", batch=1, host_us=900.0, latency_ms=1.0, run=0, device="cuda", status="ok", **kw):
    """A minimal ok record of the shape the runner writes."""
    return {"tier": tier, "label": tier, "model": "resnet50", "batch": batch, "res": 224, "dtype": "bf16",
            "channels_last": True, "cuda_graph": False, "device": device, "options": {}, "status": status,
            "latency_ms": {"median": latency_ms, "p99": latency_ms, "cv": 0.01}, "host_overhead_us": {"median": host_us},
            "throughput_img_s": batch / latency_ms * 1e3, "run": run, **kw}


@pytest.mark.quick
def test_bound_labels_a_cell_by_its_share_of_host_time():
    assert records.bound(record(host_us=800.0, latency_ms=1.0)) == "host"  # exactly the threshold
    assert records.bound(record(host_us=790.0, latency_ms=1.0)) == "gpu"
    assert records.bound(record(host_us=100.0, latency_ms=10.0)) == "gpu"
    assert records.bound(record(device="cpu")) is None
    assert records.bound(record(status="crashed")) is None


@pytest.mark.quick
def test_an_interpreted_cell_is_labelled_and_never_ranked():
    """Triton under TRITON_INTERPRET=1 is slow and says so: its row is labelled, shows no img/s or speed-up, and
    the fastest lines and compare pass it over; a compiled cell of the same shape is ranked."""
    eager = record(latency_ms=2.0)
    fast_but_interpreted = record(tier="triton", latency_ms=1.0, interpreted=True)
    rows = columns.rows([eager, fast_but_interpreted])
    assert rows[1]["rung"] == "triton (interpreted)" and rows[1]["img/s"] == rows[1]["vs eager"] == ""
    assert "fastest eager" in derive.fastest_lines([eager, fast_but_interpreted])[0]
    assert columns.rows([eager, record(tier="triton", latency_ms=1.0)])[1]["vs eager"] == "2.00x"
    from harness.results.compare import compare as compare_runs

    verdicts = {r["rung"]: r["verdict"] for r in compare_runs([[fast_but_interpreted]], [[fast_but_interpreted]], 0.03)}
    assert verdicts == {"triton": "interpreted: not a speed"}


@pytest.mark.quick
def test_speedups_dividing_two_runs_host_bound_figures_are_marked():
    """A speed-up over eager is marked only where eager and the rung come from different runs and one of the two is
    host-bound; the same pair from one run, or two GPU-bound cells of two runs, stay unmarked."""
    cases = [  # (eager run, eager host µs, rung run, rung host µs, marked?)
        (0, 1800.0, 1, 100.0, True),  # eager host-bound, other run
        (0, 100.0, 1, 900.0, True),   # rung host-bound, other run
        (0, 100.0, 1, 100.0, False),  # both GPU-bound, other run
        (0, 1800.0, 0, 100.0, False), # one run
    ]
    for eager_run, eager_host, rung_run, rung_host, marked in cases:
        eager = record(host_us=eager_host, run=eager_run, latency_ms=2.0)
        rung = record(tier="compile", host_us=rung_host, run=rung_run, latency_ms=1.0)
        row = columns.rows([eager, rung])[1]
        assert row["vs eager"] == "2.00x" + (derive.CROSS_RUN if marked else ""), (eager_run, rung_run, row)


@pytest.mark.quick
def test_host_noise_probe_times_every_cpu_it_is_given():
    cpus = host_noise.spread_cpus(2)
    series = host_noise.measure(cpus, seconds=0.5)
    assert sorted(series) == sorted(cpus)
    summary = host_noise.summarize(series)
    assert summary["chunks"] == sum(len(s) for s in series.values()) > 0
    assert 0 < summary["p10_ms"] <= summary["median_ms"] <= summary["p90_ms"]


@pytest.mark.quick
def test_host_noise_coincidence_counts_slow_windows():
    """Two CPUs, ten 0.1 s windows of 1 ms chunks: CPU 0 runs 3x slow in windows 2-4, CPU 1 in windows 3-4 only."""
    def series(slow):
        return [(w * 0.1 + i * 0.01, 3.0 if w in slow else 1.0) for w in range(10) for i in range(10)]

    w = host_noise.coincidence({0: series({2, 3, 4}), 1: series({3, 4})})
    assert (w["windows"], w["some_cpu_slow"], w["all_cpus_slow"]) == (10, 3, 2)


@pytest.mark.quick
def test_median_confidence_interval_is_the_order_statistics_interval():
    from core.stats import median_ci_bounds, median_ci_rel

    samples = [float(v) for v in range(1, 101)]  # ranks 40 and 61 (1-based) bound the median of 100 at 95%
    assert median_ci_bounds(100) == (39, 60)
    assert median_ci_rel(samples) == pytest.approx((61 - 40) / (2 * 50.5))
    assert summarize(samples)["ci95_low"] == 40 and summarize(samples)["ci95_high"] == 61
    assert median_ci_rel([1.0, 2.0]) == float("inf")


@pytest.mark.quick
def test_failure_status_names_an_allocator_refusal_oom():
    from harness.run.failures import failure_status

    assert failure_status(1, "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "")[0] == "oom"
    assert failure_status(1, "RuntimeError: [enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't "
                             "allocate memory: you tried to allocate 1 bytes. Error code 12 (Cannot allocate memory)",
                          "")[0] == "oom"
    assert failure_status(-9, None, "", oom_killed=True) == (
        "oom", "killed by SIGKILL from the kernel's OOM killer (cgroup memory.events oom_kill grew)")
    assert failure_status(-9, None, "")[0] == "crashed"
    assert failure_status(1, "RuntimeError: deliberate", "")[0] == "error"


@pytest.mark.parametrize("model,res", [("resnet50", 224), ("resnet18", 64)])
def test_parity_on_the_ladder_weights_tells_another_input_from_rounding(model, res):
    """With the run's weights, the logits depend on the input more than on the dtype's rounding: a rung that
    computed on another input (a misread layout, a stale buffer) fails at every dtype, while the network run
    in fp16 or bf16 passes with half its tolerance to spare. With torchvision's identity batch-norm, ResNet-50's logits for two inputs were 1.5% apart,
    inside the tf32 and bf16 tolerances. fp8's tolerance alone does not tell them apart at 224 px: its parity also
    sets the output against another input's (the reference job's seed 1), and a third input fails that."""
    from core.model import build_model, make_input
    from core.parity import against_another_input

    net = build_model(model)
    x = make_input(2, res)
    with torch.no_grad():
        ref, other, wrong = net(x), net(make_input(2, res, seed=1)), net(make_input(2, res, seed=2))
        fp16 = net.to(torch.float16)(x.to(torch.float16)).float()
        bf16 = net.to(torch.bfloat16)(x.to(torch.bfloat16)).float()
    for dtype in TOLERANCES:
        assert not against_another_input(compare(wrong, ref, dtype), other, ref, dtype)["ok"], dtype
    for dtype, out in (("fp16", fp16), ("bf16", bf16)):
        verdict = compare(out, ref, dtype)
        assert verdict["ok"] and verdict["rel_err"] < TOLERANCES[dtype]["rel_err"] / 2, (dtype, verdict)
    # bf16's rounding is far nearer the reference than another input: fp8's second test would pass it
    assert against_another_input(compare(bf16, ref, "fp8"), other, ref, "fp8")["ok"]


@pytest.mark.quick
def test_speedups_dividing_two_different_gpus_are_marked():
    """A speed-up over eager is marked where eager and the rung ran on GPUs of different models, or of one model
    whose measured matmul rates differ by more than 3%; one GPU, or two alike, stay unmarked."""
    def on(uuid, name="NVIDIA H100", tflops=None):
        return {"host": "h", "gpu": {"name": name, "uuid": uuid, **({"matmul_tflops": {"bf16": tflops}}
                                                                   if tflops else {})}}

    cases = [  # (eager's GPU, the rung's GPU, marked?)
        (on("GPU-a"), on("GPU-a"), False),
        (on("GPU-a"), on("GPU-b"), False),  # same model, rates not measured: nothing says they differ
        (on("GPU-a", tflops=790), on("GPU-b", tflops=780), False),
        (on("GPU-a", tflops=790), on("GPU-b", tflops=740), True),
        (on("GPU-a"), on("GPU-b", name="NVIDIA H200"), True),
    ]
    for base_gpu, rung_gpu, marked in cases:
        eager, rung = record(latency_ms=2.0, where=base_gpu), record(tier="cudnn", latency_ms=1.0, where=rung_gpu)
        row = columns.rows([eager, rung])[1]
        assert row["vs eager"] == "2.00x" + ("‡" if marked else ""), (base_gpu, rung_gpu)
        assert ("‡ this rung and eager ran on two GPUs" in report.markdown(
            records.document([eager, rung], {"cpu": "x"}, {}))) == marked


@pytest.mark.quick
def test_the_terminal_table_tells_two_resolutions_apart():
    from rich.console import Console

    console = Console(width=80, record=True)
    console.print(report.rich_table([record(), record(res=64)]))
    header = next(line for line in console.export_text().splitlines() if line.startswith("rung"))
    assert header.split()[:3] == ["rung", "batch", "res"]
    console.print(report.rich_table([record()]))  # one resolution: the compact table keeps its 80 columns
    assert "res" not in console.export_text().splitlines()[1].split()


@pytest.mark.quick
def test_the_markdown_key_matches_the_device_and_a_merged_report_has_no_single_start():
    assert "CUDA events" in columns.how_to_read(gpu=True)
    cpu = columns.how_to_read(gpu=False)
    assert "CUDA events" not in cpu and "wall time on the host" in cpu
    env = {"started_utc": "2026-11-25T08:00:00+00:00", "cpu": "x"}
    doc = records.document([record(device="cpu")], env, {}, {"runs": [{"source": "a", "environment": env},
                                                                      {"source": "b", "environment": env}]})
    text = report.markdown(doc)
    assert "from a run started" not in text and "run 0 (started 2026-11-25T08:00:00+00:00" in text
    assert "CUDA events" not in text


@pytest.mark.quick
def test_chain_tune_writes_only_a_gain_beyond_noise():
    """bench/chain_tune.py's rounds as the H100 measured them (per graph replay, us, alternating): fp8 at batch 256
    is 7% faster and is written; tf32 at batch 256 is 0.3% faster by its medians with its rounds overlapping, and
    is not (`compare`'s rule: more than the threshold, the bootstrap interval excluding no change)."""
    from bench.chain_tune import faster_beyond_noise

    fp8 = ([7457, 7511, 7516, 7508, 7500, 7511, 7506], [6926, 6913, 6907, 6984, 6967, 6976, 6965])
    tf32 = ([14529, 15061, 15158, 14998, 14776, 14836, 14932], [14958, 14581, 14611, 14886, 15002, 14911, 14771])
    assert faster_beyond_noise(*fp8, 0.01)[0]
    assert not faster_beyond_noise(*tf32, 0.01)[0]
    assert not faster_beyond_noise(*fp8, 0.10)[0]  # 7% is not the 10% asked for
    assert not faster_beyond_noise(fp8[1], fp8[0], 0.01)[0]  # slower


@pytest.mark.quick
def test_chain_tune_names_each_changed_key_with_its_time_before_and_after():
    """Each changed key's line: the table entry's own time in the chain, the chosen one's (medians over the layers
    that share the key), and the chosen configuration; a key whose table entry was not timed says so."""
    from bench.chain_tune import changes

    entry = {"kwargs": {"BLOCK_M": 128, "BLOCK_N": 64}, "num_warps": 4, "num_stages": 3}
    candidate = json.dumps(entry, sort_keys=True)  # how chain_tune names a candidate in its scores
    scores = {"k1": {candidate: [10.0, 12.0, 30.0]}, "k2": {candidate: [5.0]}}
    lines = changes({"k2": entry, "k1": entry}, scores, {"k1": [14.0, 16.0]})
    assert lines == ["k1: 15.0 -> 12.0 us (BLOCK_M=128 BLOCK_N=64 warps=4 stages=3)",
                     "k2: ? -> 5.0 us (BLOCK_M=128 BLOCK_N=64 warps=4 stages=3)"]


@pytest.mark.quick
def test_chain_tune_leaves_the_keys_another_dtype_shares():
    """fp8's stem and classifier run bf16 on the very keys of the bf16 cell: tuning fp8's chain must not choose
    for them (keys as the H100 table holds them: kernel|shape|tensor dtypes, the weights second)."""
    from bench.chain_tune import own_keys

    shape = "conv2d_nhwc_kernel|49,7,7,512,2048,1,1,1,tf32,0,0,none|"
    tail = ",float32,float32,{y},{y},float32,float32"  # the statistics' pointers (conv._conv2d: y's type where unused)
    e4m3 = shape + "float8_e4m3fn,float8_e4m3fn,float32,bfloat16,bfloat16,float32,float32,int32" + tail.format(
        y="bfloat16")
    e4m3_from_bf16 = shape + "bfloat16,float8_e4m3fn,float32,float8_e4m3fn,float8_e4m3fn,float32,float32,int32" + \
        tail.format(y="float8_e4m3fn")
    bf16 = shape + "bfloat16,bfloat16,float32,bfloat16,bfloat16,float32,float32,int32" + tail.format(y="bfloat16")
    assert own_keys([e4m3, e4m3_from_bf16, bf16], "fp8") == [e4m3, e4m3_from_bf16]
    assert own_keys([e4m3, e4m3_from_bf16, bf16], "bf16") == [bf16]


@pytest.mark.quick
def test_option_ab_takes_two_values_the_rung_accepts():
    from bench.option_ab import parse_option

    assert parse_option("pairs=off,auto") == ("pairs", "off", "auto")
    for bad in ("pairs=off,maybe", "pairs=off", "colour=red,blue"):
        with pytest.raises(SystemExit, match="two of the triton rung's values"):
            parse_option(bad)


@pytest.mark.quick
def test_energy_is_read_over_seconds_and_withheld_where_it_cannot_be_right():
    """The energy window's update period and error from the counter's own steps; img/J from the average power, and
    withheld (with its reason) for a window under a second or an average above the board's limit."""
    from harness.run.record import per_joule
    from harness.run.sampler import energy

    samples = [{"t": i * 0.02, "energy_mj": 1000 * (i // 5)} for i in range(101)]  # 2 s; the counter moves every 0.1 s
    window = {**energy(samples), "power_limit_w": 700.0}
    assert window["energy_window_s"] == pytest.approx(2.0) and window["energy_update_s"] == pytest.approx(0.1)
    assert window["energy_rel_err"] == pytest.approx(0.05) and window["average_power_w"] == pytest.approx(10.0)
    assert per_joule(window, 1000.0) == {"img_per_joule": pytest.approx(100.0)}
    over = per_joule({**window, "power_limit_w": 5.0}, 1000.0)
    assert over["img_per_joule"] is None and "above the board's 5 W limit" in over["energy_withheld"]
    short = per_joule({**energy(samples[:20]), "power_limit_w": 700.0}, 1000.0)
    assert short["img_per_joule"] is None and "shorter than the 1 s" in short["energy_withheld"]


@pytest.mark.quick
def test_a_cell_timed_at_a_held_clock_is_flagged_with_the_reason_nvml_gave():
    from harness.results.derive import clock_lines
    from harness.run.record import clocks_while_timed
    from harness.run.sampler import clocks

    readings = [{"sm_mhz": 1620, "mem_mhz": 3201, "power_w": 699.0, "reasons": 0x4} for _ in range(8)]
    readings += [{"sm_mhz": 1980, "mem_mhz": 3201, "power_w": 600.0, "reasons": 0} for _ in range(2)]
    held = clocks_while_timed({**clocks(readings), "sm_clock_max_mhz": 1980})
    assert held["slow"] and held["sm_clock_mhz_median"] == 1620 and held["held_by"] == {"power cap": 0.8}
    assert held["held_by_most"] == "power cap" and held["power_w_max"] == 699.0
    free = clocks_while_timed({**clocks(readings[-2:]), "sm_clock_max_mhz": 1980})
    assert not free["slow"] and free["held_by_most"] is None
    record = {"status": "ok", "label": "triton", "batch": 256, "dtype": "bf16", "clocks": held}
    (line,) = clock_lines([record, {**record, "label": "eager", "clocks": free}])
    assert "1 of 2 cells ran with the SM clock below 95% of its 1980 MHz maximum" in line
    assert "triton b256 bf16 1620 (power cap)" in line


@pytest.mark.quick
def test_a_sustained_cell_is_its_last_seconds_after_the_load_and_only_big_gpu_cells_sustain():
    from core.cell import Cell
    from harness.child.contract import SUSTAIN_WINDOW_S, Protocol
    from harness.run.record import sustained

    # 12 s of marks, every 0.25 s: 400 calls/s for 10 s, then 300 (a clock that fell)
    marks = [[t, 400 * t if t <= 10 else 4000 + 300 * (t - 10)] for t in (i / 4 for i in range(49))]
    window = {"energy_j": 1200.0, "energy_window_s": 2.0, "average_power_w": 600.0, "power_limit_w": 700.0}
    figures = sustained(window, {"marks": marks}, batch=2)
    assert figures["window_s"] == pytest.approx(SUSTAIN_WINDOW_S) and figures["after_s"] == pytest.approx(10.0)
    assert figures["throughput_img_s"] == pytest.approx(600.0) and figures["img_per_joule"] == pytest.approx(1.0)
    assert "error" in sustained(None, {"marks": marks}, batch=2)

    protocol = Protocol(sustain_s=10, sustain_batch=256)
    util_s = lambda cell: float(dict(zip(*[iter(protocol.args(cell))] * 2))["--util-s"])  # noqa: E731
    assert util_s(Cell(tier="eager", batch=256, device="cuda")) == 10 + SUSTAIN_WINDOW_S
    small, cpu = Cell(tier="eager", batch=32, device="cuda"), Cell(tier="eager", batch=256, device="cpu")
    assert util_s(small) == util_s(cpu) == protocol.util_s
    assert "--sustain-s" not in protocol.args(Cell(tier="eager"))
