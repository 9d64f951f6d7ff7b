"""Registry of rungs: every module in this package that defines TIER (or TIERS) is a rung."""
from __future__ import annotations

import importlib
import pkgutil

from tiers.base import Cell, Tier, Unavailable  # noqa: F401  (re-exported: the interface)

# The ladder's order, from most abstract to least; rungs not listed here follow alphabetically.
LADDER_ORDER = ("eager", "torchscript", "compile", "onnxruntime", "tensorrt", "ort-tensorrt",
                "libtorch", "torchscript-cpp", "triton", "cudnn")


def all_tiers() -> dict[str, Tier]:
    found: dict[str, Tier] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name == "base":
            continue
        module = importlib.import_module(f"tiers.{info.name}")
        for tier in getattr(module, "TIERS", [getattr(module, "TIER", None)]):
            if tier is not None:
                found[tier.name] = tier
    rank = {name: i for i, name in enumerate(LADDER_ORDER)}
    return dict(sorted(found.items(), key=lambda kv: (rank.get(kv[0], len(rank)), kv[0])))


def get_tier(name: str) -> Tier:
    tiers = all_tiers()
    if name not in tiers:
        raise ValueError(f"unknown tier {name!r}; valid: {', '.join(tiers)}")
    return tiers[name]
