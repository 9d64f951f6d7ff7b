"""The TorchScript module of the `torchscript` rung (run from Python) and of the `torchscript-cpp` rung (run from C++).

`export_torchscript` is the one recipe both use: trace, freeze, optimize_for_inference. For `torchscript-cpp` the
parent exports before starting the C++ child with `python -m tiers.exports.torchscript --cell JSON --weights W
--out PATH`, in a process of its own: the trace runs on the cell's device, and the parent must not keep a CUDA
context and cached allocator blocks of its own while the child is measured. The file holds the frozen module and
the loader applies optimize_for_inference itself (torch::jit::optimize_for_inference in C++): on the CPU that pass
packs weights for oneDNN into objects that cannot be serialised (loading fails with "required keyword attribute
'value' is undefined").
"""
from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from core.placement import place_model, zero_example
from tiers.exports import command_line


def export_torchscript(model: torch.nn.Module, example: torch.Tensor,
                       path: Path | None = None) -> tuple[torch.jit.ScriptModule, dict[str, Any]]:
    """Traces `model` on `example` (both already on the cell's device, dtype and layout), freezes it (weights
    become constants, batch-norm folds into the convolutions), saves the frozen module to `path` if given, and
    applies optimize_for_inference. Returns the optimised module and facts for build_stats."""
    t0 = time.perf_counter()
    # Outside inference mode: the worker builds under it, and tracing/freezing rejects inference tensors.
    with warnings.catch_warnings(record=True) as caught, torch.inference_mode(False), torch.no_grad():
        warnings.simplefilter("always")
        traced = torch.jit.trace(model.eval(), example.clone())
        frozen = torch.jit.freeze(traced)
        if path is not None:
            frozen.save(str(path))  # before optimize_for_inference, which rewrites `frozen` in place
        module = torch.jit.optimize_for_inference(frozen)
    deprecation = next((str(w.message) for w in caught if "deprecat" in str(w.message).lower()), None)
    return module, {"torchscript_export_s": time.perf_counter() - t0, "torchscript_deprecation": deprecation}


def main() -> None:
    cell, model, out = command_line("Exports the TorchScript module of one cell (torchscript-cpp rung).", "out")
    _, facts = export_torchscript(place_model(model, cell), zero_example(cell), out)
    print(json.dumps(facts))  # the parent reads the facts from the last line


if __name__ == "__main__":
    main()
