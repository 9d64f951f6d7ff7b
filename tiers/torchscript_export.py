"""The TorchScript module of the `torchscript` rung (in the worker) and of the `torchscript-cpp` rung (from C++).

`export_torchscript` is the one recipe both use. `python -m tiers.torchscript_export ...` runs it for one cell in
a process of its own, so that the parent of a `torchscript-cpp` cell never touches the GPU itself: a trace on the
device leaves a CUDA context and cached allocator blocks behind in the process that ran it.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def export_torchscript(model: torch.nn.Module, example: torch.Tensor, path: Path | None = None) -> torch.jit.ScriptModule:
    """Traces `model` on `example` (both already in the cell's device, dtype and layout), freezes it (weights become
    constants, batch-norm folds into the convolutions) and applies optimize_for_inference; saves it to `path` if
    given. Returns the module."""
    with torch.no_grad():
        traced = torch.jit.trace(model.eval(), example)
        module = torch.jit.optimize_for_inference(torch.jit.freeze(traced))
    if path is not None:
        module.save(str(path))
    return module


def export_cell(model_name: str, weights: Path, out: Path, batch: int, res: int, dtype: str, channels_last: bool,
                device: str) -> float:
    """Exports the run's model for one cell to `out`; returns the export's wall time in seconds (loading excluded)."""
    from harness.model import load_model

    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = load_model(model_name, weights).to(device=device, dtype=DTYPES[dtype], memory_format=fmt)
    example = torch.zeros(batch, 3, res, res, device=device, dtype=DTYPES[dtype]).contiguous(memory_format=fmt)
    t0 = time.perf_counter()
    export_torchscript(model, example, out)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--weights", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--res", type=int, required=True)
    p.add_argument("--dtype", choices=tuple(DTYPES), required=True)
    p.add_argument("--channels-last", type=int, choices=(0, 1), default=0)
    p.add_argument("--device", choices=("cuda", "cpu"), required=True)
    a = p.parse_args()
    seconds = export_cell(a.model, a.weights, a.out, a.batch, a.res, a.dtype, bool(a.channels_last), a.device)
    print(f"{seconds:.3f}")  # the parent reads the export time from the last line


if __name__ == "__main__":
    main()
