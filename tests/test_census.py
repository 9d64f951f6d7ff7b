"""The kernel census (harness/run/census.py) and `micro --tiers`: real rungs profiled on the CPU (torch.profiler and
ONNX Runtime's own profiler in Python, libtorch's profiler in a real C++ build), and the parser's GPU path on a
trace in Kineto's CUDA format."""
import json
import subprocess
import sys

import pytest

from core.flops import flops_per_group
from core.layers import convolutions, distinct_layers, group_of
from harness.layers_report import layer_display, layer_rows
from harness.run import census
from tests.conftest import FAST, REPO
from tests.test_reports import ENV80

RUNGS = ("eager", "torchscript", "compile", "onnxruntime")  # libtorch's census: tests/test_libtorch.py


@pytest.fixture(scope="module")
def side_by_side(tmp_path_factory):
    out = tmp_path_factory.mktemp("micro")
    proc = subprocess.run([sys.executable, "-m", "harness", "micro", "--tiers", ",".join(RUNGS), "--device", "cpu",
                           "--model", "resnet18", "--res", "32", "--batch", "2", "--census-steps", "2", "--out",
                           str(out), *FAST], cwd=REPO, env=ENV80, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout, json.loads((out / "census.json").read_text())


def test_every_rung_has_a_census_by_layer_group(side_by_side):
    _, stdout, doc = side_by_side
    by_rung = {r["label"].split("(")[0]: r for r in doc["census"]}
    assert set(by_rung) == set(RUNGS), doc.get("missing")
    for name, r in by_rung.items():
        groups = {g["group"] for g in r["groups"]}
        assert {"stem", "layer1", "layer2", "layer3", "layer4"} <= groups, (name, groups)
        assert r["steps"] == 2 and r["kernels_per_step"] > 0
        # the parts add up: groups and layers to the kernels' time, the shares to one
        assert sum(g["ms"] for g in r["groups"]) == pytest.approx(r["kernel_ms"], rel=1e-6)
        assert sum(x["ms"] for x in r["layers"]) == pytest.approx(r["kernel_ms"], rel=1e-6)
        assert sum(k["share"] for k in r["kernels"]) == pytest.approx(1.0, rel=1e-6)
        assert sum(r["attribution"].values()) == pytest.approx(1.0, rel=1e-6)
        assert r["busy_ms"] <= r["wall_ms"] * 1.001 and r["measured_ms"] > 0 and r["pipelined_ms"] > 0
        assert r["kernels_over_pipelined"] == pytest.approx(r["kernel_ms"] / r["pipelined_ms"])
        assert all(g["floor_gbs"] > 0 and g["tflops"] > 0 for g in r["groups"] if g["group"].startswith("layer"))
    # each rung's layers by its own means: module scopes, TorchScript's hierarchy, the convolutions matched in
    # order (compile and libtorch), ONNX Runtime's node names
    assert by_rung["eager"]["attribution"]["module scopes"] > 0.95
    assert by_rung["torchscript"]["attribution"].get("module hierarchy", 0) > 0
    assert by_rung["onnxruntime"]["attribution"]["ONNX node names"] > 0.9
    assert by_rung["compile"]["attribution"]["convolutions in order"] > 0.3, by_rung["compile"]["attribution"]
    conv = next(k for k in by_rung["compile"]["kernels"] if k["name"] == "aten::mkldnn_convolution")
    assert conv["launches"] == len(convolutions("resnet18")) and "unattributed" not in conv["groups"]
    assert "stem" in stdout and "fastest" in stdout


def test_census_files_read_in_100_columns_and_the_plot_is_drawn(side_by_side):
    out, _, doc = side_by_side
    md = (out / "census.md").read_text()
    assert max(map(len, md.splitlines())) <= 100
    assert "| kern/measured |" in md and "| kern/pipelined |" in md
    assert "![where each rung's time goes](census.png)" in md and (out / "census.png").stat().st_size > 10_000
    assert all(f"## {r['label']}: its kernels, costliest first" in md for r in doc["census"])
    for r in doc["census"]:  # every kernel in the JSON, and the trace kept for a deeper look
        assert (out / r["trace"]).is_file() and len(r["kernels"]) >= 5


def test_the_fastest_rung_per_group_is_the_one_with_least_time(side_by_side):
    _, _, doc = side_by_side
    ranked = {r["label"] for r in doc["census"] if census.comparable(r)}
    assert {"eager", "onnxruntime"} <= ranked  # module scopes and node names place nearly all of their time
    assert len(doc["partial"]) == len(doc["census"]) - len(ranked)  # the others say why they are not ranked
    for row in doc["groups"]:
        if "fastest" in row:
            times = {k: v["ms"] for k, v in row["rungs"].items() if k in ranked}
            assert row["fastest"] == min(times, key=times.get)
            assert row["lead"] == pytest.approx(sorted(times.values())[1] / min(times.values()))


def test_a_rung_whose_time_is_mostly_in_no_layer_is_shown_but_never_ranked(side_by_side, tmp_path):
    """As ONNX Runtime's fp16 census on the H100 was (73% unattributed: its NHWC pass renamed the convolutions):
    its groups then hold only its elementwise kernels, which must not read as the fastest layers. The census file
    is re-rendered by `report`, as a reader would."""
    _, _, doc = side_by_side
    ort = next(r for r in doc["census"] if r["label"] == "onnxruntime")
    ort["attribution"] = {"ONNX node names": 0.27, "unattributed": 0.73}
    for g in ort["groups"]:
        g["ms"] /= 100  # what is left of each group once its convolutions are in no layer
    path = tmp_path / "census.json"
    path.write_text(json.dumps(doc))
    proc = subprocess.run([sys.executable, "-m", "harness", "report", str(path)], cwd=REPO, env=ENV80,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    again = json.loads(path.read_text())
    # a hundredth of its time in each group would have made it the fastest everywhere
    assert all(row.get("fastest") != "onnxruntime" for row in again["groups"])
    assert ("onnxruntime: 73% of its kernel time is in no known layer, so its groups are shown (marked *) but not "
            "ranked") in again["partial"]
    md = (tmp_path / "census.md").read_text()
    assert "onnxruntime: 73% of its kernel time" in md and "*" in md and (tmp_path / "census.png").is_file()


def test_training_step_census_names_backward_and_optimizer(tmp_path):
    """A training step's census through the worker's contract: backward kernels by their forward's layer, the
    optimizer's and the loss's apart."""
    from core.cell import Cell
    from core.model import build_model, make_input, write_input, write_weights
    from harness.child.contract import Protocol, contract_argv

    write_weights(build_model("resnet18"), tmp_path / "w.safetensors")
    write_input(make_input(2, 32), tmp_path / "x.safetensors")
    tiny = Protocol(warmup_min=1, warmup_max=1, warmup_s=0, iters=1, min_time_s=0, max_iters=1, pipelined_iters=1,
                    pipelined_s=0, e2e_iters=1, util_s=0, census_steps=1)
    argv = contract_argv([sys.executable, "-m", "harness.child.worker"], Cell(
        tier="eager", model="resnet18", batch=2, res=32, device="cpu", task="train"), {
        "weights": tmp_path / "w.safetensors", "input": tmp_path / "x.safetensors",
        "output": tmp_path / "out.safetensors", "result": tmp_path / "result.json",
        "census": tmp_path / "trace.json"}, tiny)
    proc = subprocess.run(argv, cwd=REPO, env=ENV80, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = census.summarise(census.load(tmp_path / "trace.json"), convolutions("resnet18"),
                         flops_per_group("resnet18", 32), 2, True)
    phases = {x["phase"] for x in r["layers"]}
    assert phases == {"forward", "backward", "optimizer"}
    # backward operators by their forward's layer: every convolution's, and a real share of the time (0.42 on an
    # idle CPU, 0.23 beside another test run: a share of time on a shared CPU is no sharper than that)
    backward = {x["layer"] for x in r["layers"] if x["phase"] == "backward"}
    assert {c.path for c in convolutions("resnet18")} <= backward, backward
    assert r["attribution"]["autograd (module scopes)"] > 0.1
    groups = {g["group"]: g for g in r["groups"]}
    assert {"optimizer", "loss", "layer3"} <= set(groups) and groups["layer3"]["tflops"] > 0


@pytest.mark.parametrize("argv, message", [
    (["micro"], "give --tier NAME"),
    (["micro", "--tiers", "eager", "--batch", "1,2"], "--batch: micro measures one configuration"),
    (["micro", "--tiers", "eager", "--layout", "both"], "--layout: micro measures one layout"),
])
def test_micro_refuses_in_one_line(argv, message):
    proc = subprocess.run([sys.executable, "-m", "harness", *argv], cwd=REPO, env=ENV80, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr


def kineto_gpu_trace() -> list[dict]:
    """Two steps of a trace in Kineto's CUDA format: in each, the stem's convolution (a cuDNN kernel launched from
    aten::convolution inside the stem's scope) and a fused kernel of no scope after layer1.0.conv1, on a side
    thread's launch; in the second step, the fused kernel runs on a stream of its own, overlapping the convolution
    (busy < their sum)."""
    events = []
    stem, l1 = convolutions("resnet18")[0], convolutions("resnet18")[1]

    def host(name, ts, dur, cat="cpu_op", **args):
        events.append({"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur,
                       "args": args})

    for step, t0 in enumerate((1000.0, 2000.0)):
        host("census:step", t0, 500, cat="user_annotation")
        host("aten::convolution", t0 + 10, 50, **{"Input Dims": [[2, 3, 32, 32], list(stem.weight)]})
        host("aten::convolution", t0 + 70, 40, **{"Input Dims": [[2, 64, 8, 8], list(l1.weight)]})
        for corr, at, ts, dur, name in ((10 * step + 1, t0 + 20, t0 + 100, 80, "sm90_xmma_fprop_cudnn"),
                                        (10 * step + 2, t0 + 80, t0 + 190, 40, "sm90_xmma_fprop_cudnn"),
                                        (10 * step + 3, t0 + 120, t0 + (200 if step else 240), 60,
                                         "triton_poi_fused_relu_0")):
            events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                           "ts": at, "dur": 5, "args": {"correlation": corr}})
            stream = 8 if step and name.startswith("triton") else 7
            events.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
                           "args": {"correlation": corr}})
    return events


