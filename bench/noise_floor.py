"""How far a cell's median moves between runs of the same code on one machine: the figures behind compare's noise
floors (harness/results/compare.py NOISE_FLOOR, docs/notes/compare-noise-floor.md). Give two or more ladder.json
files of the same code and protocol; every pair of them is compared cell by cell:

    python3 bench/noise_floor.py runs/a/ladder.json runs/b/ladder.json runs/c/ladder.json

It prints, per class (gpu, host, cpu: harness/results/compare.py noise_class) and for GPU cells per band of host share,
the number of cell pairs and the median, 95th percentile and largest move, max(B/A, A/B) - 1, then the largest
moves themselves. A floor below the largest move calls noise a change on these runs. Cells flagged as measured
beside another busy process are left out, as compare leaves them out."""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from core.cell import Cell  # noqa: E402
from harness.results.compare import NOISE_FLOOR, host_share, noise_class  # noqa: E402
from harness.results.load import load_records  # noqa: E402
from harness.run.record import ranked  # noqa: E402
from tiers import identity  # noqa: E402

BANDS = ((0.0, 0.5), (0.5, 0.8), (0.8, float("inf")))  # host share of a GPU cell's latency


def moves(paths: list[Path]) -> list[dict]:
    """Every cell measured in two of the runs: how far its median moved, its class and its larger host share."""
    runs = []
    for p in paths:
        records, _ = load_records([p])
        runs.append({identity(Cell.of_record(r)): r for r in records
                     if ranked(r) and not (r.get("contention") or {}).get("flagged")})  # compare does not judge those
    out = []
    for (i, a), (j, b) in itertools.combinations(enumerate(runs), 2):
        for key in a.keys() & b.keys():
            classes = {noise_class(a[key]), noise_class(b[key])}
            cls = next(c for c in ("cpu", "host", "gpu") if c in classes)
            out.append({"cell": key, "runs": (i, j), "class": cls,
                        "share": max(host_share(a[key]), host_share(b[key])),
                        "move": factor(a[key]["latency_ms"]["median"], b[key]["latency_ms"]["median"]) - 1})
    return out


def factor(x: float, y: float) -> float:
    """How many times the larger of two figures is the smaller: a move up or down by the same factor counts alike."""
    return max(x / y, y / x)


def summary(label: str, group: list[dict]) -> str:
    m = np.array([g["move"] for g in group])
    return (f"{label:28s} {len(m):5d} {100 * np.median(m):7.1f} {100 * np.percentile(m, 95):7.1f} "
            f"{100 * m.max():7.1f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", type=Path, nargs="+", help="ladder.json files of the same code, two at least")
    p.add_argument("--largest", type=int, default=8, help="list this many of the largest moves")
    args = p.parse_args()
    if len(args.runs) < 2:
        p.error("give two runs at least")
    found = moves(args.runs)
    print(f"{'class (host share)':28s} {'pairs':>5s} {'p50 %':>7s} {'p95 %':>7s} {'max %':>7s}   floor now")
    for cls in ("gpu", "host", "cpu"):
        group = [m for m in found if m["class"] == cls]
        if group:
            print(summary(cls, group) + f"   {100 * NOISE_FLOOR[cls]:.0f}%")
    for low, high in BANDS:
        band = [m for m in found if m["class"] != "cpu" and low <= m["share"] < high]
        if band:
            print(summary(f"  GPU cells, share {low:.1f}-{high:.1f}", band))
    print("\nlargest moves:")
    for m in sorted(found, key=lambda m: -m["move"])[:args.largest]:
        print(f"  {100 * m['move']:6.1f}%  {m['class']:10s} share {m['share']:.2f}  runs {m['runs']}  {m['cell']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
