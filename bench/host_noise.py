"""How steady is this machine's CPU? Host-bound cells (a forward whose latency is the time to issue it) measure the
host, so their figures move with it. This times one fixed pure-Python workload in short chunks on several CPUs at
once, with no GPU involved, and reports per CPU how much the chunk time moves and whether the slow spells coincide
across CPUs (a host-wide cause such as a neighbour on the physical machine) or not (a per-CPU cause):

    python3 bench/host_noise.py --cpus 0,5,11 --seconds 20 --json host_noise.json
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path


def work(n: int) -> int:
    acc = 0
    for i in range(n):
        acc = (acc + i * i) % 1000003
    return acc


def chunk_size(chunk_ms: float) -> int:
    n = 10_000
    while True:
        t = time.perf_counter()
        work(n)
        dt = time.perf_counter() - t
        if dt > 0.02:
            return max(1, int(n * chunk_ms / 1e3 / dt))
        n *= 2


def probe(cpu: int | None, n: int, start: float, seconds: float, queue: mp.Queue) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    while time.time() < start:
        pass
    series = []
    while time.time() < start + seconds:
        w0, c0 = time.perf_counter(), time.thread_time()
        work(n)
        series.append((time.time() - start, (time.perf_counter() - w0) * 1e3, (time.thread_time() - c0) * 1e3))
    queue.put((cpu, series))


def steal_ticks() -> int:
    return int(open("/proc/stat").readline().split()[8])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cpus", default="0", help="CPUs probed at once; 'any' = one unpinned probe")
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--chunk-ms", type=float, default=5)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    cpus = [None] if args.cpus == "any" else [int(c) for c in args.cpus.split(",")]
    n = chunk_size(args.chunk_ms)
    queue: mp.Queue = mp.Queue()
    start = time.time() + 1
    steal0 = steal_ticks()
    procs = [mp.Process(target=probe, args=(c, n, start, args.seconds, queue)) for c in cpus]
    for pr in procs:
        pr.start()
    series = dict(queue.get() for _ in procs)
    for pr in procs:
        pr.join()
    steal = (steal_ticks() - steal0) / os.sysconf("SC_CLK_TCK")
    out = {"what": f"wall ms of one fixed pure-Python chunk (~{args.chunk_ms} ms), back to back for {args.seconds} s "
                   "per CPU, all CPUs at once; cpu_ms = the thread's CPU time for the chunk",
           "steal_s_all_cpus": steal, "cpus": {}}
    for cpu, s in series.items():
        wall = sorted(x[1] for x in s)
        q = lambda f: wall[int(f * (len(wall) - 1))]
        out["cpus"][str(cpu)] = {"chunks": len(s), "p10": q(0.1), "median": q(0.5), "p90": q(0.9), "max": wall[-1],
                                 "slow_share": sum(w > 1.2 * q(0.1) for w in wall) / len(wall),
                                 "cpu_over_wall": statistics.fmean(x[2] / x[1] for x in s),
                                 "series": [[round(t, 3), round(w, 3), round(c, 3)] for t, w, c in s]}
        r = out["cpus"][str(cpu)]
        print(f"cpu {cpu}: {r['chunks']} chunks, p10 {r['p10']:.2f} median {r['median']:.2f} p90 {r['p90']:.2f} "
              f"max {r['max']:.2f} ms; {r['slow_share']:.0%} of chunks > 1.2x p10; cpu/wall {r['cpu_over_wall']:.3f}")
    # Coincidence of slow spells: per 100 ms window, which CPUs ran slow (median chunk > 1.2x their p10).
    windows: dict[int, list[bool]] = {}
    for cpu, r in out["cpus"].items():
        by_w: dict[int, list[float]] = {}
        for t, w, _ in r["series"]:
            by_w.setdefault(int(t * 10), []).append(w)
        for k, v in by_w.items():
            windows.setdefault(k, []).append(statistics.median(v) > 1.2 * r["p10"])
    slow_any = sum(any(v) for v in windows.values())
    slow_all = sum(all(v) for v in windows.values())
    out["windows_100ms"] = {"total": len(windows), "some_cpu_slow": slow_any, "all_cpus_slow": slow_all}
    print(f"steal {steal:.2f} s; 100 ms windows: {len(windows)}, some CPU slow {slow_any}, all slow {slow_all}")
    if args.json:
        args.json.write_text(json.dumps(out))


if __name__ == "__main__":
    main()