@pytest.mark.quick
def test_gpu_trace_kernels_are_attributed_through_their_launches():
    c = census.summarise(kineto_gpu_trace(), convolutions("resnet18"), flops_per_group("resnet18", 32), 2, False)
    assert c["unit"] == "GPU kernels" and c["steps"] == 2 and c["kernels_per_step"] == 3
    assert c["kernel_ms"] == pytest.approx(0.18)  # 80 + 40 + 60 µs
    assert c["busy_ms"] == pytest.approx((0.18 + 0.15) / 2)  # the second step's last two overlap by 30 µs
    assert c["wall_ms"] == pytest.approx(0.5)
    layers = {x["layer"]: x for x in c["layers"]}
    assert layers["conv1"]["basis"] == "convolutions in order" and group_of("conv1") == "stem"
    assert layers["layer1.0"]["basis"] == "after a convolution"  # the fused kernel: its block, never split
    (conv,) = [k for k in c["kernels"] if k["name"].startswith("sm90")]
    assert conv["launches"] == 2 and conv["median_us"] == 60 and conv["groups"] == ["layer1", "stem"]


@pytest.mark.quick
def test_a_dependent_launch_owns_its_time_from_the_end_of_the_kernel_before_it():
    """On one stream, a kernel that starts before the one before it ends (a programmatic dependent launch, waiting)
    counts from that end: kernel time is the busy time, not the overlapping durations' sum."""
    events = kineto_gpu_trace()
    for e in events:
        if e.get("cat") == "kernel":
            e["tid"] = 7
    c = census.summarise(events, convolutions("resnet18"), flops_per_group("resnet18", 32), 2, False)
    assert c["kernel_ms"] == pytest.approx((0.18 + 0.15) / 2) == pytest.approx(c["busy_ms"])
    layers = {x["layer"]: x for x in c["layers"]}
    assert layers["layer1.0"]["ms"] == pytest.approx((0.06 + 0.03) / 2)  # the second step's 30 µs wait left out


