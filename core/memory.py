"""Memory a configuration needs, estimated before anything runs (the ladder's guard against a batch that cannot fit)."""
from __future__ import annotations

import functools

import torch

from core.model import skeleton


@functools.lru_cache(maxsize=None)
def activation_bytes_per_image(model_name: str, res: int) -> int:
    """An upper estimate of the fp32 activations one image keeps alive in an inference forward: three times the
    largest module output (a block's input, its branch and the skip), measured on the meta device (no memory)."""

    with torch.device("meta"):
        model = skeleton(model_name).eval()
    largest = [0]

    def hook(_module, _inputs, output):
        if isinstance(output, torch.Tensor):
            largest[0] = max(largest[0], output.numel())

    for m in model.modules():
        if not list(m.children()):
            m.register_forward_hook(hook)
    with torch.no_grad():
        model(torch.empty(1, 3, res, res, device="meta"))
    return 3 * largest[0] * 4


def proc_bytes(path: str, key: str) -> int | None:
    """The value of `key` in a /proc file of `Key:   N kB` lines (meminfo, status), in bytes; None without /proc
    (absent, not approximate)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def host_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), else None."""
    return proc_bytes("/proc/meminfo", "MemAvailable")
