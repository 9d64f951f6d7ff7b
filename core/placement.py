"""A cell's numerics and placement in torch: its dtype, its math mode (TF32 or strict fp32), its memory layout."""
from __future__ import annotations

from typing import Any

import torch

from core.cell import Cell

# fp8 cells keep their activations in bf16 (their convolutions' math is e4m3: kernels/triton/conv.py).
TORCH_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
                "fp8": torch.bfloat16}


def torch_dtype(dtype: str) -> torch.dtype:
    """The torch type of the ladder's dtype name (tf32 is fp32 storage with TF32 math)."""
    return TORCH_DTYPES[dtype]


def set_math_mode(dtype: str) -> None:
    """TF32 tensor-core math for tf32 only. fp32 means strict fp32: torch allows TF32 in cuDNN convolutions by
    default, so say no explicitly."""
    tf32 = dtype == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32


def memory_format(channels_last: bool) -> torch.memory_format:
    return torch.channels_last if channels_last else torch.contiguous_format


def zero_example(cell: Cell) -> torch.Tensor:
    """A zero input of the cell's shape on its device, dtype and layout: what an export traces with."""
    x = torch.zeros(cell.batch, 3, cell.res, cell.res, device=cell.device, dtype=torch_dtype(cell.dtype))
    return x.contiguous(memory_format=memory_format(cell.channels_last))


def place_model(model: Any, cell: Cell) -> Any:
    """The eager model on the cell's device, dtype and memory layout (what every PyTorch-based rung starts from)."""
    return model.to(cell.device, torch_dtype(cell.dtype)).to(memory_format=memory_format(cell.channels_last))
