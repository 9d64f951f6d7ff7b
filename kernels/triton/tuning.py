"""Autotuning shared by the kernels: whether to tune, how long it took, and how to launch either way.

Where a kernel launches, its configuration comes from, in turn:
1. a tuning table: the one shipped for this GPU model (kernels/tunings/<gpu>/triton.json, as vLLM ships its
   Triton configs), merged with the table of earlier processes of the same run (`tuned.json` in the run's cache);
   `load_tables` reads them, keyed by kernel, shape arguments and tensor dtypes;
2. else autotuning: every kernel is wrapped in `triton.autotune(..., cache_results=True)`, which benchmarks each
   configuration for a new key and keeps the timings in Triton's disk cache; the winner joins `TUNED`, which
   `save_tuned` writes back so the next process (or a `--retune` run's user, into kernels/tunings/) reuses it.
The tables also hold choices between whole ways of running a shape (`choose`: {"choice": name}), made the same
way.
Under the interpreter (TRITON_INTERPRET=1, CPU tests) or with autotuning switched off, a kernel runs one fixed
configuration chosen by a small heuristic instead.
"""
from __future__ import annotations

import functools
import json
import operator
import os
import time
from pathlib import Path
from typing import Callable

import triton

from kernels.triton import plan

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Set by the ladder's prepare stage, which compiles kernels beside other jobs: timing configurations there would
# choose by noise, so a shape missing from the tables takes the untuned configuration instead.
NO_AUTOTUNE = os.environ.get("LADDER_NO_AUTOTUNE") == "1"

# Wall time spent benchmarking configurations (their JIT compilation included): the rung's autotuning overhead.
# A build that adds nothing here was served entirely from a table or the disk cache. `table_hits`: launches whose
# configuration came from a tuning table; `launches`: kernel launches through `launch`.
STATS = {"seconds": 0.0, "benchmarks": 0, "table_hits": 0, "launches": 0}
TABLE: dict[str, dict] = {}  # key -> configuration, from the tuning tables
TUNED: dict[str, dict] = {}  # key -> configuration chosen by autotuning in this process


def load_tables(*paths: Path | None) -> list[str]:
    """Merges the tuning tables that exist among `paths` into TABLE (later ones win); returns those read."""
    read = []
    for path in paths:
        if path and Path(path).is_file():
            TABLE.update(json.loads(Path(path).read_text())["configs"])
            read.append(str(path))
    return read


def save_tuned(path: Path, about: dict) -> None:
    """Writes TABLE's entries used here plus TUNED to `path` (atomically), the table format that load_tables reads."""
    path = Path(path)
    known = json.loads(path.read_text())["configs"] if path.is_file() else {}
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**about, "configs": {**known, **TUNED}}, indent=1, sort_keys=True))
    tmp.replace(path)


_KEYS: dict[tuple, str] = {}  # (kernel, its key arguments, its tensors' dtypes) -> table_key's string


def table_key(kernel, args) -> str:
    """What the autotuner keys on: the kernel, its `key` arguments' values and the dtypes of its tensor arguments.
    Built once per distinct key: every launch asks, and formatting the string cost about 9 us a launch (a training
    step launches some 2,300 kernels)."""
    fast = (kernel, _key_arguments(kernel)(args), tuple(a.dtype for a in args if hasattr(a, "dtype")))
    key = _KEYS.get(fast)
    if key is None:
        bound = dict(zip(kernel.arg_names, args))
        dtypes = [str(a.dtype).removeprefix("torch.") for a in args if hasattr(a, "dtype")]
        key = _KEYS[fast] = f"{kernel.fn.__name__}|{','.join(str(bound[k]) for k in kernel.keys)}|{','.join(dtypes)}"
    return key


@functools.cache
def _key_arguments(kernel):
    """A function that picks `kernel`'s key arguments out of its positional arguments."""
    return operator.itemgetter(*(kernel.arg_names.index(k) for k in kernel.keys))


def bench(kernel_call, quantiles):
    """The autotuner's timer: triton.testing.do_bench with short windows (ranking configs needs no more), timed."""
    start = time.perf_counter()
    try:
        return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)
    finally:
        STATS["seconds"] += time.perf_counter() - start
        STATS["benchmarks"] += 1


def choose(key: str, options: dict[str, Callable[[], object]], tune: bool) -> str:
    """Which of `options` (name -> a call that runs it, side-effect free; the first is the default) a shape runs:
    the tuning tables' choice for `key`, else, with tuning on the GPU, the fastest by `bench`, timed once (the
    choice joins TUNED, so tables keep it), else the first. For a fusion whose worth depends on the shape, such as a
    reduction taken on by a convolution's epilogue (kernels/triton/train_block.py)."""
    entry = (TABLE.get(key) or TUNED.get(key)) if tune else None
    if entry is not None:
        return entry["choice"]
    if not tune or INTERPRET or NO_AUTOTUNE:
        return next(iter(options))
    ms = {name: bench(run, None) for name, run in options.items()}
    TUNED[key] = {"choice": min(ms, key=ms.get), "ms": {name: round(t, 4) for name, t in ms.items()}}
    return TUNED[key]["choice"]


def autotune(configs, key, prune=None):
    """triton.autotune with our timer and the disk cache (see `launch` for the untuned path)."""
    return triton.autotune(configs=configs, key=key, do_bench=bench, cache_results=True,
                           prune_configs_by={"early_config_prune": prune} if prune else None)


def launch(kernel, grid, args, tune: bool, fixed: dict, pdl: bool = False):
    """Run an autotuned `kernel` on `args` with its configuration from a tuning table, else autotuned (on the GPU),
    else (tuning off, or the interpreter without a table entry) its plain JIT function with `fixed`, a dict of
    meta-parameters plus num_warps/num_stages. `pdl`: launched as a programmatic dependent launch, the kernel
    compiled with its GDC flag (kernels/triton/pdl.py). While a forward is recorded (kernels/triton/plan.py), the
    launch is noted with the meta-parameters it ran (`chosen`), which are returned."""
    dependent = {"GDC": True, "launch_pdl": True} if pdl else {}
    STATS["launches"] += 1
    config = None
    if tune:
        key = table_key(kernel, args)
        config = TABLE.get(key) or TUNED.get(key)
        STATS["table_hits"] += key in TABLE
    if config is not None:
        chosen = config["kwargs"]
        compiled = kernel.fn[grid](*args, **chosen, num_warps=config["num_warps"], num_stages=config["num_stages"],
                                   **dependent)
    elif tune and not INTERPRET and not NO_AUTOTUNE:
        compiled = kernel[grid](*args, **dependent)
        best = kernel.best_config
        TUNED[key] = {"kwargs": dict(best.kwargs), "num_warps": best.num_warps, "num_stages": best.num_stages}
        chosen = dict(best.kwargs)
    else:
        chosen = fixed
        compiled = kernel.fn[grid](*args, **fixed, **dependent)
    if plan.RECORDING is not None:
        plan.note(compiled, kernel.fn, grid, args, {**chosen, **dependent})
    return chosen
