"""Rungs `libtorch` and `torchscript-cpp`: the network run from C++ through LibTorch, with no Python in the
process (cpp/libtorch). `libtorch` is ResNet written natively with torch::nn and loaded by name from the run's
weights; `torchscript-cpp` loads the frozen TorchScript module of the `torchscript` rung with torch::jit::load.
Both build against the installed torch's own CMake package, so they run the very kernels of the Python rungs."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from core.cbuild import build_dir, cmake_build, cuda_toolkit, require_tools, sources_missing
from core.cell import Cell, Unavailable
from tiers.base import CUDNN_BENCHMARK, ExternalTier
from tiers.exports import run_export


def _missing() -> str | None:
    """Why the C++ project cannot be built here, or None."""
    if sources_missing():
        return sources_missing()
    try:
        require_tools("cmake", "c++")
    except Unavailable as e:
        return str(e)
    config = Path(torch.utils.cmake_prefix_path) / "Torch" / "TorchConfig.cmake"
    if not config.exists():
        return f"torch {torch.__version__} has no CMake package ({config} missing)"
    if torch.version.cuda is None:  # the shared C++ driver (ladder/protocol.h) is built on the CUDA runtime
        return f"torch {torch.__version__} is a CPU-only build; the C++ rungs need a CUDA build of torch"
    home = cuda_toolkit()
    if home is None or not (home / "include" / "cuda_runtime.h").exists():
        return "CUDA toolkit not found (set CUDA_HOME; torch's CMake package needs its headers and cudart)"
    return None


class LibTorch(ExternalTier):
    name = "libtorch"
    cannot_train = None
    summary = "ResNet written with the LibTorch C++ API (torch::nn), weights loaded by name; no Python"
    models = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "wide_resnet50_2", "resnext50_32x4d")
    cuda_graph = True
    target = "ladder_libtorch"
    options = CUDNN_BENCHMARK

    def parity_recipe(self, cell: Cell) -> str | None:
        return "eager"  # torch::nn calls the ATen kernels eager calls

    def availability(self, device: str) -> str | None:
        return _missing()

    def supports(self, cell: Cell) -> str | None:
        reason = super().supports(cell)
        if reason is None and cell.task == "train" and cell.dtype == "fp16":
            return "fp16 training needs a gradient scaler, which LibTorch's C++ API lacks (bf16 trains)"
        return reason

    def _key(self) -> dict[str, str]:
        return {"torch": torch.__version__, "cuda": str(torch.version.cuda), "toolkit": str(cuda_toolkit().resolve())}

    def built(self, cell: Cell) -> bool:
        return _missing() is None and (build_dir("libtorch", self._key(), self.target) / self.target).exists()

    def command(self, cell: Cell) -> list[str]:
        reason = _missing()
        if reason:
            raise Unavailable(reason)
        home = cuda_toolkit()
        args = [f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}", f"-DCUDA_TOOLKIT_ROOT_DIR={home}",
                f"-DCMAKE_CUDA_COMPILER={home / 'bin' / 'nvcc'}"]
        return [str(cmake_build("libtorch", self._key(), args, self.target))]


class TorchScriptCpp(LibTorch):
    prepares_files = True
    name = "torchscript-cpp"
    cannot_train = ("it runs a frozen module (weights are constants); TorchScript trains from Python in the "
                    "torchscript rung")
    summary = "the torchscript rung's frozen module, loaded with torch::jit::load and run from C++; no Python"
    models = None
    target = "ladder_torchscript_cpp"

    def parity_recipe(self, cell: Cell) -> str | None:
        return None  # the TorchScript graph's own fusions

    def prepare(self, cell: Cell, weights: Path, workdir: Path, cache: Path) -> dict[str, str]:
        """Exports the cell's TorchScript module into `workdir` in a process of its own
        (tiers/exports/torchscript.py)."""
        out = Path(workdir) / "model.torchscript.pt"
        facts = run_export("tiers.exports.torchscript", "TorchScript export",
                               ["--cell", json.dumps(cell.to_dict()), "--weights", str(weights), "--out", str(out)])
        return {"ts-path": str(out), "export-s": f"{facts['torchscript_export_s']:.3f}"}


TIERS = [LibTorch(), TorchScriptCpp()]
