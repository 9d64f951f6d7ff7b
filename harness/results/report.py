"""Reports from the records: the JSON document (the source of truth), markdown, CSV and the rich table, and the
`report` command that re-renders them (harness/results/load.py reads the files, harness/results/derive.py the
figures)."""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from core.cell import DTYPES, layout_name
from core.files import write_text_atomic
from harness.results.columns import csv_rows, how_to_read, rows
from harness.results.derive import (BASELINE_DTYPE, CROSS_GPU, CROSS_RUN, MIXED_DTYPE, PEAK_SPREAD, clock_lines,
                                    eager_baseline, fastest_lines, speedup, speedups)
from harness.results.load import BadInput, load_records
from harness.results.plots import write_plots
from harness.results.tables import markdown_table, drop_empty_columns
from harness.run.record import CONTENDED_MARK, contended, contended_line, document, ranked
from harness.run.status import NOT_RUN, Status


PIVOT_STATUS = {Status.SKIPPED: "-", Status.UNAVAILABLE: "n/a", Status.TIMEOUT: "timeout",
                Status.INTERRUPTED: "stopped"}


def pivot_cell(r: dict | None, base: dict | None, with_rate: bool) -> str:
    """One rung x dtype cell: median ms, and at the largest batch also img/s and the speed-up over eager; else a
    short status word."""
    if r is None:
        return ""
    if r["status"] != Status.OK:
        return PIVOT_STATUS.get(r["status"], "FAIL")
    if not ranked(r):
        return "interp."
    mark = CONTENDED_MARK if contended(r) else ""
    ms = f"{r['latency_ms']['median']:.2f} ms"
    if not with_rate:
        return ms + mark
    x = speedup(base, r)
    return f"{ms}, {r['throughput_img_s']:,.0f} img/s" + (f", {x:.2f}x" if x else "") + mark


def pivot_markdown(records: list[dict]) -> list[str]:
    """The comparison first: for each task and batch size (and resolution and layout, where the run has several),
    one row per rung and one column per dtype; milliseconds per call, and at the largest batch img/s with the
    speed-up over eager. Rungs with no cell measured are named once under their table."""
    def group(r: dict) -> tuple:
        return r.get("task", "infer"), r["res"], r["channels_last"], r["batch"]

    dtypes = [d for d in DTYPES if any(r["dtype"] == d for r in records)]
    several_layouts = len({r["channels_last"] for r in records}) > 1
    out = []
    for key in sorted({group(r) for r in records}):
        task, res, channels_last, batch = key
        cells = [r for r in records if group(r) == key]
        largest = batch == max(r["batch"] for r in records if group(r)[:3] == key[:3])
        layout = f", {layout_name(channels_last)}" if several_layouts else ""
        unit = "median ms per call, img/s and speed-up over eager" if largest else "median ms per call"
        out += [f"### {task}, batch {batch}, res {res}{layout}: {unit}", ""]
        table, absent = [], []
        for label in dict.fromkeys(r["label"] for r in cells):
            row = {"rung": label}
            for d in dtypes:
                r = next((c for c in cells if c["label"] == label and c["dtype"] == d), None)
                row[d] = pivot_cell(r, eager_baseline(records, r) if r else None, largest)
            if all(row[d] in ("", "-", "n/a") for d in dtypes):
                absent.append(label)
            else:
                table.append(row)
        out += markdown_table(table) + [""]
        if absent:
            out += [f"Not measured here (the reasons: below): {', '.join(absent)}.", ""]
    return out


def host_cpu_line(host: dict) -> str:
    return (f"Host CPU at the start of the run: a fixed pure-Python chunk took {host['p10_ms']:.2f} ms (p10) to "
            f"{host['p90_ms']:.2f} ms (p90) on {len(host['cpus'])} CPUs, p90/p10 = {host['p90_over_p10']:.2f} "
            f"(1 = steady); host-bound cells move with the host.")


