"""The cudnn rung (cpp/cudnn, tiers/cudnn.py) without a GPU: the real CMake build with nvcc against PyTorch's cuDNN
and cuBLASLt wheels, the availability reasons, and the child contract's error path of the built binary."""
from __future__ import annotations

import os
import subprocess

import pytest

from core.cell import Cell, Unavailable
from tiers.cudnn import TIER, toolchain


def test_unavailable_on_cpu():
    assert TIER.availability("cpu") == "needs a CUDA GPU"


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
