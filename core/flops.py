"""FLOPs of one image through a model (2 per multiply-accumulate, convolutions and matmuls only), counted by
torch's FlopCounterMode on the meta device, so nothing is computed or allocated: in all, and per layer group."""
from __future__ import annotations

import functools

import torch
from torch.utils.flop_counter import FlopCounterMode

from core.layers import group_of
from core.model import skeleton


@functools.lru_cache(maxsize=None)
def _counted(model_name: str, res: int) -> tuple[int, dict[str, dict]]:
    """(total FLOPs, FlopCounterMode's counts by module) of one image's forward."""
    with torch.device("meta"):
        model = skeleton(model_name).eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.empty(1, 3, res, res, device="meta"))
    root = type(model).__name__ + "."
    return int(counter.get_total_flops()), {name.removeprefix(root): counts
                                            for name, counts in counter.get_flop_counts().items()
                                            if name.startswith(root)}


def flops_per_image(model_name: str, res: int) -> int:
    return _counted(model_name, res)[0]


def flops_per_group(model_name: str, res: int) -> dict[str, int]:
    """FLOPs of one image per layer group (core.layers.group_of)."""
    groups: dict[str, int] = {}
    for name, by_op in _counted(model_name, res)[1].items():
        if "." not in name:  # a direct child of the model: its FLOPs hold its children's
            groups[group_of(name)] = groups.get(group_of(name), 0) + sum(by_op.values())
    return groups
