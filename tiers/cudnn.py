"""The bottom rung: ResNet-50 straight from cuDNN's graph API (convolutions with bias, residual add and ReLU fused),
cuDNN's average pooling, a cuBLASLt classifier and a little CUDA of our own (max-pooling in NHWC; cpp/cudnn). On
tensor cores its stem runs between tiled layouts (cpp/cudnn/src/stem.h): the input in 4x4 pixel tiles (48 channels,
made once at build like any rung's input conversion), the output in 2x2 pixel tiles, so that the 7x7 stride-2
convolution is a 3x3 stride-1 one 256 wide, which cuDNN runs fast. It is built on demand against the
cuDNN and cuBLASLt that PyTorch itself loads (its NVIDIA pip wheels), with the toolkit's nvcc.

It trains too (`--task train`, cpp/cudnn/src/train_net.h): the three passes of every convolution by cuDNN (a block's
first data gradient adding the residual's other gradient in its graph; BatchNorm's statistics in the forward's graph
where cuDNN's genstats times faster than our pass), BatchNorm in training mode, max-pooling, the loss and SGD by our
kernels, the classifier's gradients by cuBLASLt; NHWC, bf16 (fp32 master weights, as autocast) or fp32/tf32; one
memory plan for every activation, gradient and convolution workspace; the whole step one CUDA graph under
--cuda-graph.

The binary also takes `--option autotune=K` (engine configurations timed per distinct convolution, default 8) and
`--option workspace-mb=M` (the most workspace one candidate may use, default 2048). Under --cuda-graph it ranks the
candidates by their GPU time in graph replays rather than by one call's latency, which at batch 1 is mostly the
host's work before the kernel; those choices are kept apart in the engine tables (keys with "graph")."""
from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from core import train
from core.cbuild import build_dir, cmake_build, cuda_toolkit, require_tools, sources_missing
from core.cell import Cell, Unavailable
from core.model import build_model, make_input, write_input, training_start, write_weights
from tiers.base import ExternalTier

MICRO_REPS = 20  # timed runs of each convolution in `micro`


def _wheel_dirs() -> list[Path]:
    """Roots of the `nvidia` namespace package that PyTorch's CUDA wheels install into (nvidia/cudnn,
    nvidia/cu13, ...)."""
    try:
        import nvidia  # the namespace of torch's CUDA wheels, absent from a CPU build
    except ImportError:
        return []
    return [Path(p) for p in nvidia.__path__]


def _first(roots: list[Path], *patterns: str) -> Path | None:
    for root in roots:
        for pattern in patterns:
            hits = sorted(root.glob(pattern))
            if hits:
                return hits[0]
    return None


@dataclass(frozen=True)
class Toolchain:
    nvcc: Path
    cudnn_include: Path
    cudnn_library: Path
    cublaslt_include: Path
    cublaslt_library: Path
    cudnn_version: str
    cuda_version: str
    cupti: tuple[Path, Path] | None = None  # (include directory, library) for the census; None: built without


def _cupti(roots: list[Path]) -> tuple[Path, Path] | None:
    """CUPTI's header directory and library from one package (a wheel's or the toolkit's), or None."""
    for root in roots:
        for header in sorted(root.glob("*/include/cupti.h")) + sorted(root.glob("include/cupti.h")) + sorted(
                root.glob("extras/CUPTI/include/cupti.h")):
            base = header.parent.parent
            library = _first([base], "lib/libcupti.so.*", "lib64/libcupti.so.*", "lib/libcupti.so", "lib64/libcupti.so")
            if library:
                return header.parent, library
    return None


def _cudnn_header_version(include: Path) -> str:
    text = (include / "cudnn_version.h").read_text()
    part = {k: re.search(rf"#define CUDNN_{k}\s+(\d+)", text) for k in ("MAJOR", "MINOR", "PATCHLEVEL")}
    if not all(part.values()):
        raise Unavailable(f"cannot read the cuDNN version from {include / 'cudnn_version.h'}")
    return ".".join(m.group(1) for m in part.values())


@functools.lru_cache(maxsize=1)
def toolchain() -> Toolchain:
    """What the build needs, or Unavailable with exactly what is missing."""
    toolkit = cuda_toolkit()
    if toolkit is None:
        raise Unavailable("nvcc not found (not in $CUDA_HOME/bin, $CUDA_PATH/bin or /usr/local/cuda/bin, not on PATH)")
    nvcc = toolkit / "bin" / "nvcc"
    require_tools("cmake")
    wheels = _wheel_dirs()
    cudnn_roots = [w / "cudnn" for w in wheels]
    cudnn_h = _first(cudnn_roots, "include/cudnn.h")
    if cudnn_h is None:
        raise Unavailable("cuDNN headers (cudnn.h) not found in PyTorch's nvidia-cudnn wheel "
                          f"({', '.join(map(str, cudnn_roots)) or 'no nvidia package installed'})")
    cudnn_so = _first(cudnn_roots, "lib/libcudnn.so.9", "lib/libcudnn.so.*")
    if cudnn_so is None:
        raise Unavailable(f"libcudnn.so.9 not found next to {cudnn_h.parent}")
    # cuBLASLt: PyTorch's wheel first (nvidia/cu13 or nvidia/cublas), else the CUDA toolkit of nvcc.
    toolkit = toolkit.resolve()
    roots = [*wheels, toolkit]
    lt_h = _first(roots, "*/include/cublasLt.h", "include/cublasLt.h", "targets/*/include/cublasLt.h")
    lt_so = _first(roots, "*/lib/libcublasLt.so.*", "lib64/libcublasLt.so.*", "targets/*/lib/libcublasLt.so.*")
    if lt_h is None:
        raise Unavailable(f"cuBLASLt header (cublasLt.h) not found in the nvidia wheels or {toolkit}")
    if lt_so is None:
        raise Unavailable(f"libcublasLt.so not found in the nvidia wheels or {toolkit}")
    release = re.search(r"release (\d+\.\d+)", subprocess.run([str(nvcc), "--version"], capture_output=True,
                                                              text=True).stdout)
    return Toolchain(nvcc, cudnn_h.parent, cudnn_so, lt_h.parent, lt_so, _cudnn_header_version(cudnn_h.parent),
                     release.group(1) if release else "unknown", _cupti(roots))


