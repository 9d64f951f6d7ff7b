"""A compiled kernel's binary loaded once more, with its own split of each SM's on-chip memory between L1 and shared
memory (the carveout), for the launches of a recorded forward that put few programs on each SM.

The carveout is an attribute of a loaded function, not of a launch (Triton's launcher passes none), and one kernel
binary serves launches of every grid size: a copy per carveout keeps them apart. The one Triton loads, and its
large-grid launches, keep the driver's choice, which leaves room for as many programs per SM as fit.

Measured on the H100 (bf16 under a CUDA graph, docs/notes/handwritten-toward-the-limit.md): with the carveout
fitted to the programs each grid puts on an SM, batch 1 ran 12% faster (246 -> 216 us) and batch 32 5%; batch 256,
whose grids fill the SMs, is unchanged. The smallest carveout on every kernel instead (0%, which holds one program
per SM) gained 5% at batch 1 and cost 20% at batch 256, where two programs per SM had run. Why the larger L1 is
faster for these kernels was not established."""
from __future__ import annotations

import ctypes
import math

import torch
from triton.runtime import driver

_FUNC_PREFERRED_SHARED_MEMORY_CARVEOUT = 9  # CUfunction_attribute
_RESERVED_PER_BLOCK = 1024  # shared memory the driver keeps for each resident block (sm_80 and later)
_COPIES: dict[tuple[int, int], int] = {}  # (loaded function, carveout %) -> the copy's function
_libcuda = None


def _set_carveout(function: int, percent: int) -> None:
    global _libcuda
    if _libcuda is None:
        _libcuda = ctypes.CDLL("libcuda.so.1")
    err = _libcuda.cuFuncSetAttribute(ctypes.c_void_p(function), ctypes.c_int(_FUNC_PREFERRED_SHARED_MEMORY_CARVEOUT),
                                      ctypes.c_int(percent))
    if err:
        raise RuntimeError(f"cuFuncSetAttribute(carveout {percent}%) failed with CUresult {err}")


def fitted_carveout(kernel, programs: int, device: torch.device) -> int | None:
    """The carveout (% of an SM's shared memory) that just holds the programs a grid of `programs` puts on each SM;
    None where they need all of it (the driver's own choice then)."""
    props = torch.cuda.get_device_properties(device)
    per_sm = math.ceil(programs / props.multi_processor_count)
    percent = math.ceil(100 * per_sm * (kernel.metadata.shared + _RESERVED_PER_BLOCK)
                        / props.shared_memory_per_multiprocessor)
    return percent if percent < 100 else None


def function_for(kernel, programs: int, device: torch.device) -> int:
    """The function to launch `kernel` (a Triton CompiledKernel) with on a grid of `programs`: its own, or a copy
    of its binary with the fitted carveout."""
    percent = fitted_carveout(kernel, programs, device)
    if percent is None:
        return kernel.function
    key = (kernel.function, percent)
    if key not in _COPIES:
        index = device.index if device.index is not None else torch.cuda.current_device()
        loaded = driver.active.utils.load_binary(kernel.name, kernel.kernel, kernel.metadata.shared, index)
        _set_carveout(loaded[1], percent)  # (module, function, registers, spills, ...)
        _COPIES[key] = loaded[1]
    return _COPIES[key]
