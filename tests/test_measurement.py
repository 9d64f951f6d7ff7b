"""The protocol's statistics and the parity verdicts, on real numbers."""
import json
import statistics

import numpy as np
import pytest
import torch

from harness import host_noise, report
from harness.parity import TOLERANCES, compare
from harness.stats import summarize
from tests.conftest import REPO


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


@pytest.mark.parametrize("dtype", list(TOLERANCES))
def test_parity_accepts_rounding_of_the_dtype(dtype):
    ref = logits()
    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(dtype, torch.float32)
    out = ref.to(torch_dtype).float()
    assert compare(out, ref, dtype)["ok"]


def test_parity_rejects_a_different_function():
    ref = logits()
    out = ref.clone()
    out[:, 0] += 5.0  # one class shifted: the kind of error a missing bias produces
    verdict = compare(out, ref, "bf16")
    assert not verdict["ok"] and "rel err" in verdict["reason"]


def test_parity_rejects_nan_and_wrong_shape():
    ref = logits()
    out = ref.clone()
    out[3, 7] = float("nan")
    assert not compare(out, ref, "fp32")["ok"]
    assert not compare(ref[:, :10], ref, "fp32")["ok"]


def test_top1_checked_on_decisive_rows_only():
    ref = logits(batch=4)
    ref[0, 0] = ref[0].max() + 50  # a decisive row
    out = ref.clone()
    out[0, 0] = ref[0, 1] - 1  # flips the decisive row's top-1
    verdict = compare(out, ref, "bf16")
    assert not verdict["ok"] and verdict["top1_agreement_decisive"] < 1


def test_bound_tells_host_bound_from_gpu_bound_cells_of_the_committed_h100_run():
    """On real H100 records: a CUDA-graph replay issues one launch, so it is GPU-bound at every batch; eager at
    batch 1 issues ~170 kernels from Python and the GPU waits on it; CPU cells get no label."""
    doc = json.loads((REPO / "results" / "nvidia-h100-80gb-hbm3" / "ladder.json").read_text())
    ok = [r for r in doc["results"] if r["status"] == "ok"]
    assert all(report.bound(r) == "gpu" for r in ok if r["cuda_graph"])
    eager_b1 = [r for r in ok if r["tier"] == "eager" and r["batch"] == 1 and not r["cuda_graph"]]
    assert eager_b1 and all(report.bound(r) == "host" for r in eager_b1)
    assert {report.bound(r) for r in ok if r["batch"] == 256 and r["dtype"] == "fp32"} == {"gpu"}
    assert report.bound({**ok[0], "device": "cpu"}) is None
    assert all(r["bound"] == report.bound(r) for r in report.document(ok, {}, {})["results"])


def test_speedups_dividing_two_runs_host_bound_figures_are_marked():
    """In the committed merged H100 report, eager b1 comes from one lease and most other rungs' b1 cells from
    others: such a ratio divides two draws of the host's speed, and the tables say so; GPU-bound pairs from two
    runs, and pairs from one run, stay unmarked."""
    doc = json.loads((REPO / "results" / "nvidia-h100-80gb-hbm3" / "ladder.json").read_text())
    results, kinds = doc["results"], set()
    for r, row in zip(results, report.rows(results)):
        if row["vs eager"]:
            base = report.eager_baseline(results, r)
            cross, host = base["run"] != r["run"], "host" in (base["bound"], r["bound"])
            assert row["vs eager"].endswith(report.CROSS_RUN) == (cross and host), row
            kinds.add((cross, host))
    assert {(True, True), (True, False), (False, True)} <= kinds
    assert f"\n{report.CROSS_RUN} this rung and eager come from different runs" in report.markdown(doc)


def test_host_noise_probe_times_every_cpu_it_is_given():
    cpus = host_noise.spread_cpus(2)
    series = host_noise.measure(cpus, seconds=0.5)
    assert sorted(series) == sorted(cpus)
    summary = host_noise.summarize(series)
    assert summary["chunks"] == sum(len(s) for s in series.values()) > 0
    assert 0 < summary["p10_ms"] <= summary["median_ms"] <= summary["p90_ms"]
    w = host_noise.coincidence(series)
    assert w["all_cpus_slow"] <= w["some_cpu_slow"] <= w["windows"]


def test_host_resource_kernels_measure_what_they_claim(tmp_path):
    """The kernels of bench/host_resources.py, built and run: the multiply chain gives a plausible clock, the wide
    adds run several a cycle (they fill the ALU ports), and a walk through 64 MiB is slower a load than one
    through 512 KiB (it leaves the private cache)."""
    hr = pytest.importorskip("bench.host_resources")
    kernels = hr.load_kernels(str(tmp_path))
    s = hr.summarize(hr.measure(kernels, seconds=0.5))
    ghz = s["clock_ghz"]["median"]
    assert 0.5 < ghz < 7
    adds_per_cycle = 16 * hr.ALU_ROUNDS / (s["alu"]["median_ms"] * 1e-3 * ghz * 1e9)
    assert adds_per_cycle > 2
    assert s["l3"]["median_ms"] / hr.L3_LOADS > 2 * s["l2"]["median_ms"] / hr.L2_LOADS
