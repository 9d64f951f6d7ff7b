"""`python -m harness micro --tiers A,B,...`: each rung's cell measured as the ladder measures it, then its kernel
census (harness/run/census.py), side by side: a row per layer group and a column per rung, a plot, and every kernel in
the JSON."""
from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path
from typing import Any

from rich.console import Console

from core.files import write_text_atomic
from harness import ladder
from harness.results import census_plot
from harness.results.micro_tables import side_by_side_markdown, side_by_side_tables
from harness.results.tables import markdown_table
from harness.run.census import comparable, unattributed_share
from harness.run.plan import LadderConfig
from harness.run.refusal import Refusal

CENSUS_STEPS = 5  # calls profiled per cell: each kernel's median over them


def run(config: LadderConfig, json_path: Path | None, md_path: Path | None) -> int:
    """Each rung's cell measured as the ladder measures it, then its census pass; one table with a row per layer
    group and a column per rung, a plot (one stacked bar per rung) and the kernels of each rung. Files go to the
    run directory unless given."""
    status = ladder.run(config)
    doc = json.loads((config.out / "ladder.json").read_text())
    rungs = census_rungs(doc["results"])
    if not rungs:
        raise Refusal(f"no cell has a census (see {config.out / 'ladder.md'})", status=status or 1)
    cell = doc["results"][0]
    out = {"environment": doc["environment"], "command": doc.get("command"), "model": cell["model"],
           "batch": cell["batch"], "res": cell["res"], "dtype": cell["dtype"], "task": cell["task"],
           "device": cell["device"], "census": rungs, "missing": missing_lines(doc["results"])}
    show_and_write(out, json_path or config.out / "census.json", md_path or config.out / "census.md")
    return status


def rerender(path: Path) -> None:
    """`python -m harness report census.json`: the side-by-side, its markdown and plot made again by this
    checkout's code, beside it, from the run's records (its ladder.json) where they are there, else from the census
    file's rungs."""
    out = json.loads(path.read_text())
    records = path.with_name("ladder.json")
    if records.is_file():  # the run's own records beside it: every field this checkout's census reads from them
        out["census"] = census_rungs(json.loads(records.read_text())["results"])
    show_and_write(out, path, path.with_suffix(".md"))


def show_and_write(out: dict, json_path: Path, md_path: Path) -> None:
    """Ranks the layer groups of out's rungs, prints the side-by-side, writes the JSON, markdown and plot."""
    rungs = out["census"]
    out["groups"], out["partial"] = side_by_side(rungs), partial_lines(rungs)
    title = (f"{out['model']} {'training step' if out['task'] == 'train' else 'forward'}, batch {out['batch']}, "
             f"res {out['res']}, {out['dtype']}: time per layer group, per rung")
    display = census_display(out["groups"], rungs)
    console = Console()
    console.print(*side_by_side_tables(title, f"each rung: {CELL_FORMAT}; every kernel: --json", display,
                                       console.width))
    for line in out["missing"] + out["partial"]:
        console.print(line, markup=False, style="yellow")
    plot = census_plot.census_groups(out, md_path.parent / "census.png")
    write_text_atomic(json_path, json.dumps(out, indent=1))
    write_text_atomic(md_path, census_markdown(title, out, display, plot))
    console.print(f"JSON: {json_path}  markdown: {md_path}" + (f"  plot: {plot}" if plot else ""), markup=False)


def missing_lines(records: list[dict]) -> list[str]:
    """One line per cell without a census, saying why (the cell's failure, or the census's)."""
    lines = []
    for r in records:
        c = r.get("census") or {}
        if not c.get("groups"):
            lines.append(f"{r['label']}: no census: " + (c.get("error") or f"{r['status']}: {r.get('reason')}"))
    return lines


def census_rungs(records: list[dict]) -> list[dict]:
    """Each measured cell's census with its rung's label, its measured latency (the timed phase's median) and its
    pipelined time per call (calls back to back, no wait between them: the GPU's time per call once the host's
    start of a call overlaps the last call's kernels)."""
    out = []
    for r in records:
        c = r.get("census") or {}
        if not c.get("groups"):
            continue
        measured = (r.get("latency_ms") or {}).get("median")
        pipelined = (r.get("pipelined") or {}).get("ms_per_iter")
        out.append({"label": r["label"], "status": r["status"], "measured_ms": measured, "pipelined_ms": pipelined,
                    "kernels_over_measured": c["kernel_ms"] / measured if measured else None,
                    "kernels_over_pipelined": c["kernel_ms"] / pipelined if pipelined else None, **c})
    return out


def side_by_side(rungs: list[dict]) -> list[dict]:
    """A row per layer group: each rung's ms, kernels and TFLOP/s per step there, and the fastest rung with its
    lead over the next, among the rungs whose groups hold nearly all of their time (comparable)."""
    names = list(dict.fromkeys(g["group"] for r in rungs for g in r["groups"]))
    ranked_labels = {r["label"] for r in rungs if comparable(r)}
    rows = []
    for name in names:
        row: dict[str, Any] = {"group": name, "rungs": {}}
        for r in rungs:
            g = next((g for g in r["groups"] if g["group"] == name), None)
            if g:
                row["rungs"][r["label"]] = {k: g[k] for k in ("ms", "kernels", "tflops")}
        ranked = sorted(((lab, v) for lab, v in row["rungs"].items() if lab in ranked_labels),
                        key=lambda kv: kv[1]["ms"])
        if len(ranked) > 1 and ranked[0][1]["ms"] > 0 and name != "unattributed":  # time of no known layer
            row["fastest"], row["lead"] = ranked[0][0], ranked[1][1]["ms"] / ranked[0][1]["ms"]
            row["next"] = ranked[1][0]
        rows.append(row)
    return rows


