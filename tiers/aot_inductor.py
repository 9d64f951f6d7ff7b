"""Rungs `aot-inductor` and `aot-inductor-cpp`: torch.export + AOTInductor, TorchScript's successor for deployment.

Both run the same `.pt2` package (tiers/exports/aot_inductor.py: export with a dynamic batch, compile ahead of time,
cached by the weights' digest): `aot-inductor` loads it with torch._inductor.aoti_load_package and calls it from
Python; `aot-inductor-cpp` is a C++ program of ours (cpp/libtorch/ladder_aoti_cpp.cpp) that loads it with
torch::inductor::AOTIModelPackageLoader, with no Python in the process. The deployment life cycle's costs are in
build_stats: export_s, aot_compile_s and package_bytes as measured when the package was built (the prepare stage
builds it; `cached` says whether the cell found it built), package_load_s (the load in a fresh process: the
deployment's cold start; in Python its first call also imports Inductor's runtime).
Options `--option aot-inductor:mode=default|max-autotune`, `batch-dim=dynamic|static` and
`runner=single-threaded|pooled` (the same for the C++ rung; tiers/exports/aot_inductor.py). A CUDA package skips
Inductor's CPU-ISA probes, which it has no use for (tiers/exports/aot_inductor.py `compile_configs`)."""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

from core.cell import Built, Cell
from tiers.base import CUDNN_BENCHMARK, PythonTier
from tiers.exports import run_export
from tiers.exports.aot_inductor import OPTIONS, missing_api, option, package
from tiers.libtorch import LibTorch

# torch builds whose Python loader crashes on every CUDA package (docs/notes/aoti-python-cuda-crash.md): on the lent
# H100, torch 2.11.0+cu130's aoti_load_package dies by SIGSEGV while building the model container, for ResNet-50
# and for a one-layer model alike, under every compile setting tried, while AOTIModelPackageLoader in our C++
# program (aot-inductor-cpp) runs the same packages. Not tried again per cell: each try is a crashed process.
PYTHON_LOADER_CRASHES_ON_CUDA = ("2.11.0+cu130",)


class AotInductor(PythonTier):
    name = "aot-inductor"
    summary = "torch.export (dynamic batch) + AOTInductor .pt2 package, loaded with aoti_load_package from Python"
    options = {**OPTIONS, **CUDNN_BENCHMARK}
    caches = ("aot-inductor",)  # the packages, under the run's cache directory
    warm_in_prepare = True  # the prepare stage builds the packages; a measured cell loads one
    batch_change = True  # a dynamic-batch package serves every batch size (a static one: changes_batch)
    cannot_train = "an AOTInductor package is an inference graph (no backward)"

    def availability(self, device: str) -> str | None:
        if device == "cuda" and torch.__version__ in PYTHON_LOADER_CRASHES_ON_CUDA:
            return (f"torch {torch.__version__}'s aoti_load_package crashes (SIGSEGV) loading any CUDA package; the "
                    "C++ loader runs the same package: aot-inductor-cpp (docs/notes/aoti-python-cuda-crash.md)")
        return missing_api()

    def build(self, model, example, cell, store):
        cache = store.cache or Path(tempfile.mkdtemp(prefix="ladder-aoti-"))
        path, facts = package(model, example, cell, cache)
        facts["runner"] = option(cell, "runner")
        t = time.perf_counter()
        runner = torch._inductor.aoti_load_package(str(path), run_single_threaded=facts["runner"] == "single-threaded")
        facts["package_load_s"] = time.perf_counter() - t
        return Built(forward=runner, stats=facts)

    def changes_batch(self, cell):
        return super().changes_batch(cell) and option(cell, "batch-dim") == "dynamic"


class AotInductorCpp(LibTorch):
    prepares_files = True
    name = "aot-inductor-cpp"
    summary = "the aot-inductor rung's .pt2 package, loaded with AOTIModelPackageLoader and run from C++; no Python"
    models = None
    options = {**OPTIONS, **CUDNN_BENCHMARK}
    cuda_graph = False
    cannot_train = "an AOTInductor package is an inference graph (no backward)"
    target = "ladder_aoti_cpp"

    def availability(self, device: str) -> str | None:
        return missing_api() or super().availability(device)

    def prepare(self, cell: Cell, weights: Path, workdir: Path, cache: Path) -> dict[str, str]:
        """The package, built (or found) in the Python rung's cache by a process of its own: both rungs load one
        package, and the parent keeps no CUDA context while the child is measured."""
        shared = Path(cache).parent / AotInductor.name
        facts = run_export("tiers.exports.aot_inductor", "AOTInductor package", [
            "--cell", json.dumps(cell.to_dict()), "--weights", str(weights), "--cache", str(shared)])
        return {"pt2-path": facts["path"], "cached": str(int(facts["cached"])), "export-s": f"{facts['export_s']:.3f}",
                "aot-compile-s": f"{facts['aot_compile_s']:.3f}", "package-bytes": str(facts["package_bytes"]),
                "traced-batch": str(facts["traced_batch"])}


TIERS = [AotInductor(), AotInductorCpp()]
