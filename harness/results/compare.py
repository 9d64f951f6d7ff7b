"""Runs against runs, cell by cell: B's median latency over A's, with a bootstrap confidence interval.

Two kinds of noise move a figure. Inside a run, the samples scatter: the bootstrap of the raw samples covers that.
Between runs, whole processes and hosts differ (a host-bound cell moves by tens of percent): no resampling of one
run can see that. So:
- with several runs a side, the bootstrap is two-level (runs drawn with replacement, then each drawn run's samples),
  and the interval carries the spread between runs; a change must exceed the threshold;
- with one run a side, a change must also exceed the cell's noise floor: the largest change measured between runs
  of the same code in that cell's class (NOISE_FLOOR; docs/notes/compare-noise-floor.md).
Each row says which of the two applied (`basis`)."""
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
from harness.results.load import BadInput, load_records
from harness.results.tables import markdown_table
from harness.run import record
from harness.run.record import bound, ranked
from harness.run.status import FAILED, Status
from tiers import identity


# The largest move of a cell's median between two runs of the same code (max(B/A, A/B) - 1), by class, rounded up:
# a change must exceed it, up or down by the factor 1 + floor. Measured on the lent H100 (inference: 4 runs, 153
# cell pairs; training: 2 runs, 24) and on 2-core CPU VMs (4 default runs, 33 pairs: 50%; six one-thread sweeps,
# 60 pairs: 94%, ONNX Runtime's sub-millisecond cells); docs/notes/compare-noise-floor.md has the figures, and
# bench/noise_floor.py measures them on another machine.
NOISE_FLOOR = {"gpu": 0.04, "host": 0.85, "cpu": 1.0}
HOST_PACED = 0.5  # host time per call / latency from which a GPU cell moves with the host: training steps at batch
# 32 with shares of 0.51-0.59 moved up to 59% between runs, cells under 0.5 at most 3.9%

SIDE_BREAK = "::"  # the command line's `--` between A's runs and B's (cli.py puts it there; argparse drops `--`)


def host_share(r: dict) -> float:
    """The CPU time to issue one call over its latency (1 on the CPU, where the host computes it)."""
    if r["device"] != "cuda":
        return 1.0
    host = (r.get("host_overhead_us") or {}).get("median")
    return host / 1e3 / r["latency_ms"]["median"] if host else 0.0


def noise_class(r: dict) -> str:
    """'cpu' (computed on the host), 'host' (a GPU cell paced by its host) or 'gpu'."""
    return "cpu" if r["device"] != "cuda" else "host" if host_share(r) >= HOST_PACED else "gpu"


def noise_floor(records: list[dict]) -> tuple[float, str]:
    """The noise floor of a cell measured in these records (one run a side), and its class: the noisiest class of
    the two."""
    classes = {noise_class(r) for r in records}
    cls = next(c for c in ("cpu", "host", "gpu") if c in classes)
    return NOISE_FLOOR[cls], cls


def _side(runs: list[list[float]], rng: np.random.Generator, resamples: int) -> np.ndarray:
    """One side's statistic (the mean of its runs' medians) over the two-level bootstrap's resamples."""
    per_run = np.stack([np.median(np.asarray(s, dtype=float)[rng.integers(0, len(s), (resamples, len(s)))], axis=1)
                        for s in runs])  # (runs, resamples): each run's median, its samples resampled
    drawn = rng.integers(0, len(runs), (resamples, len(runs)))  # the runs of each resample, with replacement
    return per_run[drawn, np.arange(resamples)[:, None]].mean(axis=1)


def ratio_ci(a_runs: list[list[float]], b_runs: list[list[float]], resamples: int = 2000, seed: int = 0,
             level: float = 0.95) -> tuple[float, float, float]:
    """B over A (each side: the mean of its runs' medians; one run: its median), and the percentile interval of
    that ratio under the two-level bootstrap. With one run a side it is the plain bootstrap of the samples."""
    rng = np.random.default_rng(seed)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(_side(b_runs, rng, resamples) / _side(a_runs, rng, resamples), [tail, 100 - tail])
    point = np.mean([median(s) for s in b_runs]) / np.mean([median(s) for s in a_runs])
    return float(point), float(low), float(high)


