"""The cudnn rung (cpp/cudnn, tiers/cudnn.py): without a GPU, the real CMake build with nvcc against PyTorch's cuDNN
and cuBLASLt wheels, the availability reasons, and the child contract (inference and training) of the built binary;
on a GPU, the training step's backward against eager's, and training on given batches against eager's."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from core import train
from core.cell import Cell, Unavailable
from core.model import build_model, make_input, write_input, write_weights, zero_init_residual
from core.paths import REPO
from core.placement import set_math_mode
from harness.child.contract import Protocol, contract_argv
from tiers.cudnn import TIER, toolchain

from training_on_data import BATCH, check_training_on_data


@pytest.mark.quick
def test_unavailable_on_cpu():
    assert TIER.availability("cpu") == "needs a CUDA GPU"


@pytest.mark.quick
def test_declares_what_it_runs():
    assert TIER.supports(Cell(tier="cudnn", dtype="bf16", cuda_graph=True)) is None
    assert TIER.supports(Cell(tier="cudnn", model="resnet18")) == "cudnn implements only resnet50"


@pytest.fixture(scope="module")
def binary():
    try:
        toolchain()
    except Unavailable as e:
        pytest.skip(str(e))
    return TIER.command(Cell(tier="cudnn"))[0]


def test_builds_against_the_wheels(binary):
    assert os.access(binary, os.X_OK)
    needed = subprocess.run(["readelf", "-d", binary], capture_output=True, text=True).stdout
    assert "libcudnn.so.9" in needed and "libcublasLt.so" in needed


def test_reports_errors_per_contract(binary, tmp_path):
    missing = tmp_path / "missing.safetensors"
    proc = subprocess.run([binary, "--tier", "cudnn", "--weights", str(missing), "--input", str(missing),
                           "--device", "cuda"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert proc.stdout.splitlines() == ["@@phase load", f"@@error cannot open {missing}"]


@pytest.mark.quick
def test_declares_how_it_trains():
    assert TIER.supports(Cell(tier="cudnn", task="train", dtype="bf16", channels_last=True, cuda_graph=True)) is None
    assert "channels-last only" in TIER.supports(Cell(tier="cudnn", task="train", channels_last=False))
    assert "gradient scaler" in TIER.supports(Cell(tier="cudnn", task="train", dtype="fp16", channels_last=True))


@pytest.mark.parametrize("extra, error", [
    # parsed: then, without a GPU, the first CUDA call fails; with one, the weights file (a classifier bias alone)
    (["--dtype", "bf16", "--lr", "0.001"],
     "no classifier fc.weight" if torch.cuda.is_available() else "cudaStreamCreateWithFlags"),
    (["--dtype", "bf16"], "missing --lr"),
    (["--dtype", "fp16", "--lr", "0.001"], "fp16 training needs a gradient scaler"),
    (["--dtype", "fp32", "--channels-last", "0", "--lr", "0.001"], "trains channels-last only"),
])
def test_training_contract_parses(binary, tmp_path, extra, error):
    """The training cell's command line as the harness writes it (harness/child/contract.py), read by the binary before
    any CUDA call; a valid one fails only where it first needs the GPU, or, on a GPU, at its incomplete weights."""
    from safetensors.torch import save_file

    save_file({"input": torch.zeros(2, 3, 32, 32)}, str(tmp_path / "input.safetensors"))
    save_file({"fc.bias": torch.zeros(1000)}, str(tmp_path / "weights.safetensors"))
    argv = [binary, "--tier", "cudnn", "--weights", str(tmp_path / "weights.safetensors"), "--input",
            str(tmp_path / "input.safetensors"), "--device", "cuda", "--task", "train", "--batch", "2", "--res", "32",
            "--channels-last", "1", "--parity-steps", "3", *extra]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    lines = proc.stdout.splitlines()
    assert proc.returncode != 0 and lines[:2] == ["@@phase load", "@@phase build"], proc.stdout
    assert lines[2].startswith("@@error") and error in lines[2], lines[2]


@pytest.mark.gpu
def test_backward_of_the_last_bottleneck_matches_eager(binary, tmp_path):
    """One strict-fp32 step from the random weights (not zero-initialised, so that every branch has a gradient):
    the update of each parameter of the last bottleneck (three convolutions' data and weight gradients, three
    BatchNorm backwards, ReLU and the residual) and of the classifier within 1% of eager's. A wrong backward of any
    of those layers is off by far more. Deeper layers are left out: from these weights the first gradient of a deep
    BatchNorm network is chaotic (docs/notes/training-parity.md)."""
    model = build_model("resnet50")
    write_weights(model, tmp_path / "weights.safetensors")
    x = make_input(8, 64)
    write_input(x, tmp_path / "input.safetensors")
    cell = Cell(tier="cudnn", batch=8, res=64, dtype="fp32", channels_last=True, task="train")
    files = {k: tmp_path / f"{k}.{ext}" for k, ext in (("weights", "safetensors"), ("input", "safetensors"),
                                                       ("output", "safetensors"), ("result", "json"))}
    argv = contract_argv([binary], cell, files, Protocol(warmup_max=1, iters=1, max_iters=1, util_s=0),
                         {"parity-steps": "1"})
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:]
    ours = load_file(str(files["output"]))

    set_math_mode("fp32")
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    net = train.place_for_training(model, cell)
    step = train.make_step(net, net, cell, num_classes=1000)
    loss = step(x.to("cuda").contiguous(memory_format=torch.channels_last))
    assert abs(ours["loss"][0].item() - loss.item()) / loss.item() < 1e-4
    checked = [k for k in initial if k.startswith(("layer4.2.", "fc.")) and "num_batches" not in k
               and "running" not in k]
    params = dict(net.named_parameters())
    for name in checked:
        expected = params[name].detach().cpu() - initial[name]
        got = ours[f"param.{name}"] - initial[name]
        assert (got - expected).norm() / expected.norm() < 1e-2, name


@pytest.mark.gpu
def test_training_on_data_takes_the_batches_given_and_matches_eager(binary, tmp_path):
    """train-to-accuracy's contract on the cudnn rung, strict fp32: each epoch's state and mean loss are eager's
    after the same batches at the same rates (tests/training_on_data.py). Its batches came in through a plain
    cudaMemcpy, which may return before the copy lands and does not order against the rung's stream: on the H100,
    the digits' train loss stayed near 1 while eager's fell to 0."""
    initial = zero_init_residual(build_model("resnet50"))
    initial.fc = torch.nn.Linear(2048, 10)
    cell = Cell(tier="cudnn", batch=BATCH, res=32, dtype="fp32", channels_last=True, task="train")
    check_training_on_data([binary], initial, cell, Protocol(warmup_max=1, iters=1, max_iters=1, util_s=0), tmp_path)


def host_test(name: str, tmp_path) -> subprocess.CompletedProcess:
    """tests/cpp/<name>.cpp, built against cpp/cudnn/src with the host's C++ compiler (no CUDA), and run."""
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler on PATH")
    exe = tmp_path / name
    subprocess.run([compiler, "-std=c++17", "-O1", f"-I{REPO / 'cpp/cudnn/src'}", str(REPO / f"tests/cpp/{name}.cpp"),
                    "-o", str(exe)], check=True)
    return subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)


@pytest.mark.quick
def test_memory_plan_never_overlaps_live_tensors(tmp_path):
    """cpp/cudnn/src/memory_plan.h on random step sequences: tensors alive together never share a byte, in-place
    pairs do, and the plan stays near the most bytes alive at once."""
    proc = host_test("memory_plan_test", tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith("ok "), proc.stdout


@pytest.mark.quick
def test_tiled_stem_is_the_7x7_stride_2_convolution(tmp_path):
    """cpp/cudnn/src/stem.h: the input tiled as the GPU converts it, the tiled filter and the tiled output's pixel
    order compute ResNet's stem (7x7, stride 2, padding 3, bias, ReLU) on random images of two sizes."""
    proc = host_test("stem_test", tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith("ok "), proc.stdout