@pytest.mark.quick
def test_a_trace_without_steps_is_refused():
    with pytest.raises(ValueError, match="census:step"):
        census.summarise([e for e in kineto_gpu_trace() if e["name"] != "census:step"], convolutions("resnet18"),
                         None, 2, False)


def test_triton_launches_are_named_by_layer_only_inside_the_census_scopes():
    import torch
    import torchvision
    from torch.profiler import ProfilerActivity, profile

    from core.layers import SCOPE
    from kernels.triton.resnet import TritonResNet

    net = TritonResNet(torchvision.models.resnet18().eval(), torch.float32, "cpu", tune=False)
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as plain:
        expected = net(x)
    with torch.no_grad(), net.layer_scopes(SCOPE), profile(activities=[ProfilerActivity.CPU]) as named:
        out = net(x)
    scopes = [e.name.removeprefix(SCOPE) for e in named.events() if e.name.startswith(SCOPE)]
    assert scopes[:2] == ["conv1+maxpool", "layer1.0.conv1"] and scopes[-2:] == ["avgpool", "fc"]
    # a fused launch names each module it computes: "layer2.0.conv2+downsample.0"
    named = {f"{block}.{part}" if i else part for scope in scopes
             for block in [scope.split("+")[0].rsplit(".", 1)[0]] for i, part in enumerate(scope.split("+"))}
    assert "layer2.0.conv2+downsample.0" in scopes  # the downsample fused into the block's last convolution
    assert {c.path for c in convolutions("resnet18")} <= named and torch.equal(out, expected)
    assert not any(e.name.startswith(SCOPE) for e in plain.events())