def verdict(ratio: float, low: float, high: float, threshold: float) -> str:
    """A change by more than the factor 1 + threshold, either way, with the interval excluding 1."""
    if low > 1 and ratio > 1 + threshold:
        return "regression"
    if high < 1 and ratio < 1 / (1 + threshold):
        return "improvement"
    return "within noise"


def side_status(records: list[dict]) -> str:
    """'ok' where every run of the side measured the cell, else the first failure."""
    return next((r["status"] for r in records if r["status"] != Status.OK), Status.OK)


def timed(a: list[dict], b: list[dict], threshold: float) -> dict:
    """The figures and verdict of a cell that every run of both sides measured."""
    a_ms, b_ms = mean_median(a), mean_median(b)
    row = {"a_ms": a_ms, "b_ms": b_ms, "host_bound": any(bound(r) == "host" for r in a + b)}
    samples = [[r.get("latency_samples_ms") for r in side] for side in (a, b)]
    if not all(all(s) for s in samples):
        return {**row, "ratio": b_ms / a_ms, "verdict": "no raw samples", "basis": ""}
    ratio, low, high = ratio_ci(*samples)
    if len(a) > 1 and len(b) > 1:
        basis, needed = f"{len(a)}+{len(b)} runs", threshold
    else:
        floor, cls = noise_floor(a + b)
        basis, needed = f"floor {floor:.0%} {cls}", max(threshold, floor)
    return {**row, "ratio": ratio, "ci_low": low, "ci_high": high, "threshold": needed, "basis": basis,
            "verdict": verdict(ratio, low, high, needed), "class": noise_floor(a + b)[1]}


def compare(a_runs: list[list[dict]], b_runs: list[list[dict]], threshold: float,
            include_contended: bool = False) -> list[dict]:
    """One row per cell of any run: its latencies (the mean of each side's run medians), the ratio B/A with its 95%
    CI, the verdict and its basis (between-run spread, or the cell's noise floor). A cell measured beside another
    busy process in any run shows its medians but is not judged, unless `include_contended` (its basis then says
    so)."""
    def by_cell(runs: list[list[dict]]) -> dict[str, list[dict]]:
        cells: dict[str, list[dict]] = {}
        for run in runs:
            for r in run:
                cells.setdefault(identity(Cell.of_record(r)), []).append(r)
        return cells

    a_by, b_by = by_cell(a_runs), by_cell(b_runs)
    out = []
    for key in list(a_by) + [k for k in b_by if k not in a_by]:
        a, b = a_by.get(key, []), b_by.get(key, [])
        r = (a or b)[0]
        row = {"rung": r["label"], "batch": r["batch"], "res": r["res"], "dtype": r["dtype"],
               "layout": layout_name(r["channels_last"]), "a_ms": None, "b_ms": None, "ratio": None,
               "ci_low": None, "ci_high": None, "threshold": None, "basis": "", "host_bound": False,
               "a_runs": len(a), "b_runs": len(b)}
        sa, sb = side_status(a), side_status(b)
        if not a or not b:
            row["verdict"] = "only in B" if not a else "only in A"
        elif sa != Status.OK or sb != Status.OK:
            row["verdict"] = (f"now {sb}" if sa == Status.OK else "now ok" if sb == Status.OK else f"{sb} in both")
            if sa == Status.OK and sb in FAILED:
                row["verdict"] = f"regression: now {sb}"
        elif not all(ranked(x) for x in a + b):
            row["verdict"] = "interpreted: not a speed"
        elif contended(a + b) and not include_contended:  # it measured another process too
            row.update(a_ms=mean_median(a), b_ms=mean_median(b), verdict=CONTENDED)
        else:
            row.update(timed(a, b, threshold))
            if contended(a + b):
                row["basis"] += ", contended"
        out.append(row)
    return out


CONTENDED = "contended: not judged"