def markdown(doc: dict, plots: list[tuple[str, str]] = ()) -> str:
    """`plots`: (caption, path relative to the markdown file), embedded after the table."""
    env = doc["environment"]
    gpu = env.get("gpu") or {}
    merged = len(doc.get("runs") or []) > 1  # then env is the last input's: each run's start is its own
    models = sorted({r["model"] for r in doc["results"]}) or [doc.get("model") or "no cell recorded"]
    lines = [f"# Tier ladder: {', '.join(models)}", "",
             f"Generated {doc['generated']}"
             + (f" from a run started {env['started_utc']}" if env.get("started_utc") and not merged else "")
             + f" on **{gpu.get('name', 'CPU: ' + str(env.get('cpu')))}**"
             + (f" (driver {gpu.get('driver')}, CUDA driver {gpu.get('cuda_driver')})" if gpu else "") + ".",
             f"torch {env.get('torch')} (CUDA {env.get('torch_cuda')}, cuDNN {env.get('cudnn')}), "
             f"torchvision {env.get('torchvision')}, Triton {env.get('triton')}, ONNX Runtime "
             f"{env.get('onnxruntime')}, TensorRT {env.get('tensorrt') or 'not installed'}.", ""]
    if doc.get("command"):
        took = (f" ({doc['wall_s']:.0f} s, one process per {doc.get('isolation') or 'rung'})"
                if doc.get("wall_s") else "")
        lines += [f"Command: `{doc['command']}`{took}", ""]
    runs = doc.get("runs") or []
    if len(runs) > 1:
        lines += [f"Merged from {len(runs)} runs (the `run` field of each JSON record says which):"]
        for i, run in enumerate(runs):
            labels = sorted({r["label"] for r in doc["results"] if r.get("run") == i})
            e = run.get("environment") or {}
            host = (e.get("host_cpu") or {}).get("p90_over_p10")
            started = f"started {e['started_utc']}, " if e.get("started_utc") else ""
            where = (e.get("gpu") or {}).get("name", e.get("cpu"))
            lines += [f"- run {i} ({started}{where}, torch {e.get('torch')}, ONNX "
                      f"Runtime {e.get('onnxruntime')}{f', host CPU p90/p10 {host:.2f}' if host else ''}; "
                      f"{run['source']}): {', '.join(labels) or 'superseded'}"]
        lines += [""]
    elif env.get("host_cpu"):
        lines += [host_cpu_line(env["host_cpu"]), ""]
    peaks = (doc.get("peak_tflops") or {}).get("measured")
    if peaks:
        lines += ["Measured cuBLAS matmul rate (TFLOP/s): " + ", ".join(f"{k} {v:.0f}" for k, v in peaks.items()), ""]
    if not doc["results"]:
        return "\n".join(lines + ["No cell was recorded: the run ended before its first cell did.", ""])
    lines += [f"- {line}" for line in fastest_lines(doc["results"])] + [""]
    if busy := contended_line(doc["results"]):
        lines += [f"**{busy}**", ""]
    lines += [x for line in clock_lines(doc["results"]) for x in (line, "")]
    lines += pivot_markdown(doc["results"])
    table = rows(doc["results"])
    lines += ["## Every cell", ""] + markdown_table(drop_empty_columns(table))
    if any(MIXED_DTYPE in row["vs eager"] + row["vs fw"] for row in table):
        over = ", ".join(sorted(set(BASELINE_DTYPE.values())))
        lines += ["", f"{MIXED_DTYPE} a mixed comparison: this cell's dtype over a {over} cell (eager and the "
                  "frameworks have no fp8: an fp8 cell is stated against them in its activations' type)."]
    if any(CROSS_RUN in row["vs eager"] for row in table):
        lines += ["", f"{CROSS_RUN} this rung and eager come from different runs and one of the two is host-bound: "
                  "the speed-up divides two draws of the host's speed. Compare such cells within one run."]
    if any(CROSS_GPU in row["vs eager"] for row in table):
        lines += ["", f"{CROSS_GPU} this rung and eager ran on two GPUs of different models, or whose measured "
                  f"matmul rates differ by more than {PEAK_SPREAD:.0%}: the speed-up divides two machines. Compare "
                  "such cells on one GPU."]
    lines += ["", how_to_read(any(r["device"] == "cuda" for r in doc["results"])), ""]
    for caption, rel in plots:
        lines += [f"## {caption}", "", f"![{caption}]({rel})", ""]
    return "\n".join(lines)


