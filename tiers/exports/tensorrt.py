"""What the two TensorRT rungs share (`tensorrt`, and ONNX Runtime's TensorRT execution provider in
`ort-tensorrt`): the GPU they need, the optimisation profile's shapes and where engines are cached."""
from __future__ import annotations

import tempfile
from pathlib import Path

from core.cell import Cell, Store

NEEDS_GPU = "TensorRT needs an NVIDIA GPU"
DEFAULT_MAX_BATCH = "256"


def profile_shapes(cell: Cell) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(min, opt, max) shapes of the input as bound (NHWC for channels-last cells, see bound_input)."""
    sample = (cell.res, cell.res, 3) if cell.channels_last else (3, cell.res, cell.res)
    top = max(cell.batch, int(cell.option("trt-max-batch", DEFAULT_MAX_BATCH)))
    return tuple((b, *sample) for b in (1, cell.batch, top))


def cache_dir(store: Store) -> Path:
    """Where engines and the timing cache are kept: the rung's cache directory (declared in `caches`, so that
    --isolation cell empties it and a hit is labelled warm-start), or a fresh one outside a ladder."""
    return store.cache if store.cache else Path(tempfile.mkdtemp(prefix="ladder-tensorrt-"))