# A run-level shift: the geometric mean of the judged cells' B/A within a noise class, with a Student-t interval
# over the cells' log ratios (a class holds a handful of cells, for which a bootstrap's interval is too narrow: two
# CPU runs of the same code, cells at 1.31, 1.02, 1.08 and 1.49, gave a bootstrap interval of 1.05-1.40). A shift
# counts where the interval excludes 1 and the mean moves by more than the class's floor: a change that moves every
# cell a little (a slower build, a slower library) stays under each cell's own floor, and cells that scatter, as
# runs of the same code do, leave a wide interval (docs/notes/compare-noise-floor.md).
# The host-paced floors come from two CPU runs of the same code whose cells moved together by 21% one time and
# by -20% (B/A 0.80) another (the test's sweeps on a 2-core VM): a whole run's speed moves with its host.
# A run-level shift must also move every rung of the class beyond the floor, the same way: six sweeps of the same
# code on an idle 2-core VM (2026-12-02) doubled one rung's cells (ONNX Runtime's) now and then while eager's moved
# under 10%, a geometric mean of 1.38 over the four cells with an interval that excluded 1.
RUN_SHIFT_FLOOR = {"gpu": 0.02, "host": 0.27, "cpu": 0.27}
RUN_SHIFT_MIN_CELLS = 3


def run_shifts(rows: list[dict], threshold: float) -> list[dict]:
    """Per noise class with RUN_SHIFT_MIN_CELLS judged cells or more: the geometric mean of their B/A, its 95%
    Student-t interval over the cells, each rung's own geometric mean, and the verdict (regression, improvement,
    within noise): a shift where the interval excludes 1 and every rung moved beyond the floor the same way."""
    from scipy import stats  # only compare needs it

    out = []
    for cls in ("gpu", "host", "cpu"):
        mine = [r for r in rows if judged(r) and r.get("class") == cls]
        logs = np.log([r["ratio"] for r in mine])
        if len(logs) < RUN_SHIFT_MIN_CELLS:
            continue
        half = stats.t.ppf(0.975, len(logs) - 1) * logs.std(ddof=1) / np.sqrt(len(logs))
        low, high = np.exp(logs.mean() - half), np.exp(logs.mean() + half)
        ratio, needed = float(np.exp(logs.mean())), max(threshold, RUN_SHIFT_FLOOR[cls])
        by_rung = {rung: float(np.exp(np.mean(np.log([r["ratio"] for r in mine if r.get("rung") == rung]))))
                   for rung in dict.fromkeys(r.get("rung") for r in mine)}
        call = verdict(ratio, float(low), float(high), needed)
        if any(verdict(x, x, x, needed) != call for x in by_rung.values()):
            call = "within noise"  # one rung's draw, not the run's
        out.append({"class": cls, "cells": len(logs), "ratio": ratio, "ci_low": float(low), "ci_high": float(high),
                    "threshold": needed, "rungs": by_rung, "verdict": call})
    return out


def shift_line(shift: dict) -> str:
    rungs = shift.get("rungs") or {}
    each = f"; by rung {', '.join(f'{r} {x:.2f}' for r, x in rungs.items())}" if len(rungs) > 1 else ""
    return (f"run level, {shift['class']} cells ({shift['cells']}): B/A geometric mean {shift['ratio']:.3f} (95% CI "
            f"{shift['ci_low']:.3f}-{shift['ci_high']:.3f}, t over the cells, floor {shift['threshold']:.0%}{each}): "
            f"{shift['verdict']}")


def contended(records: list[dict]) -> bool:
    return any(record.contended(r) for r in records)


def mean_median(records: list[dict]) -> float:
    return float(np.mean([r["latency_ms"]["median"] for r in records]))


def judged(row: dict) -> bool:
    return row["verdict"] in ("regression", "improvement", "within noise")


def regressions(rows: list[dict]) -> int:
    return sum(row["verdict"].startswith("regression") for row in rows)


