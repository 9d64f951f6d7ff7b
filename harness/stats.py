"""Summary statistics of raw samples; the one place they are computed, for every rung."""
from __future__ import annotations

import numpy as np


def summarize(samples: list[float]) -> dict[str, float | int] | None:
    """median, p90, p99, min, max, mean, coefficient of variation (std/mean) and count; None for no samples."""
    if not samples:
        return None
    a = np.asarray(samples, dtype=np.float64)
    mean = float(a.mean())
    return {
        "median": float(np.median(a)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
        "min": float(a.min()),
        "max": float(a.max()),
        "mean": mean,
        "cv": float(a.std(ddof=1) / mean) if a.size > 1 and mean > 0 else 0.0,
        "n": int(a.size),
    }


def summarize_blocks(samples: list[float], blocks: list[dict]) -> dict:
    """The latency pass block by block (each block on its own CPU): per-block medians, the fastest block's median
    and the spread between blocks (slowest / fastest - 1)."""
    medians, first = [], 0
    for b in blocks:
        medians.append(float(np.median(samples[first:first + b["n"]])))
        first += b["n"]
    return {"cpus": [b["cpu"] for b in blocks], "n": [b["n"] for b in blocks], "medians_ms": medians,
            "best_median_ms": min(medians), "spread": max(medians) / min(medians) - 1}
