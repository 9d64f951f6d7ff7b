"""The LibTorch rungs (cpp/libtorch, tiers/libtorch.py), for real: build the C++ project once (into LADDER_CACHE),
run both binaries through the whole child contract on the CPU at a small size, compare with eager PyTorch."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from core.model import build_model, make_input, read_tensor, write_input, write_weights
from harness.child.contract import PHASES, RESULT_KEYS, Protocol, contract_argv
from core.cell import Cell
from tiers.libtorch import TIERS

from training_on_data import BATCH, check_training_on_data

# The contract's options at a size that keeps each run to seconds on a small CPU.
TINY = Protocol(warmup_min=1, warmup_max=2, warmup_s=0.01, iters=2, min_time_s=0.01, max_iters=3, precision=1e-9, pipelined_iters=2,
                e2e_iters=1, util_s=0.01)
LIBTORCH, TORCHSCRIPT_CPP = TIERS

pytestmark = pytest.mark.skipif(LIBTORCH.availability("cpu") is not None,
                                reason=str(LIBTORCH.availability("cpu")))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("libtorch")
    model = build_model("resnet50")
    write_weights(model, d / "resnet50.safetensors")
    write_weights(build_model("resnet18"), d / "resnet18.safetensors")
    x = make_input(2, 64)
    write_input(x, d / "input.safetensors")
    with torch.no_grad():
        torch.save(model(x), d / "reference.pt")
    return {"dir": d, "input": d / "input.safetensors", "reference": d / "reference.pt",
            "resnet50": d / "resnet50.safetensors", "resnet18": d / "resnet18.safetensors"}


@pytest.fixture(scope="module")
def programs() -> dict[str, list[str]]:
    """Both executables, built once into LADDER_CACHE and reused by later runs (the first build takes minutes)."""
    return {t.name: t.command(Cell(tier=t.name, device="cpu")) for t in TIERS}


def run_child(program: list[str], cell: Cell, files: dict[str, Path], weights: Path | None = None,
              options: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, Path]:
    out = files["dir"] / cell.tier
    out.mkdir(exist_ok=True)
    cell = dataclasses.replace(cell, options=tuple((options or {}).items()))
    argv = contract_argv(program, cell, {"weights": weights or files["resnet50"], "input": files["input"],
                                         "output": out / "output.safetensors", "result": out / "result.json"}, TINY)
    # One thread: the test machine's cores may be busy, and two spinning OpenMP threads then cost 50x.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600), out


def check_contract(proc: subprocess.CompletedProcess, out: Path, files: dict[str, Path]) -> dict:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    phases = [line[8:] for line in proc.stdout.splitlines() if line.startswith("@@phase ")]
    assert phases == list(PHASES)
    result = json.loads((out / "result.json").read_text())
    assert set(result) == RESULT_KEYS
    assert len(result["latency"]["samples_ms"]) >= TINY.iters
    assert result["memory"]["allocator_peak_bytes"] is None  # the CPU has no caching-allocator figures
    logits, reference = read_tensor(out / "output.safetensors", "output"), torch.load(files["reference"])
    assert logits.shape == reference.shape == (2, 1000)
    assert torch.allclose(logits, reference, rtol=1e-4, atol=1e-4), (logits - reference).abs().max()
    assert torch.equal(logits.argmax(1), reference.argmax(1))
    return result


@pytest.mark.parametrize("channels_last", [False, True])
def test_libtorch_matches_eager(programs, files, channels_last):
    cell = Cell(tier="libtorch", batch=2, res=64, device="cpu", channels_last=channels_last)
    result = check_contract(*run_child(programs["libtorch"], cell, files), files)
    assert result["build_stats"]["parameters"] == sum(p.numel() for p in build_model("resnet50").parameters())


def test_torchscript_cpp_matches_eager(programs, files):
    cell = Cell(tier="torchscript-cpp", batch=2, res=64, device="cpu")
    options = TORCHSCRIPT_CPP.prepare(cell, files["resnet50"], files["dir"], files["dir"])
    assert Path(options["ts-path"]).is_file()
    result = check_contract(*run_child(programs["torchscript-cpp"], cell, files, options=options), files)
    assert result["build_stats"]["parent_export_s"] == float(options["export-s"])


@pytest.mark.parametrize("tier, weights, cuda_graph, message", [
    ("libtorch", "resnet18", False, "weights file does not match resnet50: missing"),
    ("torchscript-cpp", "resnet50", False, "needs --option ts-path"),
    ("libtorch", "resnet50", True, "CUDA graphs need --device cuda"),
])
def test_clear_errors(programs, files, tier, weights, cuda_graph, message):
    cell = Cell(tier=tier, batch=2, res=64, device="cpu", cuda_graph=cuda_graph)
    proc, _ = run_child(programs[tier], cell, files, weights=files[weights])
    assert proc.returncode != 0
    errors = [line for line in proc.stdout.splitlines() if line.startswith("@@error ")]
    assert len(errors) == 1 and message in errors[0], proc.stdout + proc.stderr


def test_both_protocol_implementations_mean_the_same(programs, files):
    """The Python worker (eager) and the C++ driver (libtorch) on one tiny cell under one protocol: the same phases,
    the same result keys, and the same rules behind the figures (why the latency pass stopped, how many pipelined
    calls, how many end-to-end samples of each kind)."""
    import math
    import sys

    results = {}
    python_child = [sys.executable, "-m", "harness.child.worker"]
    for tier, program in (("eager", python_child), ("libtorch", programs["libtorch"])):
        proc, out = run_child(program, Cell(tier=tier, batch=2, res=64, device="cpu"), files)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert [line[8:] for line in proc.stdout.splitlines() if line.startswith("@@phase ")] == list(PHASES)
        results[tier] = json.loads((out / "result.json").read_text())
    py, cpp = results["eager"], results["libtorch"]
    assert set(py) == set(cpp) == RESULT_KEYS
    for key in ("cold", "latency", "host", "pipelined", "e2e", "warmup", "util"):
        assert set(py[key]) == set(cpp[key]), key
    assert set(py["memory"]) >= {"allocator_peak_bytes", "allocator_reserved_peak_bytes"} <= set(cpp["memory"])
    for r in (py, cpp):
        lat = r["latency"]["samples_ms"]
        assert r["latency"]["stopped"] == "iters" and len(lat) == TINY.max_iters  # CI never within 1% in 3 calls
        assert len(r["host"]["samples_us"]) == len(lat)
        median = sorted(lat)[len(lat) // 2]
        assert r["pipelined"]["iters"] == max(TINY.pipelined_iters, math.ceil(TINY.pipelined_s * 1e3 / median))
        assert all(v == [] for v in r["e2e"].values())  # skipped on the CPU by both
        assert r["warmup"]["iters"] == TINY.warmup_min  # --warmup-s elapsed during the first call
        marks = r["util"]["marks"]  # a sustained cell's window is read from them (harness/run/record.py sustained)
        assert marks[0] == [0, 0] and marks[-1][1] == r["util"]["iters"] > 0
        assert marks[-1][0] == pytest.approx(r["util"]["seconds"], abs=1e-3)


def test_census_pass_is_the_same_in_both_protocol_implementations(programs, files):
    """With --census-steps, both drivers add the census phase after util, outside every timing, and write a trace
    the one parser reads: eager's layers by its module scopes, libtorch's by its convolutions in order."""
    import sys

    from core.layers import convolutions
    from harness.child.contract import CENSUS_KEYS
    from harness.run import census

    traced = dataclasses.replace(TINY, census_steps=2)
    for tier, program, basis in (("eager", [sys.executable, "-m", "harness.child.worker"], "module scopes"),
                                 ("libtorch", programs["libtorch"], "convolutions in order")):
        out = files["dir"] / f"census-{tier}"
        out.mkdir(exist_ok=True)
        argv = contract_argv(program, Cell(tier=tier, batch=2, res=64, device="cpu"), {
            "weights": files["resnet50"], "input": files["input"], "output": out / "output.safetensors",
            "result": out / "result.json", "census": out / "trace.json"}, traced)
        proc = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                              timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        phases = [line[8:] for line in proc.stdout.splitlines() if line.startswith("@@phase ")]
        assert phases == [*PHASES[:PHASES.index("util") + 1], "census", *PHASES[PHASES.index("after"):]]
        result = json.loads((out / "result.json").read_text())
        assert set(result) == RESULT_KEYS | {"census"} and set(result["census"]) == CENSUS_KEYS
        summary = census.summarise(census.load(out / "trace.json"), convolutions("resnet50"), None, 2, False)
        assert summary["steps"] == 2 and summary["attribution"][basis] > 0.3, summary["attribution"]
        assert {g["group"] for g in summary["groups"]} >= {"stem", "layer1", "layer4"}


def test_training_on_data_takes_the_batches_given_and_matches_eager(programs, tmp_path):
    """train-to-accuracy's contract (--train-data, --states) on the libtorch program: each epoch's state is eager's
    after the same batches at the same rates (tests/training_on_data.py)."""
    torch.manual_seed(0)
    initial = build_model("resnet18")
    initial.fc = torch.nn.Linear(512, 10)
    cell = Cell(tier="libtorch", model="resnet18", batch=BATCH, res=32, device="cpu", task="train")
    check_training_on_data(programs["libtorch"], initial, cell, TINY, tmp_path)


def test_host_rss_is_the_childs_own_peak(programs, files):
    """Both protocol implementations report their own process's peak resident memory, not the parent's: this
    process first holds 3 GiB more than either child ever does (getrusage's ru_maxrss would carry it over fork and
    exec into both children's figures)."""
    import sys

    from harness.child.worker import peak_rss_bytes

    ballast = bytearray(3 << 30)  # zero-filled, so resident
    parent_peak = peak_rss_bytes()
    python_child = [sys.executable, "-m", "harness.child.worker"]
    for tier, program in (("eager", python_child), ("libtorch", programs["libtorch"])):
        proc, out = run_child(program, Cell(tier=tier, batch=2, res=64, device="cpu"), files)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        rss = json.loads((out / "result.json").read_text())["rss_peak_bytes"]
        assert 50 << 20 < rss < parent_peak - (2 << 30), (tier, rss, parent_peak)
    del ballast
