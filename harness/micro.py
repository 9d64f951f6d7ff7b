"""`python -m harness micro`: where each rung's time goes.
- `--tiers A,B,...`: each rung's cell measured as the ladder does, then its kernel census (harness/census.py), side
  by side: a row per layer group and a column per rung, a plot, and every kernel in the JSON;
- `--tier NAME`: a hand-written rung's per-layer microbenchmark against cuDNN and Inductor, layer by layer."""
from __future__ import annotations

import json
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from core import proc as procs
from core.cell import FRAMEWORK_DTYPES, layout_name
from core.env import default_device, environment
from core.files import write_text_atomic
from core.layers import Layer, distinct_layers
from core.model import build_model, write_weights
from core.paths import REPO
from harness import ladder, plots
from harness.plan import LadderConfig
from harness.refusal import Refusal
from harness.report import columns, markdown_table
from tiers import get_tier
from tiers.base import PythonTier


def run(tier_name: str, batch: int, res: int, dtype: str, channels_last: bool, task: str, json_path: Path | None,
        md_path: Path | None) -> None:
    tier = get_tier(tier_name)
    if dtype not in FRAMEWORK_DTYPES:
        raise Refusal(f"{tier_name}'s per-layer microbenchmark times {', '.join(FRAMEWORK_DTYPES)} kernels; {dtype} "
                      "is measured in the ladder (--dtype fp8)")
    if task == "train" and tier.cannot_train:
        raise Refusal(f"{tier_name} does not train: {tier.cannot_train}")
    if default_device() != "cuda":
        raise Refusal(f"{tier_name}'s microbenchmark times GPU kernels; no NVIDIA GPU here (NVML found none)")
    reason = tier.availability("cuda")
    if reason:
        raise Refusal(f"{tier_name} cannot run on this GPU: {reason}")
    rows = tier.micro(batch, res, dtype, channels_last, task)
    what = "per-layer" if task == "infer" else "training step, per layer and pass,"
    title = f"{tier_name}: {what} microbenchmark, batch {batch}, res {res}, {dtype}"
    shown = shown_columns(rows)
    table = Table(title=title, caption="every column: --json")
    for c in shown:
        table.add_column(c, overflow="fold")
    for r in rows:
        table.add_row(*[f"{r[c]:.3f}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in shown])
    Console().print(table)
    if json_path:
        write_text_atomic(json_path, json.dumps({"environment": environment("cuda"), "tier": tier_name, "task": task,
                                                 "batch": batch, "res": res, "dtype": dtype, "rows": rows}, indent=1))
    if md_path:
        write_text_atomic(md_path, markdown(title, rows))


def shown_columns(rows: list[dict]) -> list[str]:
    """What the terminal and the markdown show, which reads at 100 columns: each layer's name (and pass), its engine
    and its timings. The JSON keeps every column."""
    cols = columns(rows)
    return cols[:1] + [c for c in cols if c in ("pass", "engine", "fused") or c.endswith(("_ms", "tflops"))]


def markdown(title: str, rows: list[dict]) -> str:
    shown = shown_columns(rows)
    return "\n".join([f"# {title}", "", *markdown_table([{c: r.get(c, "") for c in shown} for r in rows]), "",
                      f"Every column ({', '.join(columns(rows))}): the JSON (--json).", ""])


# --- the census side by side (`micro --tiers`) ---------------------------------------------------------------------

CENSUS_STEPS = 5  # calls profiled per cell: each kernel's median over them


def census_run(config: LadderConfig, json_path: Path | None, md_path: Path | None) -> int:
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
           "device": cell["device"], "census": rungs, "groups": side_by_side(rungs),
           "missing": missing_lines(doc["results"])}
    title = (f"{out['model']} {'training step' if out['task'] == 'train' else 'forward'}, batch {out['batch']}, "
             f"res {out['res']}, {out['dtype']}: time per layer group, per rung")
    display = census_display(out["groups"], rungs)
    console = Console()
    console.print(side_by_side_table(title, f"each rung: {CELL_FORMAT}; every kernel: --json", display))
    for line in out["missing"]:
        console.print(line, markup=False, style="yellow", overflow="ellipsis", no_wrap=True)
    json_path = json_path or config.out / "census.json"
    md_path = md_path or config.out / "census.md"
    plot = plots.census_groups(out, md_path.parent / "census.png")
    write_text_atomic(json_path, json.dumps(out, indent=1))
    write_text_atomic(md_path, census_markdown(title, out, display, plot))
    console.print(f"JSON: {json_path}  markdown: {md_path}" + (f"  plot: {plot}" if plot else ""), markup=False)
    return status


def missing_lines(records: list[dict]) -> list[str]:
    """One line per cell without a census, saying why (the cell's failure, or the census's)."""
    lines = []
    for r in records:
        c = r.get("census") or {}
        if not c.get("groups"):
            lines.append(f"{r['label']}: no census: " + (c.get("error") or f"{r['status']}: {r.get('reason')}"))
    return lines


def census_rungs(records: list[dict]) -> list[dict]:
    """Each measured cell's census with its rung's label and its measured latency (the timed phase's median)."""
    out = []
    for r in records:
        c = r.get("census") or {}
        if not c.get("groups"):
            continue
        measured = (r.get("latency_ms") or {}).get("median")
        out.append({"label": r["label"], "status": r["status"], "measured_ms": measured,
                    "kernels_over_measured": c["kernel_ms"] / measured if measured else None, **c})
    return out


def side_by_side(rungs: list[dict]) -> list[dict]:
    """A row per layer group: each rung's ms, kernels and TFLOP/s per step there, and the fastest rung with its
    lead over the next."""
    names = list(dict.fromkeys(g["group"] for r in rungs for g in r["groups"]))
    rows = []
    for name in names:
        row: dict[str, Any] = {"group": name, "rungs": {}}
        for r in rungs:
            g = next((g for g in r["groups"] if g["group"] == name), None)
            if g:
                row["rungs"][r["label"]] = {k: g[k] for k in ("ms", "kernels", "tflops")}
        ranked = sorted(row["rungs"].items(), key=lambda kv: kv[1]["ms"])
        if len(ranked) > 1 and ranked[0][1]["ms"] > 0 and name != "unattributed":  # time of no known layer
            row["fastest"], row["lead"] = ranked[0][0], ranked[1][1]["ms"] / ranked[0][1]["ms"]
            row["next"] = ranked[1][0]
        rows.append(row)
    return rows


CELL_FORMAT = "ms/kernels/TFLOP/s per call"


def _cell(ms: float, kernels: float, tflops: float | None) -> str:
    return f"{ms:.3g}/{kernels:.0f}/{tflops:.3g}" if tflops else f"{ms:.3g}/{kernels:.0f}/-"


def census_display(groups: list[dict], rungs: list[dict]) -> list[dict[str, str]]:
    """The side-by-side as text rows: the groups, then each rung's kernels in all, its GPU busy time against the
    profiled step's wall time, and its kernels' time against the measured latency."""
    labels = [r["label"] for r in rungs]
    rows = []
    for g in groups:
        row = {"group": g["group"], **{lab: _cell(**g["rungs"][lab]) if lab in g["rungs"] else "" for lab in labels}}
        row["fastest"] = f"{g['fastest']} {g['lead']:.2f}x" if g.get("fastest") else ""  # over the next
        rows.append(row)
    rows.append({"group": "all", **{r["label"]: _cell(r["kernel_ms"], r["kernels_per_step"], total_tflops(r))
                                    for r in rungs}, "fastest": ""})
    rows.append({"group": "busy/wall", **{r["label"]: f"{r['busy_ms']:.3g}/{r['wall_ms']:.3g}" for r in rungs},
                 "fastest": ""})
    rows.append({"group": "kern/measured", **{
        r["label"]: f"{r['kernel_ms']:.3g}/{r['measured_ms']:.3g} {r['kernel_ms'] / r['measured_ms']:.0%}"
        if r.get("measured_ms") else "" for r in rungs},
        "fastest": ""})
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
                            "the timed phase, without the profiler): near 100% for a GPU-bound cell.", 100), "",
             *side_by_side_markdown(display), *(f"- {line}" for line in doc["missing"]), ""]
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


