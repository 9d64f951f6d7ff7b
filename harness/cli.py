"""`python -m harness ladder|tiers|micro|report`: the command line."""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path

from harness.model import CLASSIFIERS
from tiers.base import DTYPES, Cell

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")


def _list(kind, choices=None):
    """argparse type for comma-separated lists whose items must be among `choices` (error names them)."""
    def parse(text: str):
        items = [kind(x) for x in text.split(",") if x]
        if not items:
            raise argparse.ArgumentTypeError("empty list")
        for x in items:
            if choices is not None and x not in choices:
                raise argparse.ArgumentTypeError(f"invalid choice {x!r} (choose from {', '.join(map(str, choices))})")
            if kind is int and x <= 0:
                raise argparse.ArgumentTypeError(f"{x} must be a positive integer")
        return items
    return parse


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{v} must be a positive integer")
    return v


def _rung_option(text: str) -> tuple[str, str, str]:
    """TIER:KEY=VALUE, checked against the options the rung declares (tiers/base.py Tier.options)."""
    from tiers import all_tiers

    tier, _, rest = text.partition(":")
    key, _, value = rest.partition("=")
    tiers = all_tiers()
    if tier not in tiers or not rest:
        with_options = [f"{n}:{k}" for n, t in tiers.items() for k in t.options]
        raise argparse.ArgumentTypeError(f"{text!r} is not TIER:KEY=VALUE (rung options: {', '.join(with_options)})")
    valid = tiers[tier].options
    if (tier, key) == ("compile", "compile-mode"):
        raise argparse.ArgumentTypeError("give compile modes with --compile-mode (a list)")
    if key not in valid:
        raise argparse.ArgumentTypeError(f"{tier} has no option {key!r} (valid: {', '.join(valid) or 'none'})")
    if valid[key] is None and not (value.isdigit() and int(value) > 0):
        raise argparse.ArgumentTypeError(f"{tier}:{key} takes a positive integer, not {value!r}")
    if valid[key] is not None and value not in valid[key]:
        raise argparse.ArgumentTypeError(f"invalid choice {value!r} for {tier}:{key} (choose from "
                                         f"{', '.join(valid[key])})")
    return tier, key, value


def default_device() -> str:
    from harness.env import gpu_handle

    return "cuda" if gpu_handle()[1] is not None else "cpu"


def parser() -> argparse.ArgumentParser:
    from tiers import all_tiers

    tier_names = list(all_tiers())
    p = argparse.ArgumentParser(prog="python -m harness", description="Run one network down the abstraction ladder.")
    sub = p.add_subparsers(dest="command", required=True)

    lad = sub.add_parser("ladder", help="measure rungs x configurations, one fresh process per cell")
    lad.add_argument("--model", default="resnet50", choices=CLASSIFIERS, metavar="MODEL",
                     help=f"torchvision classifier ({', '.join(CLASSIFIERS)})")
    lad.add_argument("--tiers", type=_list(str, tier_names), default=None,
                     help=f"comma list from {', '.join(tier_names)} (default: all)")
    lad.add_argument("--batch", type=_list(int), default=None, help="comma list (default: 1,32,256 on GPU; 1 on CPU)")
    lad.add_argument("--res", type=_list(int), default=None, help="comma list (default: 224 on GPU; 64 on CPU)")
    lad.add_argument("--dtype", type=_list(str, DTYPES), default=None,
                     help="comma list from fp32,tf32,fp16,bf16 (default: fp32,tf32,bf16 on GPU; fp32 on CPU)")
    lad.add_argument("--channels-last", action="store_true", help="NHWC activations and weights")
    lad.add_argument("--cuda-graph", choices=("off", "on", "both"), default="off",
                     help="run graph-capable rungs captured in a CUDA graph")
    lad.add_argument("--compile-mode", type=_list(str, COMPILE_MODES), default=["default"],
                     help="comma list from default,reduce-overhead,max-autotune (for the compile rung)")
    lad.add_argument("--option", type=_rung_option, action="append", default=[], metavar="TIER:KEY=VALUE",
                     help="rung-specific option, e.g. triton:autotune=off, tensorrt:trt-max-batch=512 (repeatable)")
    lad.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if a GPU is present")
    lad.add_argument("--iters", type=_positive_int, default=50, help="minimum timed iterations per cell")
    lad.add_argument("--min-time", type=float, default=1.0, help="minimum seconds of timed iterations per cell")
    lad.add_argument("--warmup-max", type=_positive_int, default=200, help="most warm-up iterations")
    lad.add_argument("--warmup-s", type=float, default=3.0, help="most warm-up seconds (unless still under 10 calls)")
    lad.add_argument("--util-s", type=float, default=2.0, help="seconds of the utilisation pass")
    lad.add_argument("--e2e-iters", type=_positive_int, default=20, help="iterations of each end-to-end variant")
    lad.add_argument("--timeout", type=float, default=900.0, help="seconds before a cell is killed and recorded")
    lad.add_argument("--warm-cache", action="store_true",
                     help="share Inductor/Triton caches between cells (default: fresh per cell, a true cold start)")
    lad.add_argument("--out", type=Path, default=None, help="run directory (default runs/<model>-<device>); reruns "
                     "into the same directory skip cells already recorded")
    lad.add_argument("--rerun", action="store_true", help="measure again cells already recorded in --out")
    lad.add_argument("--json", type=Path, help="write the JSON document here")
    lad.add_argument("--markdown", type=Path, help="write the markdown report here")
    lad.add_argument("--csv", type=Path, help="write the table as CSV here")

    sub.add_parser("tiers", help="list every rung: available here or why not")

    mic = sub.add_parser("micro", help="per-layer microbenchmark of a hand-written rung")
    mic.add_argument("--tier", required=True, choices=[t for t, v in all_tiers().items() if hasattr(v, "micro")])
    mic.add_argument("--batch", type=_positive_int, default=32)
    mic.add_argument("--res", type=_positive_int, default=224)
    mic.add_argument("--dtype", choices=DTYPES, default="bf16")
    mic.add_argument("--channels-last", action="store_true")
    mic.add_argument("--json", type=Path)
    mic.add_argument("--markdown", type=Path)

    rep = sub.add_parser("report", help="re-render (and merge) results.jsonl or JSON files")
    rep.add_argument("inputs", type=Path, nargs="+")
    rep.add_argument("--json", type=Path)
    rep.add_argument("--markdown", type=Path)
    rep.add_argument("--csv", type=Path)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return {"ladder": cmd_ladder, "tiers": cmd_tiers, "micro": cmd_micro, "report": cmd_report}[args.command](args)