def test_each_layer_alone_on_each_rung_with_parity(tmp_path):
    """micro --layers: every distinct layer of the network built alone by each Python rung, checked against eager
    fp32; a rung computing the wrong function fails every layer (exit status 1); a C++ rung says why it has none.
    Batch 3: ONNX Runtime's export traces a batch of 2, which a layer adding its residual of the cell's batch must
    not get (on the H100 at batch 256 every such layer failed to export)."""
    env = {**ENV80, "LADDER_EXTRA_TIERS": "tests.failing_tiers"}
    proc = subprocess.run([sys.executable, "-m", "harness", "micro", "--layers", "--tiers",
                           "eager,onnxruntime,test-wrong,libtorch", "--device", "cpu", "--model", "resnet18", "--res",
                           "32", "--batch", "3", "--reps", "3", "--out", str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "layers.json").read_text())
    assert [r["layer"] for r in doc["layers"]][:2] == ["conv1", "layer1.0.conv1"]
    assert sum(r["count"] for r in doc["layers"]) == len(convolutions("resnet18"))
    for row in doc["layers"]:
        assert row["rungs"]["eager"]["parity"]["ok"] and row["rungs"]["onnxruntime"]["parity"]["ok"], row
        assert not row["rungs"]["test-wrong"]["parity"]["ok"] and row.get("fastest") != "test-wrong"
        assert len(row["rungs"]["eager"]["samples_ms"]) == 3 and row["floor"] is None  # no GPU: no roofline
    assert any(line.startswith("libtorch: a program of the whole network") for line in doc["missing"])
    md = (tmp_path / "layers.md").read_text()
    assert max(map(len, md.splitlines())) <= 100 and "FAIL" in md