def side_by_side_table(title: str, caption: str, display: list[dict[str, str]]) -> Table:
    """A side-by-side's terminal table: its first column (group or layer) and `fastest` left, the rungs right."""
    table = Table(title=title, caption=caption, box=box.SIMPLE_HEAD)
    for i, c in enumerate(display[0] if display else []):
        table.add_column(c, justify="left" if i == 0 or c == "fastest" else "right", no_wrap=c != "fastest")
    for row in display:
        table.add_row(*row.values())
    return table


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


def short(name: str, width: int = 48) -> str:
    """A kernel's name within `width` characters: C++ template arguments dropped first."""
    plain = re.sub(r"<.*>", "<…>", name)
    return plain if len(plain) <= width else plain[: width - 1] + "…"


# --- each layer alone, on every rung that runs a sub-network (`micro --layers`) ---------------------------------------

ELEMENT_BYTES = {"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2}


def layers_run(tiers: list[str], model: str, batch: int, res: int, dtype: str, channels_last: bool, device: str,
               out: Path, reps: int, json_path: Path | None, md_path: Path | None) -> int:
    """Each distinct layer (core.layers.distinct_layers) on each rung: a Python rung builds it as it builds the
    network, in a process of its own per rung (harness/layerbench.py), parity against eager fp32; a hand-written
    rung gives its own per-layer microbenchmark. Against each layer's roofline: its FLOPs at the measured matmul
    rate, its bytes (input, weights, output, residual once) at the measured copy bandwidth."""
    out.mkdir(parents=True, exist_ok=True)
    weights = out / "weights.safetensors"
    write_weights(build_model(model), weights)
    peaks = measure_peaks(out) if device == "cuda" else {}
    layers = distinct_layers(model, res)
    per_rung: dict[str, dict[str, dict]] = {}
    missing: list[str] = []
    console = Console()
    for name in tiers:
        tier = get_tier(name)
        reason = tier.availability(device)
        if reason:
            missing.append(f"{name}: unavailable here: {reason}")
        elif tier.has_micro:
            if device != "cuda" or dtype not in FRAMEWORK_DTYPES:
                missing.append(f"{name}: its per-layer microbenchmark times {', '.join(FRAMEWORK_DTYPES)} kernels "
                               "on the GPU")
            else:
                with console.status(f"{name}: its per-layer microbenchmark"):
                    per_rung[name] = hand_written_rows(name, tier.micro(batch, res, dtype, channels_last), layers)
        elif not isinstance(tier, PythonTier):
            missing.append(f"{name}: a program of the whole network; it builds no sub-network")
        else:
            rows_file = out / f"layers-{name}.json"
            argv = [sys.executable, "-m", "harness.layerbench", "--tier", name, "--model", model, "--batch", str(batch),
                    "--res", str(res), "--dtype", dtype, "--layout", layout_name(channels_last), "--device", device,
                    "--weights", str(weights), "--out", str(rows_file), "--reps", str(reps)]
            with console.status(f"{name}: {len(layers)} layers, each built and timed alone"):
                proc = procs.run(argv, cwd=REPO, env=procs.child_env(), capture_output=True, text=True)
            if proc.returncode != 0:
                missing.append(f"{name}: failed: {' '.join(proc.stderr.split())[-300:]}")
                continue
            per_rung[name] = {r["layer"]: r for r in json.loads(rows_file.read_text())}
    rows = layer_rows(layers, per_rung, peaks, batch, dtype)
    title = f"{model}: each layer alone, batch {batch}, res {res}, {dtype}, {layout_name(channels_last)}"
    display = layer_display(rows, list(per_rung))
    console.print(side_by_side_table(title, "ms per call (median); floor: the layer's roofline; fastest: its lead over "
                                     "the next; parity and raw samples: --json", display))
    for line in missing:
        console.print(line, markup=False, style="yellow", overflow="ellipsis", no_wrap=True)
    doc = {"environment": environment(device), "model": model, "batch": batch, "res": res, "dtype": dtype,
           "layout": layout_name(channels_last), "peaks": peaks, "layers": rows, "missing": missing}
    json_path, md_path = json_path or out / "layers.json", md_path or out / "layers.md"
    write_text_atomic(json_path, json.dumps(doc, indent=1))
    write_text_atomic(md_path, "\n".join([
        f"# {title}", "", *textwrap.wrap(
            "Each distinct convolution of the network with its BatchNorm and epilogue (relu; add+relu adds the "
            "block's shortcut, read from memory; none: the downsample), run alone. Each rung's column: median ms "
            "per call and, in brackets, the share of the layer's roofline floor it reaches (the larger of its FLOPs "
            "at the measured matmul rate and its bytes at the measured copy bandwidth). FAIL: parity against eager "
            "fp32 failed. A hand-written rung's time comes from its own per-layer microbenchmark (triton: its "
            "convolution with bias and ReLU, checked there against F.conv2d); *: one that does not check parity "
            "there (cudnn; its whole network's is checked in the ladder).", 100), "",
        *side_by_side_markdown(display, "layer"), *(f"- {line}" for line in missing), ""]))
    console.print(f"JSON: {json_path}  markdown: {md_path}", markup=False)
    return 1 if any(not (r.get("parity") or {}).get("ok", True) for d in per_rung.values() for r in d.values()) else 0


def measure_peaks(out: Path) -> dict:
    """The GPU's matmul rate per dtype and its copy bandwidth, in a process of its own (harness/reference.py)."""
    path = out / "peak.json"
    proc = procs.run([sys.executable, "-m", "harness.reference", "peak", str(path)], cwd=REPO, env=procs.child_env(),
                     capture_output=True, text=True)
    if proc.returncode != 0:
        raise Refusal(f"measuring the GPU's peaks failed: {' '.join(proc.stderr.split())[-300:]}", status=1)
    return json.loads(path.read_text())


def hand_written_rows(name: str, rows: list[dict], layers: tuple[Layer, ...]) -> dict[str, dict]:
    """A hand-written rung's per-layer microbenchmark by layer path: its rows name the layer, or its shape (then
    each layer of that shape takes the row, whatever its epilogue: the row says what it timed)."""
    by_path = {}
    for layer in layers:
        row = next((r for r in rows if r.get("layer") == layer.path), None) or next(
            (r for r in rows if r.get("shape") and layer.shape.startswith(r["shape"] + " ")), None)
        if row is not None:
            by_path[layer.path] = {"median_ms": row.get("median_ms", row.get(f"{name}_ms")),
                                   "timed": "its own per-layer microbenchmark", "row": row,
                                   **({"parity": row["parity"]} if "parity" in row else {})}
    return by_path


def layer_rows(layers: tuple[Layer, ...], per_rung: dict[str, dict[str, dict]], peaks: dict, batch: int,
               dtype: str) -> list[dict]:
    """A row per layer: its shape, count, FLOPs and bytes, its roofline floor, each rung's result."""
    rate = (peaks.get("tflops") or {}).get(dtype)
    bandwidth = peaks.get("copy_gbs")
    rows = []
    for layer in layers:
        flops, nbytes = layer.flops(batch), layer.bytes(batch, ELEMENT_BYTES[dtype])
        floor = None
        if rate and bandwidth:
            math_ms, memory_ms = flops / (rate * 1e9), nbytes / (bandwidth * 1e6)
            floor = {"ms": max(math_ms, memory_ms), "bound": "math" if math_ms >= memory_ms else "memory"}
        row = {"layer": layer.path, "shape": layer.shape, "count": layer.count, "flops": flops, "bytes": nbytes,
               "floor": floor, "rungs": {}}
        for name, results in per_rung.items():
            r = results.get(layer.path)
            if r is None:
                continue
            ms = r.get("median_ms")
            row["rungs"][name] = {**r, "tflops": flops / (ms * 1e9) if ms else None,
                                  "share_of_floor": floor["ms"] / ms if floor and ms else None}
        timed = sorted(((v["median_ms"], k) for k, v in row["rungs"].items()
                        if v.get("median_ms") and (v.get("parity") or {}).get("ok", True)))
        if len(timed) > 1:
            row["fastest"], row["lead"] = timed[0][1], timed[1][0] / timed[0][0]
        rows.append(row)
    return rows


def layer_display(rows: list[dict], rungs: list[str]) -> list[dict[str, str]]:
    def cell(r: dict | None) -> str:
        if r is None:
            return ""
        if r.get("error") or not r.get("median_ms"):
            return "error"
        text = f"{r['median_ms']:.3g}" + (f" ({r['share_of_floor']:.0%})" if r.get("share_of_floor") else "")
        if "parity" not in r:
            return text + "*"
        return text if r["parity"]["ok"] else f"FAIL {text}"

    floors = any(row["floor"] for row in rows)  # none without a GPU's peaks
    return [{"layer": f"{row['layer']} x{row['count']}",
             **({"floor": f"{row['floor']['ms']:.3g} {row['floor']['bound'][:3]}" if row["floor"] else ""}
                if floors else {}),
             **{name: cell(row["rungs"].get(name)) for name in rungs},
             "fastest": f"{row['fastest']} {row['lead']:.2f}x" if row.get("fastest") else ""} for row in rows]
