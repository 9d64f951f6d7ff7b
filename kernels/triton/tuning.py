"""Autotuning shared by the kernels: whether to tune, how long it took, and how to launch either way.

Every kernel is wrapped in `triton.autotune(..., cache_results=True)`: Triton benchmarks each configuration the first
time it sees a new key (the shape arguments plus the dtypes of the tensors) and stores the timings in its on-disk
cache (~/.triton/cache, keyed by Triton version, GPU target, kernel source, key and config list), so a later process
on the same kind of GPU skips the benchmarking. Under the interpreter (TRITON_INTERPRET=1, CPU tests) or with
autotuning switched off, a kernel runs one fixed configuration chosen by a small heuristic instead.
"""
from __future__ import annotations

import os
import time

import triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# Wall time spent benchmarking configurations (their JIT compilation included): the rung's autotuning overhead.
# A build that adds nothing here was served entirely from the disk cache.
STATS = {"seconds": 0.0, "benchmarks": 0}


def bench(kernel_call, quantiles):
    """The autotuner's timer: triton.testing.do_bench with short windows (ranking configs needs no more), timed."""
    start = time.perf_counter()
    try:
        return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)
    finally:
        STATS["seconds"] += time.perf_counter() - start
        STATS["benchmarks"] += 1


def autotune(configs, key, prune=None):
    """triton.autotune with our timer and the disk cache (see `launch` for the untuned path)."""
    return triton.autotune(configs=configs, key=key, do_bench=bench, cache_results=True,
                           prune_configs_by={"early_config_prune": prune} if prune else None)


def launch(kernel, grid, args, tune: bool, fixed: dict):
    """Run an autotuned `kernel` on `args`, or (interpreter, tuning off) its plain JIT function with `fixed`,
    a dict of meta-parameters plus num_warps/num_stages."""
    if tune and not INTERPRET:
        kernel[grid](*args)
    else:
        kernel.fn[grid](*args, **fixed)