def to_csv(doc: dict) -> str:
    """Machine-readable: one row per record, numbers unformatted (harness/results/columns.py: the columns and their
    values), the speed-ups with whether they divide two runs' host-bound draws or two different GPUs."""
    buf = io.StringIO()
    csv.writer(buf).writerows(csv_rows(doc["results"]))
    return buf.getvalue()


COMPACT = ["rung", "batch", "dtype", "layout", "median ms", "img/s", "vs eager", "vs fw", "bound", "parity"]


SHORT_STATUS = {Status.PARITY_FAIL: "FAIL", Status.INTERRUPTED: "stopped"}  # fits the compact table's 9-wide column


def rich_table(records: list[dict], title: str = "Tier ladder", wide: bool = False):
    """The terminal table. Compact (default): the COMPACT columns, one space apart, which fit 80 columns; a
    failure shows its status in red (its reason is a line of `failure_lines`), and rungs that are unavailable
    here or skip a cell are left to those lines. `wide`: every column and every record. Every cell is plain
    text, never rich markup (reasons quote paths in brackets)."""
    table = Table(title=title, header_style="bold", box=box.SIMPLE_HEAD, padding=(0, 0), show_edge=False)
    shown = records if wide else [r for r in records if r["status"] not in NOT_RUN]
    all_rows = rows(records)
    by_id = {id(r): row for r, row in zip(records, all_rows)}
    mixed = len({row["task"] for row in all_rows}) > 1  # a merged report of inference and training
    resolutions = len({row["res"] for row in all_rows}) > 1  # two resolutions must not read as one cell
    cols = [c for c in (list(all_rows[0]) if wide and all_rows else COMPACT) if c != "status"
            and (c != "task" or wide or mixed)]
    if mixed and not wide:
        cols.insert(1, "task")
    if resolutions and not wide:
        cols.insert(cols.index("batch") + 1, "res")
    for c in cols:  # only the rung's name may wrap (at '(' of its options); a number or a word never breaks
        table.add_column(c, justify="left" if c in ("rung", "dtype", "layout", "parity", "bound", "start") else "right",
                         no_wrap=c != "rung", overflow="fold")  # the rung's options wrap whole, never cut to "…"
    for r in shown:
        row = {**by_id[id(r)], "rung": by_id[id(r)]["rung"].replace("(", " (", 1)}  # wraps before its options
        if r["status"] == Status.OK:  # compact: the parity verdict alone (its error is in the wide table and the JSON)
            table.add_row(*[Text(row[c].split()[0] if c == "parity" and not wide and row[c] else row[c])
                            for c in cols])
        else:
            status = SHORT_STATUS.get(r["status"], r["status"]) if not wide else r["status"]
            table.add_row(*[Text(status if c == "median ms" else row[c] if c in ("rung", "batch", "dtype", "layout")
                                 else "", style="red") for c in cols])
    return table


def print_table(console: Console, table: Table, wide: bool) -> None:
    """The compact table fits the terminal; the wide one keeps every column whole at its natural width (the
    terminal wraps its lines, `less -S` scrolls them) rather than squeezing the rung's name out."""
    if wide:  # rich renders no wider than its console: a console as wide as the table, on the same output
        width = console.measure(table, options=console.options.update_width(10**4)).maximum
        console = Console(width=max(console.width, width), file=console.file, force_terminal=console.is_terminal,
                          color_system=console.color_system)
    console.print(table)


