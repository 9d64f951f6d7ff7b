"""The ONNX model shared by the ONNX Runtime and TensorRT rungs: the cell's model in its dtype, exported by
torch's (dynamo) ONNX exporter with a dynamic batch axis. A channels-last cell gets an NHWC input: the
transpose to NCHW is part of the graph, so the runtime binds the NHWC buffer as it is and may fuse it away."""
from __future__ import annotations

import hashlib
import time
import warnings
from pathlib import Path

import torch

from core.cell import Cell
from core.placement import place_model


class NHWCInput(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x.permute(0, 3, 1, 2))


def bound_input(example: torch.Tensor, cell: Cell) -> torch.Tensor:
    """The tensor whose memory the runtime reads: NCHW, or for channels-last the same memory viewed as NHWC."""
    return example.permute(0, 2, 3, 1) if cell.channels_last else example


def export_onnx(model: torch.nn.Module, example: torch.Tensor, cell: Cell, workdir: Path) -> tuple[Path, dict]:
    """Exports once per (model, dtype, layout, res) into `workdir`; returns the path and export facts."""
    placed = place_model(model, cell).cpu() if cell.dtype in ("fp32", "tf32") else place_model(model, cell)
    module = NHWCInput(placed) if cell.channels_last else placed
    # Two samples, not one: torch.export specialises a size-1 dimension, which for the NHWC input contradicts the
    # dynamic batch axis ("Invalid ranges [2:1]"); the exported graph still takes any batch from 1 up.
    x = bound_input(example, cell)[:1].to(next(placed.parameters()).device).repeat(2, 1, 1, 1)
    digest = hashlib.sha1(repr((cell.model, cell.dtype, cell.channels_last, cell.res)).encode()).hexdigest()[:10]
    path = Path(workdir) / f"{cell.model}-{digest}.onnx"
    t = time.perf_counter()
    if not path.exists():
        batch = torch.export.Dim("batch", min=1, max=4096)
        with warnings.catch_warnings(), torch.inference_mode(False), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(module, (x,), str(path), input_names=["input"], output_names=["logits"],
                              dynamic_shapes=({0: batch},), dynamo=True)
    return path, {"onnx_export_s": time.perf_counter() - t, "onnx_bytes": sum(
        p.stat().st_size for p in path.parent.glob(path.name + "*"))}
