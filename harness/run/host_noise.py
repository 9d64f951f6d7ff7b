"""How steady is this machine's CPU? A host-bound cell (a forward whose latency is the time to issue it) measures the
host, so its figure moves with the host. This times one fixed pure-Python workload in short chunks on several CPUs
at once, with no GPU involved. On a steady machine every chunk takes about as long as the fastest tenth; on a
shared VM chunks run up to 2x slow for seconds at a time. Each run's environment records a short probe
(`host_cpu`); the long form, with the series and whether slow spells coincide across CPUs, is

    python -m harness.run.host_noise --cpus 0,4,8,12 --seconds 20 --json host_noise.json
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

from core.files import write_text_atomic
from core.stats import median

SLOW = 1.2  # a chunk is slow when it takes more than this times the probe's fastest tenth


def work(n: int) -> int:
    acc = 0
    for i in range(n):
        acc = (acc + i * i) % 1000003
    return acc


def chunk_size(chunk_ms: float) -> int:
    """Iterations of `work` that take about chunk_ms here and now (calibrated over >= 20 ms)."""
    n = 10_000
    while True:
        t = time.perf_counter()
        work(n)
        dt = time.perf_counter() - t
        if dt > 0.02:
            return max(1, int(n * chunk_ms / 1e3 / dt))
        n *= 2


def _probe(cpu: int, n: int, start: float, seconds: float, queue: Any) -> None:
    os.sched_setaffinity(0, {cpu})
    while time.time() < start:  # all probes start together, so their series line up in time
        pass
    series = []
    while time.time() < start + seconds:
        t = time.perf_counter()
        work(n)
        series.append((time.time() - start, (time.perf_counter() - t) * 1e3))
    queue.put((cpu, series))


def spread_cpus(count: int) -> list[int]:
    allowed = sorted(os.sched_getaffinity(0))
    count = min(count, len(allowed))
    return [allowed[k * len(allowed) // count] for k in range(count)]


def measure(cpus: list[int], seconds: float, chunk_ms: float = 5.0) -> dict[int, list[tuple[float, float]]]:
    """(seconds since start, chunk wall ms) per CPU, one process pinned to each, all running at once."""
    ctx = mp.get_context("spawn")  # the caller may hold threads or a CUDA context: never fork it
    n = chunk_size(chunk_ms)
    queue = ctx.Queue()
    start = time.time() + 1.0  # time for the spawned processes to start
    procs = [ctx.Process(target=_probe, args=(c, n, start, seconds, queue)) for c in cpus]
    for p in procs:
        p.start()
    series = dict(queue.get() for _ in procs)
    for p in procs:
        p.join()
    return series


def summarize(series: dict[int, list[tuple[float, float]]]) -> dict[str, Any]:
    """Per CPU and pooled: chunk time p10 / median / p90 and the share of slow chunks."""
    def stats(ms: list[float]) -> dict[str, float]:
        ms = sorted(ms)

        def q(f: float) -> float:
            return ms[int(f * (len(ms) - 1))]

        return {"p10_ms": q(0.1), "median_ms": q(0.5), "p90_ms": q(0.9), "p90_over_p10": q(0.9) / q(0.1),
                "slow_share": sum(m > SLOW * q(0.1) for m in ms) / len(ms), "chunks": len(ms)}
    per_cpu = {str(c): stats([m for _, m in s]) for c, s in series.items()}
    return {**stats([m for s in series.values() for _, m in s]), "per_cpu": per_cpu}


def host_cpu_probe(seconds: float = 2.0, cpus: int = 4) -> dict[str, Any]:
    """The short probe every run's environment records."""
    chosen = spread_cpus(cpus)
    return {**summarize(measure(chosen, seconds)), "cpus": chosen, "seconds": seconds,
            "what": f"wall time of one fixed pure-Python chunk (~5 ms), back to back for {seconds:.0f} s on each "
                    f"of these CPUs at once, at the start of the run; p90_over_p10 near 1 = a steady host; "
                    f"slow_share = chunks over {SLOW}x the fastest tenth. Host-bound cells move with this"}


def coincidence(series: dict[int, list[tuple[float, float]]], window_s: float = 0.1) -> dict[str, int]:
    """Per time window: did some CPU run slow, did all? (All at once points at the physical host.)"""
    per_cpu = summarize(series)["per_cpu"]
    p10 = {c: per_cpu[str(c)]["p10_ms"] for c in series}
    windows: dict[int, list[bool]] = {}
    for c, s in series.items():
        by_window: dict[int, list[float]] = {}
        for t, m in s:
            by_window.setdefault(int(t / window_s), []).append(m)
        for k, ms in by_window.items():
            windows.setdefault(k, []).append(median(ms) > SLOW * p10[c])
    return {"windows": len(windows), "some_cpu_slow": sum(any(v) for v in windows.values()),
            "all_cpus_slow": sum(all(v) for v in windows.values()), "window_s": window_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpus", default=None, help="comma list of CPUs probed at once (default: 4 spread over all)")
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    cpus = [int(c) for c in args.cpus.split(",")] if args.cpus else spread_cpus(4)
    series = measure(cpus, args.seconds)
    out = {**summarize(series), "coincidence": coincidence(series), "seconds": args.seconds,
           "series": {str(c): [[round(t, 3), round(m, 3)] for t, m in s] for c, s in series.items()}}
    for c, r in out["per_cpu"].items():
        print(f"cpu {c}: p10 {r['p10_ms']:.2f}  median {r['median_ms']:.2f}  p90 {r['p90_ms']:.2f} ms; "
              f"{r['slow_share']:.0%} of chunks slow (> {SLOW}x p10)")
    w = out["coincidence"]
    print(f"{w['windows']} windows of {w['window_s']} s: some CPU slow in {w['some_cpu_slow']}, "
          f"all slow in {w['all_cpus_slow']}")
    if args.json:
        write_text_atomic(args.json, json.dumps(out))


if __name__ == "__main__":
    main()
