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