def _cuda_arch() -> str:
    """LADDER_CUDA_ARCH if set, else the GPU's compute capability, else 90 (H100)."""
    if os.environ.get("LADDER_CUDA_ARCH"):
        return os.environ["LADDER_CUDA_ARCH"]
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"{major}{minor}"
    return "90"


class CudnnTier(ExternalTier):
    hand_written = True
    options = {"autotune": None, "workspace-mb": None}
    caches = ("engines",)  # engine choices per convolution (engines.tsv in the run's cache; one shipped per GPU)
    name = "cudnn"
    cannot_train = None
    cuda_graph_train = True
    summary = "cuDNN graph API (fused conv+bias+add+ReLU) + own max-pool + cuBLASLt classifier, C++/CUDA"
    models = ("resnet50",)
    cuda_graph = True
    has_micro = True
    has_micro_train = True

    def parity_recipe(self, cell: Cell) -> str | None:
        return "folded"  # batch-norm folded (net.cpp), the downsample's output stored before the residual add

    def supports(self, cell: Cell) -> str | None:
        reason = super().supports(cell)
        if reason is None and cell.task == "train" and not cell.channels_last:
            return "the cudnn rung trains channels-last only (its BatchNorm kernels are NHWC)"
        if reason is None and cell.task == "train" and cell.dtype == "fp16":
            return "fp16 training needs a gradient scaler, which the cudnn rung lacks (bf16 trains)"
        return reason

    def availability(self, device: str) -> str | None:
        if device != "cuda":
            return "needs a CUDA GPU"
        if sources_missing():
            return sources_missing()
        try:
            toolchain()
        except Unavailable as e:
            return str(e)
        return None

    def _key(self) -> dict[str, str]:
        tc = toolchain()
        return {"cudnn": tc.cudnn_version, "cuda": tc.cuda_version, "torch": torch.__version__, "arch": _cuda_arch()}

    def built(self, cell: Cell) -> bool:
        if self.availability("cuda") is not None:  # no toolchain: nothing can be built (and _key would raise)
            return False
        return (build_dir("cudnn", self._key(), "ladder_cudnn") / "ladder_cudnn").exists()

    def binary(self) -> Path:
        """The rung's binary, built once per toolchain and source digest."""
        tc = toolchain()
        arch = _cuda_arch()
        return cmake_build("cudnn", self._key(), [
            f"-DCMAKE_CUDA_COMPILER={tc.nvcc}",
            f"-DCMAKE_CUDA_ARCHITECTURES={arch}",
            f"-DCUDNN_INCLUDE_DIR={tc.cudnn_include}",
            f"-DCUDNN_LIBRARY={tc.cudnn_library}",
            f"-DCUBLASLT_INCLUDE_DIR={tc.cublaslt_include}",
            f"-DCUBLASLT_LIBRARY={tc.cublaslt_library}",
            *([f"-DCUPTI_INCLUDE_DIR={tc.cupti[0]}", f"-DCUPTI_LIBRARY={tc.cupti[1]}"] if tc.cupti else []),
        ], "ladder_cudnn")

    def command(self, cell: Cell) -> list[str]:
        return [str(self.binary())]

    def micro(self, batch: int, res: int, dtype: str, channels_last: bool, task: str = "infer",
              baselines: bool = True) -> list[dict]:
        """infer: each distinct convolution of ResNet-50 (shape and fused epilogue) timed alone with the engine the
        rung chose: shape, engine, median ms over MICRO_REPS, TFLOP/s, and how many layers share it. train: each step
        of the training schedule alone (every convolution's forward, dgrad and wgrad; BatchNorm forward and
        backward; pooling, classifier, loss, SGD), with its engine and whether it is fused. No baselines: its rows
        are its own engines only."""
        with tempfile.TemporaryDirectory() as tmp:
            weights, inputs = Path(tmp) / "weights.safetensors", Path(tmp) / "input.safetensors"
            model = build_model("resnet50")
            write_weights(training_start(model) if task == "train" else model, weights)
            write_input(make_input(batch, res), inputs)
            proc = subprocess.run([str(self.binary()), "--micro", "1", "--weights", str(weights), "--input",
                                   str(inputs), "--batch", str(batch), "--res", str(res), "--dtype", dtype,
                                   "--channels-last", "1" if channels_last else "0", "--device", "cuda",
                                   "--task", task, "--lr", repr(train.LEARNING_RATE),
                                   "--option", f"micro-reps={MICRO_REPS}"], capture_output=True, text=True)
        for line in proc.stdout.splitlines():
            if line.startswith("@@micro "):
                return json.loads(line[len("@@micro "):])
        reason = [line[len("@@error "):] for line in proc.stdout.splitlines() if line.startswith("@@error ")]
        raise RuntimeError("cudnn micro failed: " + (reason[0] if reason else proc.stderr.strip()[-2000:]))


TIER = CudnnTier()