def display(row: dict, terminal: bool = False) -> dict[str, str]:
    """The row as the tables show it; the terminal's is narrower (fits 80 columns with the rung's name whole):
    milliseconds in five characters, the interval to two decimals, the floor without the word, host-boundness
    left to the basis."""
    def ms(v):  # the terminal: five characters at most, four or more significant digits
        return ("" if v is None else f"{v:.3f}" if not terminal or v < 10 else
                f"{v:.{max(0, 4 - len(str(int(v))))}f}")

    ci = "" if row["ci_low"] is None else (f"{row['ci_low']:.2f}-{row['ci_high']:.2f}" if terminal else
                                            f"{row['ci_low']:.3f}-{row['ci_high']:.3f}")
    return {"rung": row["rung"], "batch": str(row["batch"]), "dtype": row["dtype"], "layout": row["layout"],
            "A ms": ms(row["a_ms"]), "B ms": ms(row["b_ms"]),
            "B/A": "" if row["ratio"] is None else f"{row['ratio']:.3f}", "95% CI": ci,
            "verdict": row["verdict"] + (" (host)" if row["host_bound"] and not terminal else ""),
            "basis": row["basis"].removeprefix("floor ") if terminal else row["basis"]}


def rich_table(rows: list[dict], title: str):
    table = Table(title=title, header_style="bold", box=box.SIMPLE_HEAD, padding=(0, 0), show_edge=False)
    shown = [display(r, terminal=True) for r in rows]
    layouts = len({r["layout"] for r in rows}) > 1
    cols = [c for c in (shown[0] if shown else ()) if c != "layout" or layouts]
    for c in cols:  # the rung's name and a rare long verdict ("regression: now crashed") wrap; a number never breaks
        table.add_column(c, no_wrap=c not in ("rung", "verdict"), max_width=12 if c == "verdict" else None,
                         justify="left" if c in ("rung", "dtype", "layout", "verdict", "basis") else "right")
    for row, d in zip(rows, shown):
        style = ("red" if row["verdict"].startswith("regression") else
                 "green" if row["verdict"] == "improvement" else None)
        table.add_row(*[Text(d[c], style=style) for c in cols])
    return table


def how_to_read(threshold: float) -> str:
    return (f"B/A = B's median latency over A's (each side: the mean of its runs' medians; above 1: B is slower). "
            f"95% CI: percentile bootstrap of that ratio, two-level where a side has several runs (runs, then each "
            f"run's raw samples), so that it carries the spread between runs. A change counts where the interval "
            f"excludes 1 and the change exceeds {threshold:.1%} and, with one run a side, the cell's noise floor "
            f"(basis 'floor N% class'): the largest change measured between runs of the same code for its class "
            f"(gpu: a GPU cell whose host issues less than {HOST_PACED:.0%} of its latency, "
            f"{NOISE_FLOOR['gpu']:.0%}; host: the other GPU cells, {NOISE_FLOOR['host']:.0%}; cpu: "
            f"{NOISE_FLOOR['cpu']:.0%}; docs/notes/compare-noise-floor.md). "
            "Basis 'N+M runs': the runs' spread is in the interval. (host) marks host-bound cells. A cell measured "
            "beside another busy process in any run (contention.flagged) shows its medians and is not judged, "
            "unless --include-contended (its basis then ends 'contended'). Run level: per class with "
            f"{RUN_SHIFT_MIN_CELLS} judged cells or more, the geometric mean of their B/A with a Student-t interval "
            "over the cells' log ratios; a shift counts where that interval excludes 1 and the mean moves by more "
            f"than the class's floor (gpu {RUN_SHIFT_FLOOR['gpu']:.0%}, host {RUN_SHIFT_FLOOR['host']:.0%}, cpu "
            f"{RUN_SHIFT_FLOOR['cpu']:.0%}) and the threshold.")


def markdown(rows: list[dict], shifts: list[dict], a: str, b: str, threshold: float) -> str:
    n = regressions(rows)
    return "\n".join([f"# Compare: B = {b} against A = {a}", "", how_to_read(threshold), "",
                      *[f"- {shift_line(s)}" for s in shifts], *([""] if shifts else []),
                      *markdown_table([display(r) for r in rows]), "",
                      f"{n} regression{'s' if n != 1 else ''}.", ""])


