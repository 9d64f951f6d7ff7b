"""Which resource of the core does the host take away in its slow spells? `harness.host_noise` shows the pure-Python
chunk running up to 2x slow for seconds at a time; this runs, interleaved in one thread, kernels that each depend
on one resource, and correlates their times with the Python chunk's:

    clock    dependent multiplies: the effective clock (a slower clock slows everything alike)
    alu      4 independent add chains filling the ALU ports (a competing hyperthread on the same core slows it)
    l2, l3   pointer walks in 512 KiB and 64 MiB (latency of the private L2 and of the shared L3 and memory)
    python   the chunk of harness.host_noise

    python3 bench/host_resources.py --seconds 20 --json host_resources.json

Needs a C compiler (`cc`) for the kernels in host_resources.c; x86-64 only (inline assembly).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness.host_noise import work  # noqa: E402  (the same Python chunk as the environment's probe)

CLOCK_ROUNDS, ALU_ROUNDS, L2_LOADS, L3_LOADS, PYTHON_ITERS = 20_000, 60_000, 100_000, 20_000, 20_000
CYCLES_PER_CLOCK_ROUND = 48


def load_kernels(workdir: str) -> ctypes.CDLL:
    src = Path(__file__).with_suffix(".c")
    lib = Path(workdir) / "host_resources.so"
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    kernels = ctypes.CDLL(str(lib))
    for fn in (kernels.clock_chain, kernels.alu_wide, kernels.pointer_walk):
        fn.restype = ctypes.c_uint64
    kernels.clock_chain.argtypes = kernels.alu_wide.argtypes = [ctypes.c_uint64, ctypes.c_uint64]
    kernels.pointer_walk.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
    return kernels


def random_cycle(nbytes: int) -> np.ndarray:
    """buf[i] = the next index on one random cycle through all words: every load depends on the one before."""
    words = nbytes // 8
    order = np.random.default_rng(0).permutation(words).astype(np.uint64)
    buf = np.empty(words, np.uint64)
    buf[order] = np.roll(order, -1)
    return buf


def ms(fn, *args) -> float:
    t = time.perf_counter_ns()
    fn(*args)
    return (time.perf_counter_ns() - t) / 1e6


def measure(kernels: ctypes.CDLL, seconds: float) -> dict[str, list[float]]:
    """Per round, the ms of each kernel, run back to back in this thread."""
    l2, l3 = random_cycle(512 * 1024), random_cycle(64 * 1024 * 1024)
    rounds: dict[str, list[float]] = {k: [] for k in ("clock", "alu", "l2", "l3", "python")}
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        rounds["clock"].append(ms(kernels.clock_chain, CLOCK_ROUNDS, 3))
        rounds["alu"].append(ms(kernels.alu_wide, ALU_ROUNDS, 1))
        rounds["l2"].append(ms(kernels.pointer_walk, l2.ctypes.data, L2_LOADS))
        rounds["l3"].append(ms(kernels.pointer_walk, l3.ctypes.data, L3_LOADS))
        rounds["python"].append(ms(work, PYTHON_ITERS))
    return rounds


def summarize(rounds: dict[str, list[float]]) -> dict:
    py = np.array(rounds["python"])
    out = {}
    for name, times in rounds.items():
        t = np.array(times)
        p10, med, p90 = np.percentile(t, [10, 50, 90])
        out[name] = {"p10_ms": p10, "median_ms": med, "p90_ms": p90, "p90_over_p10": p90 / p10,
                     "corr_with_python": float(np.corrcoef(t, py)[0, 1])}
    ghz = CLOCK_ROUNDS * CYCLES_PER_CLOCK_ROUND / (np.array(rounds["clock"]) * 1e6)
    out["clock_ghz"] = dict(zip(("p10", "median", "p90"), np.percentile(ghz, [10, 50, 90])))
    out["rounds"] = len(py)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rounds = measure(load_kernels(tmp), args.seconds)
    s = summarize(rounds)
    for name in rounds:
        r = s[name]
        print(f"{name:7s} p10 {r['p10_ms']:.3f}  median {r['median_ms']:.3f}  p90 {r['p90_ms']:.3f} ms  "
              f"p90/p10 {r['p90_over_p10']:.2f}  correlation with python {r['corr_with_python']:+.2f}")
    c = s["clock_ghz"]
    print(f"effective clock {c['p10']:.2f} / {c['median']:.2f} / {c['p90']:.2f} GHz (p10 / median / p90), "
          f"{s['rounds']} rounds")
    if args.json:
        args.json.write_text(json.dumps({**s, "what": __doc__.split("\n\n")[0], "series_ms": rounds}))


if __name__ == "__main__":
    main()