def progress_line(rec: dict) -> str:
    """One line per finished cell in the live progress: its median, or its failure and reason."""
    line = (f"{rec['latency_ms']['median']:.3f} ms" if rec["status"] == Status.OK else
            f"{rec['status']}: {rec.get('reason')}")
    flag = "  (contended)" if (rec.get("contention") or {}).get("flagged") else ""
    return f"  {rec['label']:22.22s} b{rec['batch']:<4d} {rec['dtype']:5s} {rec['layout']} {line[:300]}{flag}"


def failure_lines(records: list[dict]) -> list[str]:
    """One line per rung and reason: which cells failed, and why (a rung unavailable here is one line, not one per
    cell)."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if r["status"] != Status.OK:
            groups.setdefault((r["label"], r["status"], " ".join(str(r.get("reason") or "").split())), []).append(r)
    lines = []
    for (label, status, reason), rs in groups.items():
        one = rs[0]
        cells = (f"b{one['batch']} {one['dtype']} {one.get('layout') or layout_name(one['channels_last'])}"
                 if len(rs) == 1 else f"{len(rs)} cells")
        lines.append(f"{label} {cells}: {status}: {reason}")
    return lines


def ray_line(records: list[dict]) -> str | None:
    """What Ray cost per unit of the run (--executor ray): dispatch and return, median and largest."""
    units = {(r["tier"], r["ray"]["dispatch_s"]): r["ray"] for r in records if r.get("ray")}
    if not units:
        return None
    dispatch = sorted(u["dispatch_s"] for u in units.values())
    back = sorted(u["return_s"] for u in units.values())
    return (f"Ray: {len(units)} tasks; to start one {dispatch[len(dispatch) // 2]:.2f} s median "
            f"({dispatch[-1]:.2f} s most), its records back {back[len(back) // 2] * 1e3:.0f} ms median")


def write(doc: dict, json_path: Path | None, md_path: Path | None, csv_path: Path | None) -> list[Path]:
    """The files asked for; the markdown report gets its plots in plots/ beside it. Returns the plots written."""
    plots: list = []

    def md() -> str:
        plots.extend(write_plots(doc, md_path.parent / "plots"))
        return markdown(doc, [(c, str(p.relative_to(md_path.parent))) for c, p in plots])

    def document() -> str:  # each record with its speed-ups (derived: a merged report derives them again)
        records = doc["results"]
        return json.dumps({**doc, "results": [{**r, "speedups": speedups(records, r)} for r in records]}, indent=1)

    texts = ((json_path, document), (csv_path, lambda: to_csv(doc)), (md_path, md))
    for path, text in texts:  # the JSON first: it is the source of truth
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(path, text())
    return [p for _, p in plots]


def rerender(inputs: list[Path], json_path: Path | None, md_path: Path | None, csv_path: Path | None,
             wide: bool) -> None:
    """`python -m harness report`: merges results files, shows the table, writes what is asked. Raises BadInput."""
    records, meta = load_records(inputs)
    if not records:
        raise BadInput(f"no records in {', '.join(map(str, inputs))}")
    one_run = {k: meta[k] for k in ("isolation", "command", "wall_s", "builds") if k in meta and len(inputs) == 1}
    doc = document(records, meta.get("environment", {}), meta.get("protocol", {}),
                          {"peak_tflops": meta.get("peak_tflops"), "runs": meta["runs"], **one_run})
    console = Console()
    print_table(console, rich_table(records, wide=wide), wide)
    for line in failure_lines(records):
        console.print(line, markup=False, style="red", overflow="ellipsis", no_wrap=True)
    if busy := contended_line(records):
        console.print(busy, markup=False, style="yellow")
    for line in clock_lines(records):
        console.print(line, markup=False, style="yellow")
    write(doc, json_path, md_path, csv_path)
