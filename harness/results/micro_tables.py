"""The microbenchmark's tables (a rung's layers, timed one by one) and the side-by-sides of the census and the
layers (one column per rung), for the terminal (width-fitting rich tables) and for markdown."""
from __future__ import annotations

from rich import box
from rich.table import Table

from harness.results.tables import columns, markdown_table


def shown_columns(rows: list[dict]) -> list[str]:
    """What the terminal and the markdown show, which reads at 100 columns: each layer's name (and pass), its engine,
    its timings and, where the rows have it, its error against PyTorch's. The JSON keeps every column."""
    cols = columns(rows)
    return cols[:1] + [c for c in cols if c in ("pass", "engine", "fused", "rel_err")
                       or c.endswith(("_ms", "tflops"))]


def micro_table(title: str, rows: list[dict]) -> Table:
    """The terminal's table: names whole, numbers right-aligned, no rules between columns, so that a training step's
    rows (names up to 21 characters, 8 columns) read at 100 columns. `tuned_ms` stays in the markdown and the JSON:
    it repeats the chosen variant's `fused_ms` or `unfused_ms`."""
    shown = [c for c in shown_columns(rows) if c != "tuned_ms"]
    table = Table(title=title, caption="every column: --json", box=box.SIMPLE_HEAD)
    for i, c in enumerate(shown):
        table.add_column(c, no_wrap=i == 0, justify="right" if c.endswith(("_ms", "tflops")) or c == "engine" else
                         "left")

    def cell(v: object, c: str) -> str:
        if v is None:
            return ""
        if isinstance(v, float):
            return f"{v:.1e}" if c == "rel_err" else f"{v:.1f}" if c.endswith("tflops") else f"{v:.3f}"
        return str(v)

    for r in rows:
        table.add_row(*[cell(r.get(c), c) for c in shown])
    return table


PASS_TOTALS = "a layer's ms times how often the network runs it"


def pass_totals(rows: list[dict]) -> list[dict[str, str]]:
    """A training micro's rows summed per pass (forward, dgrad, ...) over the network, each layer's ms times its
    `count` (1 where rows are the whole schedule, as cudnn's), one column per timed rung; `all` sums a rung's column
    over the passes where every pass has it, leaving out `alternative` rows (another way of running passes that
    other rows also time). Empty for rows without passes (an inference micro)."""
    if not rows or "pass" not in rows[0]:
        return []
    timed = [c for c in columns(rows) if c.endswith("_ms") and c not in ("tuned_ms", "fused_ms", "unfused_ms")]
    passes = list(dict.fromkeys(r["pass"] for r in rows))
    sums: dict[str, dict[str, float]] = {p: {} for p in passes}  # pass -> column -> ms, for the columns it has
    untimed = {(r["pass"], c) for r in rows for c in timed if c in r and r[c] is None}  # a layer that could not run
    for r in rows:
        for c in timed:
            if r.get(c) is not None:
                sums[r["pass"]][c] = sums[r["pass"]].get(c, 0.0) + r.get("count", 1) * r[c]
    for p, c in untimed:  # no total where a layer of the pass has no time: a partial sum would read as a whole
        sums[p].pop(c, None)
    summed = [p for p in passes if not any(r.get("alternative") for r in rows if r["pass"] == p)]
    every = [c for c in timed if all(c in sums[p] for p in summed)]
    table = [{"pass": p, **{c: f"{sums[p][c]:.2f}" if c in sums[p] else "" for c in timed}} for p in passes]
    return table + [{"pass": "all", **{c: f"{sum(sums[p][c] for p in summed):.2f}" if c in every else ""
                                       for c in timed}}]


def pass_totals_table(rows: list[dict]) -> Table | None:
    totals = pass_totals(rows)
    if not totals:
        return None
    table = Table(title="per pass, summed over the network (ms)", caption=PASS_TOTALS, box=box.SIMPLE_HEAD)
    for c in totals[0]:
        table.add_column(c, justify="left" if c == "pass" else "right")
    for row in totals:
        table.add_row(*row.values())
    return table


def markdown(title: str, rows: list[dict]) -> str:
    shown = shown_columns(rows)
    totals = pass_totals(rows)
    return "\n".join([f"# {title}", "", *markdown_table([{c: "" if r.get(c) is None else r[c] for c in shown}
                                                         for r in rows]), "",
                      *([f"Per pass, summed over the network (ms): {PASS_TOTALS}.", "", *markdown_table(totals), ""]
                        if totals else []),
                      f"Every column ({', '.join(columns(rows))}): the JSON (--json).", ""])


def side_by_side_tables(title: str, caption: str, display: list[dict[str, str]], width: int) -> list[Table]:
    """A side-by-side's terminal tables, each no wider than `width`: its fixed columns (the first, group or layer,
    and a floor) with as many rung columns as fit, whole (a rung's cell cut short would hide its figures), the next
    table the next rungs; `fastest` closes the last one where it fits, else its own table."""
    if not display:
        return [Table(title=title, caption=caption, box=box.SIMPLE_HEAD)]
    names = list(display[0])
    fixed = [c for c in names if c in (names[0], "floor")]
    rungs = [c for c in names if c not in (*fixed, "fastest")]

    def wide(shown: list[str]) -> int:  # as box.SIMPLE_HEAD lays them out: each column padded by one space a side
        # and followed by a separator, plus the left edge
        return sum(max(len(c), *(len(row[c]) for row in display)) + 3 for c in shown) + 1

    chunks: list[list[str]] = [[]]
    for c in rungs:
        if chunks[-1] and wide([*fixed, *chunks[-1], c]) > width:
            chunks.append([])
        chunks[-1].append(c)
    if "fastest" in names:
        if wide([*fixed, *chunks[-1], "fastest"]) > width:
            chunks.append([])
        chunks[-1].append("fastest")
    tables = []
    for i, chunk in enumerate(chunks):
        shown = [*fixed, *chunk]
        table = Table(title=title if i == 0 else None, caption=caption if i == len(chunks) - 1 else None,
                      box=box.SIMPLE_HEAD)
        for j, c in enumerate(shown):
            table.add_column(c, justify="left" if j == 0 or c == "fastest" else "right", no_wrap=True)
        for row in display:
            table.add_row(*(row[c] for c in shown))
        tables.append(table)
    return tables


MD_RUNGS = 3  # rung columns per markdown table: 100 columns hold three


def side_by_side_markdown(display: list[dict[str, str]], key: str = "group") -> list[str]:
    """A side-by-side as markdown tables of MD_RUNGS rung columns each (after the `key` column and, in the
    first, the others that are not rungs), then the fastest rung per row."""
    if not display:
        return []
    fixed = [c for c in display[0] if c in (key, "floor")]
    rungs = [c for c in display[0] if c not in (*fixed, "fastest")]
    lines: list[str] = []
    for i in range(0, len(rungs), MD_RUNGS):
        lines += [*markdown_table([{c: row[c] for c in (fixed if i == 0 else [key])}
                                   | {c: row[c] for c in rungs[i:i + MD_RUNGS]} for row in display]), ""]
    fastest = [{key: row[key], "fastest (lead over the next)": row["fastest"]} for row in display
               if row["fastest"]]
    return lines + ([*markdown_table(fastest), ""] if fastest else [])