def test_a_rung_that_refuses_the_cell_says_why_instead_of_failing_each_layer(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "harness", "micro", "--layers", "--tiers", "onnxruntime", "--device",
                           "cpu", "--dtype", "bf16", "--model", "resnet18", "--res", "32", "--batch", "2", "--out",
                           str(tmp_path)], cwd=REPO, env=ENV80, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "layers.json").read_text())
    [line] = doc["missing"]  # the rung's own refusal of a bf16 network, once, not a failed build per layer
    assert line.startswith("onnxruntime: ") and "bfloat16" in line and "failed" not in line
    assert all(not row["rungs"] for row in doc["layers"])


@pytest.mark.quick
def test_a_layers_floor_counts_only_the_input_it_reads():
    """The roofline's bytes: a 1x1 convolution of stride 2 (the downsample) reads a quarter of its input; a 3x3 of
    stride 2 reads all of it (its windows overlap). Counting the whole input put measured layers under the floor."""
    layers = {layer.path: layer for layer in distinct_layers("resnet50", 224)}
    assert layers["layer2.0.downsample.0"].bytes(1, 2) == 2 * (256 * 28 * 28 + 512 * 256 + 512 * 28 * 28)
    assert layers["layer2.0.conv2"].bytes(1, 2) == 2 * (128 * 56 * 56 + 128 * 128 * 9 + 128 * 28 * 28)


@pytest.mark.quick
def test_a_floor_is_claimed_only_for_engines_it_bounds():
    """The floor counts a direct convolution's FLOPs: cuDNN's fp32 FFT engines ran two 3x3s at 142% and 167% of it on
    the H100, so a Winograd or FFT engine's row names its algorithm instead of a share. fp8's bytes are e4m3's."""
    layers = distinct_layers("resnet50", 224)
    three = next(layer for layer in layers if layer.path == "layer2.1.conv2")
    peaks = {"tflops": {"fp32": 50.0, "fp8": 1000.0}, "copy_gbs": 3000.0}
    per_rung = {"cudnn": {three.path: {"median_ms": 0.8, "row": {"algorithm": "winograd"}}},
                "triton": {three.path: {"median_ms": 1.35, "row": {}, "parity": {"ok": True}}}}
    [row] = [r for r in layer_rows(layers, per_rung, peaks, 256, "fp32") if r["layer"] == three.path]
    assert row["rungs"]["cudnn"]["share_of_floor"] is None and row["fastest"] == "cudnn"
    assert row["rungs"]["triton"]["share_of_floor"] == pytest.approx(three.flops(256) / 50e9 / 1.35)
    [shown] = [d for d in layer_display([row], ["cudnn", "triton"])]
    assert shown["cudnn"] == "0.8 (winograd)*" and shown["triton"] == "1.35 (88%)"
    [fp8] = [r for r in layer_rows(layers, {}, peaks, 256, "fp8") if r["layer"] == three.path]
    assert fp8["bytes"] == three.bytes(256, 1)


@pytest.mark.quick
def test_a_side_by_side_of_many_rungs_fits_the_terminal_with_every_figure_whole():
    """Six rungs' census cells (ms/kernels/TFLOP/s) do not fit one 80-column table: the side-by-side goes on in a
    second table rather than cutting each cell short, and every figure is printed whole."""
    from rich.console import Console

    from harness.results.micro_tables import side_by_side_tables

    rungs = ["triton", "triton+graph", "cudnn", "cudnn+graph", "compile(default)", "eager"]
    display = [{"group": g, **{r: f"{12.7 + i:.3g}/{583 + i}/{125.4 + i:.4g}" for i, r in enumerate(rungs)},
                "fastest": "compile(default) 1.05x"} for g in ("stem", "layer1", "kern/pipelined")]
    console = Console(width=80, record=True, file=open("/dev/null", "w"))
    tables = side_by_side_tables("title", "caption", display, console.width)
    console.print(*tables)
    text = console.export_text()
    assert len(tables) > 1 and "…" not in text and max(map(len, text.splitlines())) <= 80
    assert all(cell in text for row in display for cell in row.values())
