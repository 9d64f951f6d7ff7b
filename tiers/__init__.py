"""Registry of rungs: every module directly in this package that defines TIER (or TIERS) is a rung; `base` is the
interface and `exports/` (a sub-package) holds the exports that several rungs share. Built once per process."""
from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import pkgutil

from core.cell import Cell
from tiers.base import Tier

# The ladder's order, from most abstract to least; rungs not listed here follow alphabetically.
LADDER_ORDER = ("eager", "torchscript", "compile", "aot-inductor", "onnxruntime", "tensorrt", "ort-tensorrt",
                "libtorch", "torchscript-cpp", "aot-inductor-cpp", "triton", "cudnn")


def _modules() -> list[str]:
    """This package's rung modules, plus any named in LADDER_EXTRA_TIERS (comma list of importable modules:
    rungs kept outside the package, such as the deliberately failing rungs of the test suite)."""
    names = [f"tiers.{m.name}" for m in pkgutil.iter_modules(__path__) if not m.ispkg and m.name != "base"]
    return names + [m for m in os.environ.get("LADDER_EXTRA_TIERS", "").split(",") if m]


class Broken(Tier):
    """Stands in for a rung module that fails to import: listed, and recorded as unavailable with the error."""

    def __init__(self, module: str, error: Exception) -> None:
        self.name = module.rpartition(".")[2].replace("_", "-")
        self.summary = f"(module {module} does not import)"
        self.reason = f"{module} failed to import: {type(error).__name__}: {error}"

    def availability(self, device: str) -> str | None:
        return self.reason


@functools.cache
def all_tiers() -> dict[str, Tier]:
    found: dict[str, Tier] = {}
    for name in _modules():
        try:
            module = importlib.import_module(name)
        except Exception as e:  # one broken rung must not take the ladder down
            found[Broken(name, e).name] = Broken(name, e)
            continue
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


def identity(cell: Cell) -> str:
    """The cell's key with every option at its rung's default left out: what makes two cells one measurement, for
    resume and for merged reports (`--option onnxruntime:conv-algo-search=EXHAUSTIVE` and no option)."""
    rung = all_tiers().get(cell.tier)
    kept = tuple((k, v) for k, v in cell.options if not (rung and v == rung.option_default(k, cell)))
    return dataclasses.replace(cell, options=kept).key