def cmd_tiers(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from tiers import all_tiers

    table = Table(title="Rungs of the ladder")
    for c in ("rung", "what", "cuda", "cpu"):
        table.add_column(c, overflow="fold")
    for name, tier in all_tiers().items():
        cells = []
        for device in ("cuda", "cpu"):
            reason = tier.availability(device)
            cells.append("[green]available[/]" if reason is None else f"[red]unavailable[/]: {reason}")
        table.add_row(name, tier.summary, *cells)
    Console().print(table)
    return 0


def plan(args, device: str) -> list[Cell]:
    from tiers import all_tiers

    gpu = device == "cuda"
    tiers = args.tiers or list(all_tiers())
    batches = args.batch or ([1, 32, 256] if gpu else [1])
    resolutions = args.res or ([224] if gpu else [64])
    dtypes = args.dtype or (["fp32", "tf32", "bf16"] if gpu else ["fp32"])
    graphs = {"off": [False], "on": [True], "both": [False, True]}[args.cuda_graph]
    cells = []
    for tier, dtype, batch, res, graph in itertools.product(tiers, dtypes, batches, resolutions, graphs):
        given = tuple((k, v) for t, k, v in args.option if t == tier)
        option_sets = ([tuple(sorted((("compile-mode", m),) + given)) for m in args.compile_mode]
                       if tier == "compile" else [tuple(sorted(given))])
        for opts in option_sets:
            if graph and not all_tiers()[tier].cuda_graph:
                continue  # --cuda-graph on/both adds graphed cells for the rungs that have that mode
            cells.append(Cell(tier=tier, model=args.model, batch=batch, res=res, dtype=dtype,
                              channels_last=args.channels_last, cuda_graph=graph, device=device, options=opts))
    return cells


def cmd_ladder(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from harness import report
    from harness.env import device_slug, environment
    from harness.runner import Protocol, RunDir, child, run_cell

    console = Console()
    device = args.device or default_device()
    if device == "cuda" and default_device() != "cuda":
        console.print("[red]--device cuda: no NVIDIA GPU visible (NVML found none); valid here: cpu[/]")
        return 2
    protocol = Protocol(warmup_max=args.warmup_max, warmup_s=args.warmup_s, iters=args.iters,
                        min_time_s=args.min_time, util_s=args.util_s, e2e_iters=args.e2e_iters,
                        timeout_s=args.timeout)
    run = RunDir(args.out or Path("runs") / f"{args.model}-{device}", args.model, device)
    meta_path = run.path / "run.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
    else:
        env = environment(device)
        meta = {"environment": env, "protocol": dataclasses.asdict(protocol),
                "peak_tflops": {"datasheet": (env.get("gpu") or {}).get("datasheet_peak_tflops")}}
        if device == "cuda":
            with console.status("measuring the GPU's matmul peak (cuBLAS)"):
                peak_file = run.path / "peak.json"
                child([sys.executable, "-m", "harness.reference", "peak", str(peak_file)], check=True)
                meta["peak_tflops"]["measured"] = json.loads(peak_file.read_text())["tflops"]
        meta_path.write_text(json.dumps(meta, indent=1))
    cells = plan(args, device)
    done = {} if args.rerun else run.done()
    todo = [c for c in cells if c.identity not in done]
    console.print(f"[bold]{len(cells)} cells[/] ({len(cells) - len(todo)} already recorded in {run.path}), "
                  f"{args.model} on {device}")
    planned = {c.identity for c in cells}
    records = {k: v for k, v in done.items() if k in planned}
    interrupted = False
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("ladder", total=len(todo))
        try:
            for cell in todo:
                progress.update(task, description=f"{cell.label} b{cell.batch} r{cell.res} {cell.dtype}: starting")

                def on_phase(ph: str, cell=cell) -> None:
                    progress.update(task, description=f"{cell.label} b{cell.batch} r{cell.res} {cell.dtype}: {ph}")

                rec = run_cell(run, cell, protocol, on_phase=on_phase, fresh_cache=not args.warm_cache,
                               peak_tflops=meta.get("peak_tflops"))
                run.append(rec)
                records[cell.identity] = rec
                line = (f"{rec['latency_ms']['median']:.3f} ms" if rec["status"] == "ok" else
                        f"[red]{rec['status']}[/]: {rec.get('reason')}")
                progress.console.print(f"  {cell.label:28s} b{cell.batch:<4d} r{cell.res:<4d} {cell.dtype:5s} {line}")
                progress.advance(task)
        except KeyboardInterrupt:  # the cell in flight is lost (its child is killed); every finished one is kept
            interrupted = True
    if interrupted:
        console.print(f"[yellow]interrupted: {len(records)} of {len(cells)} cells recorded in {run.path}; "
                      "the same command goes on from there[/]")
    ordered = [records[c.identity] for c in cells if c.identity in records]
    doc = report.document(ordered, meta["environment"], meta["protocol"], {"peak_tflops": meta.get("peak_tflops")})
    console.print(report.rich_table(ordered, title=f"{args.model} on {device_slug(meta['environment'])}"))
    if meta["environment"].get("host_cpu"):
        console.print(report.host_cpu_line(meta["environment"]["host_cpu"]))
    report.write(doc, args.json or run.path / "ladder.json", args.markdown or run.path / "ladder.md", args.csv)
    console.print(f"JSON: {args.json or run.path / 'ladder.json'}  markdown: {args.markdown or run.path / 'ladder.md'}")
    return 130 if interrupted else 0


def cmd_report(args) -> int:
    from rich.console import Console

    from harness import report

    records, meta = report.load_records(args.inputs)
    doc = report.document(records, meta.get("environment", {}), meta.get("protocol", {}),
                          {"peak_tflops": meta.get("peak_tflops"), "runs": meta["runs"]})
    Console().print(report.rich_table(records))
    report.write(doc, args.json, args.markdown, args.csv)
    return 0


def cmd_micro(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from harness import report
    from harness.env import environment
    from tiers import get_tier

    tier = get_tier(args.tier)
    reason = tier.availability("cuda")
    if reason:
        print(f"{args.tier} micro needs the GPU: {reason}", file=sys.stderr)
        return 2
    rows = tier.micro(args.batch, args.res, args.dtype, args.channels_last)
    table = Table(title=f"{args.tier}: per-layer microbenchmark, batch {args.batch}, res {args.res}, {args.dtype}")
    for c in rows[0]:
        table.add_column(c, overflow="fold")
    for r in rows:
        table.add_row(*[f"{v:.3f}" if isinstance(v, float) else str(v) for v in r.values()])
    Console().print(table)
    if args.json:
        args.json.write_text(json.dumps({"environment": environment("cuda"), "tier": args.tier, "batch": args.batch,
                                         "res": args.res, "dtype": args.dtype, "rows": rows}, indent=1))
    if args.markdown:
        md = report.markdown_table(rows)
        args.markdown.write_text(f"# {args.tier} microbenchmark (batch {args.batch}, res {args.res}, "
                                 f"{args.dtype})\n\n" + "\n".join(md) + "\n")
    return 0
