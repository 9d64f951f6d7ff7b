"""FLOPs of one image through a model (2 per multiply-accumulate, convolutions and matmuls only), counted by
torch's FlopCounterMode on the meta device, so nothing is computed or allocated."""
from __future__ import annotations

import functools

import torch
from torch.utils.flop_counter import FlopCounterMode

from core.model import skeleton


@functools.lru_cache(maxsize=None)
def flops_per_image(model_name: str, res: int) -> int:
    with torch.device("meta"):
        model = skeleton(model_name).eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.empty(1, 3, res, res, device="meta"))
    return int(counter.get_total_flops())
