"""The AOTInductor package of the `aot-inductor` rung (loaded from Python) and of the `aot-inductor-cpp` rung (loaded
by AOTIModelPackageLoader in C++): one recipe for both.

`package(model, example, cell)`: torch.export.export of the model on the cell's device, dtype and layout, with the
batch dimension dynamic (one package serves every batch size, as a deployed model meets them; Inductor then
compiles kernels for a symbolic batch, tuned on batch TRACE_BATCH) or, with option batch-dim=static, one package
per batch size (as torch.compile specialises its graphs), then torch._inductor.aoti_compile_and_package to a
`.pt2` file. Packages are cached on disk under the run's cache directory (the rung's Store) by a key of the
weights' digest, the model, dtype, layout, device, mode, torch version and the batch it is traced on; a hit costs
neither export nor compile. For `aot-inductor-cpp` the parent runs `python -m tiers.exports.aot_inductor --cell
JSON --weights W --cache DIR` in a process of its own, as torchscript-cpp's export does."""
from __future__ import annotations

import copy
import fcntl
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from core.cell import Cell, Store
from core.placement import place_model, zero_example
from tiers.exports import command_line

# The rungs' options (`--option aot-inductor:KEY=VALUE`, the same for aot-inductor-cpp), each value's default first.
OPTIONS = {
    "mode": ("default", "max-autotune"),
    # One package for every batch size, or one per batch size (as compile's graphs).
    "batch-dim": ("dynamic", "static"),
    # How the loader runs the package. single-threaded: each call goes straight to the model, as from the one
    # thread that calls it here. pooled: the loader's default, made for several serving threads: a call checks out
    # one of a pool of model instances (one here) and first waits for that instance's previous call to finish on
    # the GPU, so back-to-back calls cannot overlap the next call's launches with the previous call's kernels.
    "runner": ("single-threaded", "pooled"),
}
MAX_BATCH = 4096  # the dynamic batch dimension's upper bound (1..MAX_BATCH)
# The batch a dynamic-batch package is traced and tuned on: the ladder's largest default batch. Tuned on batch 2,
# ResNet-50 bf16 ran batch 256 9% slower on the H100 (docs/notes/aoti-trace-batch.md); batch-dim=static
# tunes one package on each cell's own batch.
TRACE_BATCH = 256


def missing_api() -> str | None:
    """The exact reason this torch cannot build or load packages, or None."""
    import torch._inductor as inductor  # Inductor: seconds to import

    for owner, name in ((torch.export, "export"), (torch.export, "Dim"), (inductor, "aoti_compile_and_package"),
                        (inductor, "aoti_load_package")):
        if not hasattr(owner, name):
            return f"torch {torch.__version__} has no {owner.__name__}.{name} (AOTInductor packages need torch >= 2.6)"
    return None


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 of the model's state (names, dtypes and bytes): the package bakes the weights in."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def option(cell: Cell, key: str) -> str:
    """The cell's value of one of OPTIONS (its default if unset)."""
    value = cell.option(key, OPTIONS[key][0])
    if value not in OPTIONS[key]:
        raise ValueError(f"aot-inductor {key} {value!r}; valid: {', '.join(OPTIONS[key])}")
    return value


def package_key(digest: str, cell: Cell) -> str:
    static = option(cell, "batch-dim") == "static"
    shapes = f"batch {cell.batch}" if static else f"dynamic batch traced on {TRACE_BATCH}"
    parts = [digest, cell.model, cell.dtype, "nhwc" if cell.channels_last else "nchw", cell.device,
             option(cell, "mode"), torch.__version__, shapes]
    return hashlib.sha256("/".join(parts).encode()).hexdigest()[:16]


