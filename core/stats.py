"""Summary statistics of raw samples; the one place they are computed, for every rung.

The adaptive stop of the latency pass uses `median_ci_rel`; cpp/common/ladder/protocol.h has the same rule."""
from __future__ import annotations

import math

import numpy as np

CI_Z = 1.96  # 95% two-sided


def median(samples: list[float]) -> float:
    """The median (the mean of the two middle samples for an even count): the one definition every figure uses."""
    s = sorted(samples)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def median_ci_bounds(n: int) -> tuple[int, int]:
    """0-based ranks of the distribution-free 95% confidence interval of the median of n sorted samples (order
    statistics, normal approximation to the binomial: ranks (n - z*sqrt(n))/2 and 1 + (n + z*sqrt(n))/2)."""
    half = CI_Z * math.sqrt(n)
    lo = max(math.floor((n - half) / 2) - 1, 0)
    hi = min(math.ceil(1 + (n + half) / 2) - 1, n - 1)
    return lo, hi


def median_ci_rel(samples: list[float]) -> float:
    """Half-width of the median's 95% confidence interval relative to the median (inf with fewer than 3 samples)."""
    n = len(samples)
    if n < 3:
        return math.inf
    s = sorted(samples)
    lo, hi = median_ci_bounds(n)
    med = median(s)
    return (s[hi] - s[lo]) / (2 * med) if med > 0 else math.inf


def summarize(samples: list[float]) -> dict[str, float | int] | None:
    """median, p90, p99, min, max, mean, coefficient of variation (std/mean), count, and the median's 95%
    confidence interval (order statistics) with its half-width relative to the median; None for no samples."""
    if not samples:
        return None
    a = np.asarray(samples, dtype=np.float64)
    mean = float(a.mean())
    s = np.sort(a)
    out = {
        "median": median(samples),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
        "min": float(a.min()),
        "max": float(a.max()),
        "mean": mean,
        "cv": float(a.std(ddof=1) / mean) if a.size > 1 and mean > 0 else 0.0,
        "n": int(a.size),
    }
    if a.size >= 3:
        lo, hi = median_ci_bounds(a.size)
        out.update(ci95_low=float(s[lo]), ci95_high=float(s[hi]), ci95_rel=median_ci_rel(samples))
    return out
