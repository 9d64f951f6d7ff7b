"""How a reduction over rows is cut so that it fills the GPU (issue 60's training kernels). A batch-norm moment or
a weight gradient reduces over the N*H*W rows of a layer: with one program per block of columns, the stem's 64
channels would run on 2 programs, each walking 3.2 million rows. Instead the rows are cut into slices, each
program reduces its own slice into a partial result, and the partials are combined afterwards in a fixed order
(torch's sum over the slice axis), so the result has the same bits call after call, which atomics would not
give."""
from __future__ import annotations

import functools

import torch
import triton

WAVES = 4  # programs per SM to aim for: enough to hide the tail of the last wave
MIN_STEPS = 4  # a slice walks at least this many row blocks, or the partials cost more than they save


def row_slices(rows: int, column_programs: int, block_rows: int, device: torch.device) -> tuple[int, int]:
    """(slices, rows per slice; a multiple of block_rows) for a reduction over `rows` whose columns already take
    `column_programs` programs. On the CPU (the interpreter) four programs in all, so that the tests exercise the
    combination of partials."""
    target = _target_programs(device)
    steps = triton.cdiv(rows, block_rows)
    slices = max(1, min(triton.cdiv(target, column_programs), steps // MIN_STEPS or 1))
    per_slice = triton.cdiv(steps, slices) * block_rows
    return triton.cdiv(rows, per_slice), per_slice


@functools.lru_cache(maxsize=None)
def _target_programs(device: torch.device) -> int:
    """Programs to aim for on `device`, asked once (every batch norm and weight gradient of a step asks)."""
    return torch.cuda.get_device_properties(device).multi_processor_count * WAVES if device.type == "cuda" else 4
