"""Rung `compile`: torch.compile (Dynamo + Inductor), `--compile-mode default|reduce-overhead|max-autotune`.

Besides the protocol's figures it reports what the compiler did and what it costs per call:
graphs and graph breaks (Dynamo's counters), guards of the cache entry that serves the call and the time to
evaluate the cache entries' guards for one call (what Dynamo does before every call, timed directly on its guard
managers, 1000 evaluations), and, in the hot start (batch + 1), the recompiles that the new shape triggers.
Its caches (Inductor's FX graph and AOTAutograd caches, Triton's kernels) live in the run's cache directory.
In training the whole step of core/train.py is compiled: forward, loss, backward (Dynamo hands it to AOTAutograd
at a graph break) and the optimizer's update."""
from __future__ import annotations

import inspect
import time

import torch

from core import train
from core.cell import Built
from core.model import num_classes
from core.placement import place_model
from tiers.base import CUDNN_BENCHMARK, PythonTier

MODES = ("default", "reduce-overhead", "max-autotune")


class Compile(PythonTier):
    name = "compile"
    summary = "torch.compile / Inductor (mode from --compile-mode)"
    options = {"compile-mode": MODES, **CUDNN_BENCHMARK}  # Inductor hands its convolutions to cuDNN
    caches = ("inductor", "triton")
    warm_in_prepare = True
    batch_change = True

    cannot_train = None

    def build(self, model, example, cell, store):
        torch._dynamo.reset()
        mode = _mode(cell)
        compiled = torch.compile(place_model(model, cell), mode=mode)  # lazily: the cost lands in first_result_s
        return Built(forward=compiled, stats={"compile_mode": mode})

    def build_train(self, model, example, cell, store, lr=None):
        torch._dynamo.reset()
        net = train.place_for_training(model, cell)
        built = train.built_step(net, net, cell, num_classes(net), lr,
                                 {"compile_mode": _mode(cell), "compiled": "the whole training step"})
        built.forward = torch.compile(built.forward, mode=_mode(cell))
        return built

    def after(self, built, example, cell):
        from torch._dynamo.utils import counters  # Dynamo: 1.2 s to import, only in a process that compiles

        facts = {
            "graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()),
            "graph_break_reasons": sorted(counters["graph_break"])[:5],
        }
        if cell.task == "train":  # the step's frame: its argument and the closure it reads
            fn = built.forward._torchdynamo_orig_callable
            f_locals = {"x": example, **dict(zip(fn.__code__.co_freevars,
                                                 (c.cell_contents for c in fn.__closure__ or ())))}
            facts.update(guard_cost(fn.__code__, f_locals))
        else:
            module = built.forward._orig_mod  # the module torch.compile wrapped
            arg = list(inspect.signature(type(module).forward).parameters)[1]
            facts.update(guard_cost(type(module).forward.__code__, {"self": module, arg: example}))
        return facts

    def hot_start(self, built, example, cell):
        from torch._dynamo.utils import counters  # as in after()

        before = counters["stats"]["unique_graphs"]
        hot = super().hot_start(built, example, cell)
        return {**hot, "recompiles": counters["stats"]["unique_graphs"] - before}


def _mode(cell) -> str:
    mode = cell.option("compile-mode", "default")
    if mode not in MODES:
        raise ValueError(f"compile-mode {mode!r}; valid: {', '.join(MODES)}")
    return mode


def guard_cost(code, f_locals: dict) -> dict:
    """Guard count of the entry Dynamo picks for a call of `code` with these frame locals, and the cost of
    finding it."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list  # a private API: its absence is reported
    except ImportError as e:
        return {"guards": None, "guard_check_us": None, "guard_note": f"Dynamo internals not reachable: {e}"}
    entries = _debug_get_cache_entry_list(code)
    for i, entry in enumerate(entries):
        if entry.guard_manager.check(f_locals):
            n = 1000
            t = time.perf_counter()
            for _ in range(n):
                for e in entries[: i + 1]:  # Dynamo tries entries in order until one passes
                    e.guard_manager.check(f_locals)
            return {"guards": len(entry.guard_manager.code_parts), "cache_entries": len(entries),
                    "guard_check_us": (time.perf_counter() - t) / n * 1e6}
    return {"guards": None, "guard_check_us": None, "cache_entries": len(entries),
            "guard_note": "no cache entry's guards pass on the measured call's locals"}


TIER = Compile()