def partial_lines(rungs: list[dict]) -> list[str]:
    """One line per rung left out of the ranking, saying how much of its time no layer holds."""
    return [f"{r['label']}: {unattributed_share(r):.0%} of its kernel time is in no known layer, so its groups are "
            "shown (marked *) but not ranked" for r in rungs if not comparable(r)]


CELL_FORMAT = "ms/kernels/TFLOP/s per call"


def _cell(ms: float, kernels: float, tflops: float | None) -> str:
    return f"{ms:.3g}/{kernels:.0f}/{tflops:.3g}" if tflops else f"{ms:.3g}/{kernels:.0f}/-"


def census_display(groups: list[dict], rungs: list[dict]) -> list[dict[str, str]]:
    """The side-by-side as text rows: the groups, then each rung's kernels in all, its GPU busy time against the
    profiled step's wall time, and its kernels' time against the measured latency."""
    labels = [r["label"] for r in rungs]
    partial = {r["label"] for r in rungs if not comparable(r)}
    rows = []
    for g in groups:
        row = {"group": g["group"], **{lab: _cell(**g["rungs"][lab]) + ("*" if lab in partial else "")
                                       if lab in g["rungs"] else "" for lab in labels}}
        row["fastest"] = f"{g['fastest']} {g['lead']:.2f}x" if g.get("fastest") else ""  # over the next
        rows.append(row)
    rows.append({"group": "all", **{r["label"]: _cell(r["kernel_ms"], r["kernels_per_step"], total_tflops(r))
                                    for r in rungs}, "fastest": ""})
    rows.append({"group": "busy/wall", **{r["label"]: f"{r['busy_ms']:.3g}/{r['wall_ms']:.3g}" for r in rungs},
                 "fastest": ""})
    for row, key in (("kern/measured", "measured_ms"), ("kern/pipelined", "pipelined_ms")):
        rows.append({"group": row, **{r["label"]: f"{r['kernel_ms']:.3g}/{r[key]:.3g} {r['kernel_ms'] / r[key]:.0%}"
                                      if r.get(key) else "" for r in rungs}, "fastest": ""})
    return rows


def total_tflops(r: dict) -> float | None:
    known = [g for g in r["groups"] if g.get("tflops")]
    flops = sum(g["tflops"] * 1e12 * g["ms"] * 1e-3 for g in known)
    return flops / (r["kernel_ms"] * 1e-3) / 1e12 if known and r["kernel_ms"] else None


def census_markdown(title: str, doc: dict, display: list[dict[str, str]], plot: Path | None) -> str:
    """The side-by-side, the plot, and each rung's ten costliest kernels; lines within 100 columns but the
    tables' (a reader's markdown viewer wraps those)."""
    env = doc["environment"]
    where = (env.get("gpu") or {}).get("name") or f"CPU: {env.get('cpu')}"
    command = textwrap.wrap(str(doc.get("command")), 96, break_long_words=False, break_on_hyphens=False)
    lines = [f"# {title}", "", f"{where}; torch {env.get('torch')}. The command:", "", "```", " \\\n  ".join(command),
             "```", "",
             *textwrap.wrap(f"Each rung's column: {CELL_FORMAT} in that group. `fastest`: the rung with the least "
                            "time there and its lead over the next. `busy/wall` (ms): time at least one kernel ran "
                            "against the profiled call's wall time (the rest is the host's). `kern/measured` (ms, and "
                            "their ratio): the kernels' summed time against the cell's measured latency (median of "
                            "the timed phase, without the profiler): near 100% for a GPU-bound cell. "
                            "`kern/pipelined`: the same against the pipelined time per call (calls back to back), "
                            "where the host's start of a call no longer leaves the GPU idle: near 100% wherever the "
                            "census missed no kernel.", 100), "",
             *side_by_side_markdown(display),
             *(textwrap.fill(line, 100, initial_indent="- ", subsequent_indent="  ")
               for line in doc["missing"] + doc.get("partial", [])), ""]
    if plot:
        lines += [f"![where each rung's time goes]({plot.name})", ""]
    for r in doc["census"]:
        basis = ", ".join(f"{b} {s:.0%}" for b, s in r["attribution"].items())
        lines += [f"## {r['label']}: its kernels, costliest first ({min(10, len(r['kernels']))} of "
                  f"{len(r['kernels'])})", "",
                  *textwrap.wrap(f"{r['source']}; {r['unit']}; layers by: {basis}.", 100), "",
                  *markdown_table([{"kernel": short(k["name"]), "per call": f"{k['launches']:.0f}",
                                    "ms": f"{k['total_ms']:.3f}", "share": f"{k['share']:.0%}",
                                    "groups": ",".join(k["groups"]) if len(k["groups"]) < 3
                                    else f"{len(k['groups'])} groups"} for k in r["kernels"][:10]]), ""]
    return "\n".join(lines)


def short(name: str, width: int = 48) -> str:
    """A kernel's name within `width` characters: C++ template arguments dropped first."""
    plain = re.sub(r"<.*>", "<…>", name)
    return plain if len(plain) <= width else plain[: width - 1] + "…"
