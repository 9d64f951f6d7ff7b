"""Two runs, cell by cell: B's median latency over A's, with a bootstrap confidence interval from the raw samples.

A change is called a regression or an improvement only where the interval excludes 1 and the change exceeds the
threshold; otherwise it is within noise. The interval covers the noise inside each run (the samples), not the
difference between two processes or two hosts: the threshold is there for that (host-bound cells move most,
and are marked)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from core.cell import Cell, layout_name
from core.files import write_text_atomic
from core.stats import median
from harness.record import bound, ranked
from harness.report import BadInput, load_records, markdown_table
from tiers import identity

FAILED = ("crashed", "oom", "timeout", "error", "parity-fail", "contended")


def median_ratio_ci(a: list[float], b: list[float], resamples: int = 2000, seed: int = 0,
                    level: float = 0.95) -> tuple[float, float, float]:
    """median(b) / median(a), and the percentile bootstrap interval of that ratio (each run resampled on its own)."""
    rng = np.random.default_rng(seed)
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    med_a = np.median(  # the same median as core.stats, vectorised over the resamples
        a[rng.integers(0, len(a), (resamples, len(a)))], axis=1)
    med_b = np.median(b[rng.integers(0, len(b), (resamples, len(b)))], axis=1)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(med_b / med_a, [tail, 100 - tail])
    return median(b.tolist()) / median(a.tolist()), float(low), float(high)


def verdict(ratio: float, low: float, high: float, threshold: float) -> str:
    if low > 1 and ratio > 1 + threshold:
        return "regression"
    if high < 1 and ratio < 1 - threshold:
        return "improvement"
    return "within noise"


def compare(a_records: list[dict], b_records: list[dict], threshold: float) -> list[dict]:
    """One row per cell of either run: its latencies, the ratio B/A with its 95% CI, and the verdict."""
    a_by = {identity(Cell.of_record(r)): r for r in a_records}
    b_by = {identity(Cell.of_record(r)): r for r in b_records}
    out = []
    for key in list(a_by) + [k for k in b_by if k not in a_by]:
        a, b = a_by.get(key), b_by.get(key)
        r = a or b
        row = {"rung": r["label"], "batch": r["batch"], "res": r["res"], "dtype": r["dtype"],
               "layout": layout_name(r["channels_last"]), "a_ms": None, "b_ms": None, "ratio": None,
               "ci_low": None, "ci_high": None, "host_bound": False}
        if a is None or b is None:
            row["verdict"] = "only in A" if b is None else "only in B"
        elif a["status"] != "ok" or b["status"] != "ok":
            row["verdict"] = (f"now {b['status']}" if a["status"] == "ok" else
                              "now ok" if b["status"] == "ok" else f"{b['status']} in both")
            if a["status"] == "ok" and b["status"] in FAILED:
                row["verdict"] = f"regression: now {b['status']}"
        elif not (ranked(a) and ranked(b)):
            row["verdict"] = "interpreted: not a speed"
        else:
            row.update(a_ms=a["latency_ms"]["median"], b_ms=b["latency_ms"]["median"],
                       host_bound="host" in (bound(a), bound(b)))
            sa, sb = a.get("latency_samples_ms"), b.get("latency_samples_ms")
            if sa and sb:
                ratio, low, high = median_ratio_ci(sa, sb)
                row.update(ratio=ratio, ci_low=low, ci_high=high, verdict=verdict(ratio, low, high, threshold))
            else:
                row.update(ratio=row["b_ms"] / row["a_ms"], verdict="no raw samples")
        out.append(row)
    return out


def regressions(rows: list[dict]) -> int:
    return sum(row["verdict"].startswith("regression") for row in rows)


def display(row: dict) -> dict[str, str]:
    """The row as the tables show it."""
    def ms(v):
        return "" if v is None else f"{v:.3f}"

    return {"rung": row["rung"], "batch": str(row["batch"]), "dtype": row["dtype"], "layout": row["layout"],
            "A ms": ms(row["a_ms"]), "B ms": ms(row["b_ms"]),
            "B/A": "" if row["ratio"] is None else f"{row['ratio']:.3f}",
            "95% CI": "" if row["ci_low"] is None else f"{row['ci_low']:.3f}-{row['ci_high']:.3f}",
            "verdict": row["verdict"] + (" (host)" if row["host_bound"] else "")}


def rich_table(rows: list[dict], title: str):
    table = Table(title=title, header_style="bold", box=box.SIMPLE_HEAD, padding=(0, 0), show_edge=False)
    shown = [display(r) for r in rows]
    for c in (shown[0] if shown else ()):
        table.add_column(c, no_wrap=c != "rung",
                         justify="left" if c in ("rung", "dtype", "layout", "verdict") else "right")
    for row, d in zip(rows, shown):
        style = ("red" if row["verdict"].startswith("regression") else
                 "green" if row["verdict"] == "improvement" else None)
        table.add_row(*[Text(v, style=style) for v in d.values()])
    return table


def markdown(rows: list[dict], a: str, b: str, threshold: float) -> str:
    n = regressions(rows)
    return "\n".join([
        f"# Compare: B = {b} against A = {a}", "",
        f"B/A = median latency of B over A's (above 1: B is slower). 95% CI: percentile bootstrap of that ratio from "
        f"both runs' raw samples. A change counts where the interval excludes 1 and it exceeds {threshold:.1%}; "
        "(host) marks host-bound cells, whose latency measures the host's speed.", "",
        *markdown_table([display(r) for r in rows]), "",
        f"{n} regression{'s' if n != 1 else ''}.", ""])


def run(a: Path, b: Path, threshold: float, markdown_path: Path | None) -> int:
    """`python -m harness compare A B`: the table, a summary line, the markdown if asked; 1 on a regression.
    Raises BadInput for a file that is not results."""
    loaded = []
    for path in (a, b):
        records, _ = load_records([path])
        if not records:
            raise BadInput(f"no records in {path}")
        loaded.append(records)
    rows = compare(*loaded, threshold=threshold)
    console = Console()
    both = [r for r in rows if not r["verdict"].startswith("only in")]
    console.print(rich_table(both, title=escape(f"B/A: median latency, B = {b}, A = {a}")))
    for side in ("A", "B"):
        alone = sum(r["verdict"] == f"only in {side}" for r in rows)
        if alone:
            console.print(f"{alone} cells only in {side} (listed in --markdown)", markup=False)
    n = regressions(rows)
    changed = sum(r["verdict"] == "improvement" for r in rows)
    console.print(f"{n} regression{'s' if n != 1 else ''}, {changed} improvement{'s' if changed != 1 else ''}, "
                  f"{sum(r['verdict'] == 'within noise' for r in rows)} within noise (threshold "
                  f"{threshold:.1%}; 95% bootstrap CI of the median's ratio)", markup=False)
    if markdown_path:
        markdown_path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(markdown_path, markdown(rows, str(a), str(b), threshold))
    return 1 if n else 0