def package(model: torch.nn.Module, example: torch.Tensor, cell: Cell, cache: Path) -> tuple[Path, dict[str, Any]]:
    """The cell's package (built, or found in `cache`) and the deployment life cycle's facts: export and AOT
    compile time and package size (as measured when the package was built), and whether this call found it
    cached."""
    mode, dim = option(cell, "mode"), option(cell, "batch-dim")
    with torch.inference_mode(False):  # the worker builds under inference mode, whose tensors export refuses
        placed = place_model(copy.deepcopy(model), cell).eval()
    path = Path(cache) / f"{cell.model}-{package_key(weights_digest(placed), cell)}.pt2"
    facts: dict[str, Any] = {"mode": mode, "batch_dim": dim, "package": path.name}
    fmt = torch.channels_last if cell.channels_last else torch.contiguous_format
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:  # parallel jobs wanting one package: one builds, the rest wait
        fcntl.flock(lock, fcntl.LOCK_EX)
        return path, {**facts, **_build(placed, example, fmt, path, mode, dim == "static")}


def _build(placed: torch.nn.Module, example: torch.Tensor, fmt: torch.memory_format, path: Path,
           mode: str, static: bool) -> dict[str, Any]:
    """Export and compile unless the package exists; either way its costs as measured when it was built (kept
    beside it), so every cell that loads it reports them."""
    costs = path.with_suffix(".json")
    if path.exists() and costs.exists():
        return {"cached": True, **json.loads(costs.read_text())}
    t = time.perf_counter()
    with torch.inference_mode(False), torch.no_grad():  # export traces outside inference mode
        # A dynamic-batch package is traced on batch TRACE_BATCH whichever cell builds it: Inductor times each
        # Triton kernel's launch configurations on the traced shape when it compiles the package. The sample keeps
        # the cell's layout: a package assumes its inputs' strides are the sample's, unchecked (a channels-last
        # input given to a package traced on NCHW computes on a scrambled image).
        sample = example.clone() if static else example[:1].expand(TRACE_BATCH, *example.shape[1:])
        sample = sample.contiguous(memory_format=fmt)
        shapes = None if static else ({0: torch.export.Dim("batch", min=1, max=MAX_BATCH)},)
        program = torch.export.export(placed, (sample,), dynamic_shapes=shapes)
    export_s = time.perf_counter() - t
    t = time.perf_counter()
    tmp = path.with_suffix(f".{os.getpid()}.tmp.pt2")
    configs = compile_configs(mode, example.device.type)
    torch._inductor.aoti_compile_and_package(program, package_path=str(tmp), inductor_configs=configs)
    facts = {"export_s": export_s, "aot_compile_s": time.perf_counter() - t, "package_bytes": tmp.stat().st_size,
             "traced_batch": sample.shape[0], "inductor_configs": configs}
    costs.write_text(json.dumps(facts))
    tmp.replace(path)  # atomically: a concurrent job never loads half a package
    return {"cached": False, **facts}


def compile_configs(mode: str, device: str) -> dict[str, Any]:
    """Inductor's settings for the package. A CUDA package has no CPU kernels to vectorise, so it skips Inductor's
    CPU-ISA probes (each a C++ build and a fresh Python process: about 60 s of a first compile on the H100) and
    the precompiled header; a CPU package keeps both. Settings this torch lacks are left out."""
    wanted: dict[str, Any] = {"max_autotune": mode == "max-autotune"}
    if device == "cuda":
        wanted |= {"cpp.vec_isa_ok": False, "aot_inductor.precompile_headers": False}
    known = torch._inductor.config.get_config_copy()
    return {k: v for k, v in wanted.items() if k in known}


def main() -> None:
    cell, model, cache = command_line("Builds (or finds) the AOTInductor package of one cell.", "cache")
    # Inductor's and Triton's caches in the run's cache directory, as the Python rung's: a package compiled here is
    # compiled cold, whatever earlier runs left on the machine.
    os.environ.update(Store(cache=cache).library_env())
    path, facts = package(model, zero_example(cell), cell, cache)
    print(json.dumps({"path": str(path), **facts}))  # the parent reads the last line


if __name__ == "__main__":
    main()