def split_sides(paths: list[Path]) -> tuple[list[Path], list[Path]]:
    """`A B`, or `A1 [A2 ...] -- B1 [B2 ...]` (the `--` arrives as SIDE_BREAK). Raises BadInput."""
    names = [str(p) for p in paths]
    if SIDE_BREAK in names:
        i = names.index(SIDE_BREAK)
        a, b = paths[:i], paths[i + 1:]
    elif len(paths) == 2:
        a, b = paths[:1], paths[1:]
    else:
        raise BadInput(f"give two runs (A B), or several a side with -- between them (A1 A2 -- B1 B2); got "
                       f"{len(paths)} files and no --")
    if not a or not b or SIDE_BREAK in map(str, a + b):
        raise BadInput("give at least one run on each side of a single -- (A1 A2 -- B1 B2)")
    return a, b


def load_side(paths: list[Path]) -> list[list[dict]]:
    """Each file one run. Raises BadInput."""
    runs = []
    for path in paths:
        records, _ = load_records([path])
        if not records:
            raise BadInput(f"no records in {path}")
        runs.append(records)
    return runs


NOTHING_JUDGED = 3  # the exit status when no cell could be judged: no verdict is not "no regression"


def run(paths: list[Path], threshold: float, markdown_path: Path | None, include_contended: bool = False) -> int:
    """`python -m harness compare A B` or `A1 A2 -- B1 B2`: the table, each noise class's run-level shift, a summary
    line, the markdown if asked; 1 on a regression of a cell or of a class, NOTHING_JUDGED when no cell was judged
    (the runs share none, or none was measured cleanly). Raises BadInput for files that are not results."""
    a_paths, b_paths = split_sides(paths)
    rows = compare(load_side(a_paths), load_side(b_paths), threshold, include_contended)
    a, b = " ".join(map(str, a_paths)), " ".join(map(str, b_paths))
    console = Console()
    left_out = {r["verdict"] for r in rows if r["verdict"].startswith("only in") or r["verdict"].endswith(" in both")}
    shown = [r for r in rows if r["verdict"] not in left_out]
    console.print(rich_table(shown, title=escape(f"B/A: median latency, B = {b}, A = {a}")))
    for what in sorted(left_out):
        console.print(f"{sum(r['verdict'] == what for r in rows)} cells {what} (listed in --markdown)", markup=False)
    shifts = run_shifts(rows, threshold)
    for shift in shifts:
        console.print(shift_line(shift), markup=False,
                      style="red" if shift["verdict"] == "regression" else "green" if shift["verdict"] == "improvement"
                      else None)
    n = regressions(rows)
    changed = sum(r["verdict"] == "improvement" for r in rows)
    floors = sum(r["basis"].startswith("floor") for r in rows)
    not_judged = sum(not judged(r) for r in rows)
    console.print(f"{n} regression{'s' if n != 1 else ''}, {changed} improvement{'s' if changed != 1 else ''}, "
                  f"{sum(r['verdict'] == 'within noise' for r in rows)} within noise, {not_judged} not judged "
                  f"(threshold {threshold:.1%}; 95% bootstrap CI of the ratio; {floors} cells by their noise floor, "
                  f"{sum(' runs' in r['basis'] for r in rows)} by the spread between runs)",
                  markup=False)
    if markdown_path:
        markdown_path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(markdown_path, markdown(rows, shifts, a, b, threshold))
    if n or any(s["verdict"] == "regression" for s in shifts):
        return 1
    if not any(judged(r) for r in rows):
        shared = sum(bool(r["a_runs"] and r["b_runs"]) for r in rows)
        why = ("the runs share no cell" if not shared else f"none of the {shared} cells the runs share was measured "
               "in both without a failure or other load (--include-contended judges contended ones)")
        console.print(f"nothing judged: {why}", markup=False, style="red")
        return NOTHING_JUDGED
    return 0
