"""`python -m harness ladder|tiers|micro|report`: the command line."""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

from harness.model import CLASSIFIERS
from tiers.base import DTYPES, TASKS, Cell

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


def _resolutions(text: str) -> list[int]:
    if "x" in text.lower():
        raise argparse.ArgumentTypeError(f"{text!r}: HxW is not supported, the ladder's inputs are square; give "
                                         "one size per resolution, e.g. --res 224")
    return _list(int)(text)


def _number(low: float, high: float = math.inf, low_open: bool = True):
    """argparse type for a finite float in (low, high] (or [low, high] with low_open=False)."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(v) or v > high or (v <= low if low_open else v < low):
            bound = f"{'>' if low_open else '>='} {low:g}" + (f" and <= {high:g}" if math.isfinite(high) else "")
            raise argparse.ArgumentTypeError(f"{text} must be a finite number {bound}")
        return v
    return parse


def _share(text: str) -> float:
    """'3%' or 0.03: a share in [0, 1)."""
    value = _number(0, low_open=False)(text.rstrip("%"))
    value = value / 100 if text.endswith("%") else value
    if value >= 1:
        raise argparse.ArgumentTypeError(f"{text} must be below 100% (e.g. 3% or 0.03)")
    return value


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

    lad = argparse.ArgumentParser(add_help=False)  # what ladder and sweep share
    lad.add_argument("--model", default="resnet50", choices=CLASSIFIERS, metavar="MODEL",
                     help=f"torchvision classifier ({', '.join(CLASSIFIERS)})")
    lad.add_argument("--task", choices=TASKS, default="infer",
                     help="infer: each timed call is one forward; train: one training step (forward, "
                          "cross-entropy, backward, SGD with momentum) on the rungs that train")
    lad.add_argument("--tiers", type=_list(str, tier_names), default=None,
                     help=f"comma list from {', '.join(tier_names)} (default: all)")
    lad.add_argument("--batch", type=_list(int), default=None,
                     help="comma list (ladder default: 1,32,256 on GPU, 1 on CPU; sweep default: 8 to 1024 in "
                          "powers of two on GPU, 1 to 16 on CPU, the sizes that fit)")
    lad.add_argument("--res", type=_resolutions, default=None, help="comma list (default: 224 on GPU; 64 on CPU)")
    lad.add_argument("--dtype", type=_list(str, DTYPES), default=None,
                     help="comma list from fp32,tf32,fp16,bf16 (default: fp32,tf32,bf16 on GPU, bf16 in a sweep; "
                          "fp32 on CPU)")
    lad.add_argument("--layout", choices=("nchw", "nhwc", "both"), default=None,
                     help="activation layout (default: nhwc, channels-last, on GPU: every rung's best practice; "
                          "nchw on CPU)")
    lad.add_argument("--cuda-graph", choices=("off", "on", "both"), default="off",
                     help="run graph-capable rungs captured in a CUDA graph")
    lad.add_argument("--compile-mode", type=_list(str, COMPILE_MODES), default=["default"],
                     help="comma list from default,reduce-overhead,max-autotune (for the compile rung)")
    lad.add_argument("--option", type=_rung_option, action="append", default=[], metavar="TIER:KEY=VALUE",
                     help="rung-specific option, e.g. triton:autotune=off, tensorrt:trt-max-batch=512 (repeatable)")
    lad.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if a GPU is present")
    lad.add_argument("--isolation", choices=("rung", "cell"), default="rung",
                     help="rung: one process per rung measures its cells in turn, caches kept (default, fast); "
                          "cell: a fresh process with fresh caches for every cell (strict, slow)")
    lad.add_argument("--retune", action="store_true",
                     help="ignore the tuning choices shipped for this GPU (Triton configs, cuDNN engines): search "
                          "them cold and keep them in the run's cache")
    lad.add_argument("--isolation-check", choices=("warn", "error"), default="warn",
                     help="a cell measured beside another busy process (CPU or GPU) is flagged (warn) or also "
                          "refused, its timings withheld (error)")
    lad.add_argument("--iters", type=_positive_int, default=10, help="fewest timed iterations per cell")
    lad.add_argument("--min-time", type=_number(0, low_open=False), default=0.1,
                     help="fewest seconds of timed iterations per cell")
    lad.add_argument("--max-time", type=_number(0), default=1.0,
                     help="most seconds of timed iterations per cell if the median is not yet known to --precision")
    lad.add_argument("--precision", type=_number(0, 1), default=0.01,
                     help="stop timing once the median's 95%% confidence interval is within this share of it")
    lad.add_argument("--warmup-max", type=_positive_int, default=200, help="most warm-up iterations")
    lad.add_argument("--warmup-s", type=_number(0, low_open=False), default=1.0,
                     help="most warm-up seconds (unless still under 5 calls)")
    lad.add_argument("--util-s", type=_number(0, low_open=False), default=0.3,
                     help="seconds of the utilisation pass")
    lad.add_argument("--e2e-iters", type=_positive_int, default=3, help="iterations of each end-to-end variant")
    lad.add_argument("--timeout", type=_number(0), default=900.0, help="seconds before a cell is killed and recorded")
    lad.add_argument("--jobs", type=_positive_int, default=os.cpu_count() or 1,
                     help="parallel jobs of the prepare stage (builds, exports, warm caches)")
    lad.add_argument("--host-probe", action="store_true",
                     help="time the host CPU's steadiness for 2 s at the start (harness.host_noise)")
    lad.add_argument("--out", type=Path, default=None, help="run directory (default runs/<model>-<device>); reruns "
                     "into the same directory skip cells already recorded")
    lad.add_argument("--rerun", action="store_true", help="measure again cells already recorded in --out")
    lad.add_argument("--json", type=Path, help="write the JSON document here")
    lad.add_argument("--markdown", type=Path, help="write the markdown report here")
    lad.add_argument("--csv", type=Path, help="write the table as CSV here")
    lad.add_argument("--wide", action="store_true", help="the final table with every column (default: the columns "
                     "that fit 80 columns)")

    sub.add_parser("ladder", parents=[lad], help="measure rungs x configurations")
    sub.add_parser("sweep", parents=[lad], help="batch x resolution (x dtype) for chosen rungs: the ladder with "
                   "sweep defaults, its latency and throughput plotted against batch size")
    sub.add_parser("tiers", help="list every rung: available here or why not")

    acc = sub.add_parser("train-to-accuracy", help="train each rung E epochs on real data from the same seed and "
                         "weights; test accuracy per epoch per rung, and a plot")
    acc.add_argument("--tiers", type=_list(str, tier_names), default=["eager", "torchscript", "compile"],
                     help="rungs that train (default: eager,torchscript,compile)")
    acc.add_argument("--model", default="resnet18", choices=CLASSIFIERS, metavar="MODEL")
    acc.add_argument("--epochs", type=_positive_int, default=8)
    acc.add_argument("--batch", type=_positive_int, default=64)
    acc.add_argument("--res", type=_positive_int, default=32, help="image size the data is resized to")
    acc.add_argument("--dtype", choices=DTYPES, default=None, help="default: bf16 on GPU, fp32 on CPU")
    acc.add_argument("--data", type=Path, default=None, help="an ImageFolder tree with train/ and test/ (or val/) "
                     "(default: scikit-learn's handwritten digits, shipped with it)")
    acc.add_argument("--device", choices=("cuda", "cpu"), default=None)
    acc.add_argument("--seed", type=int, default=0, help="initial weights and batch order")
    acc.add_argument("--out", type=Path, default=None, help="default runs/accuracy-<model>-<device>")

    cmp = sub.add_parser("compare", help="B against A, cell by cell, with a bootstrap CI of the median's ratio; "
                         "exit status 1 on any regression")
    cmp.add_argument("a", type=Path, help="baseline: ladder.json or results.jsonl")
    cmp.add_argument("b", type=Path, help="candidate: ladder.json or results.jsonl")
    cmp.add_argument("--threshold", type=_share, default=0.03,
                     help="smallest change called a regression or an improvement (default 3%%)")
    cmp.add_argument("--markdown", type=Path, help="write the comparison as markdown here")

    mic = sub.add_parser("micro", help="per-layer microbenchmark of a hand-written rung")
    mic.add_argument("--tier", required=True, choices=[t for t, v in all_tiers().items() if hasattr(v, "micro")])
    mic.add_argument("--batch", type=_positive_int, default=32)
    mic.add_argument("--res", type=_positive_int, default=224)
    mic.add_argument("--dtype", choices=DTYPES, default="bf16")
    mic.add_argument("--layout", choices=("nchw", "nhwc"), default="nhwc")
    mic.add_argument("--json", type=Path)
    mic.add_argument("--markdown", type=Path)

    rep = sub.add_parser("report", help="re-render (and merge) results.jsonl or JSON files")
    rep.add_argument("inputs", type=Path, nargs="+")
    rep.add_argument("--json", type=Path)
    rep.add_argument("--markdown", type=Path)
    rep.add_argument("--csv", type=Path)
    rep.add_argument("--wide", action="store_true", help="every column in the terminal table")
    return p


def main(argv: list[str] | None = None) -> int:
    import warnings

    # Warnings meant for the user (a torn results line, say) as one plain line each, not Python's two
    warnings.formatwarning = lambda message, category, filename, lineno, line=None: f"warning: {message}\n"
    args = parser().parse_args(argv)
    return {"ladder": cmd_ladder, "sweep": cmd_ladder, "tiers": cmd_tiers, "micro": cmd_micro, "report": cmd_report,
            "compare": cmd_compare, "train-to-accuracy": cmd_accuracy}[args.command](args)


def cmd_tiers(args) -> int:
    """A table of rung, cuda, cpu that fits 80 columns, then one line per rung: what it is, and why not where it
    cannot run (a reason every rung shares, such as no GPU, is said once)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from tiers import all_tiers

    gpu = default_device() == "cuda"
    console = Console()
    table = Table(title="Rungs of the ladder", box=box.SIMPLE_HEAD, pad_edge=False)
    for c in ("rung", "cuda", "cpu", "what"):
        table.add_column(c, no_wrap=c != "what")
    reasons = []
    for name, tier in all_tiers().items():
        cells = []
        for device in ("cuda", "cpu"):
            reason = tier.availability(device)
            if device == "cuda" and not gpu:  # the rung's own reason too: what else a GPU machine would need
                reason = "; ".join(filter(None, ["no NVIDIA GPU here (NVML found none)", reason]))
            cells.append(Text("yes", style="green") if reason is None else Text("no", style="red"))
            if reason:
                reasons.append((name, device, reason))
        table.add_row(name, *cells, Text(tier.summary))
    console.print(table)
    console.print("Why not:", markup=False)
    for name, device, reason in reasons:
        console.print(f"  {name} on {device}: {reason}", markup=False)
    return 0


SWEEP_BATCHES = {"cuda": [8, 16, 32, 64, 128, 256, 512, 1024], "cpu": [1, 2, 4, 8, 16]}


def plan(args, device: str) -> list[Cell]:
    from tiers import all_tiers

    gpu = device == "cuda"
    sweep = args.command == "sweep"
    tiers = args.tiers or list(all_tiers())
    batches = args.batch or (SWEEP_BATCHES[device] if sweep else [1, 32, 256] if gpu else [1])
    resolutions = args.res or ([224] if gpu else [64])
    dtypes = args.dtype or ((["bf16"] if sweep else ["fp32", "tf32", "bf16"]) if gpu else ["fp32"])
    layouts = {"nchw": [False], "nhwc": [True], "both": [False, True]}[args.layout or ("nhwc" if gpu else "nchw")]
    graphs = {"off": [False], "on": [True], "both": [False, True]}[args.cuda_graph]
    cells = []
    for tier, layout, dtype, batch, res, graph in itertools.product(tiers, layouts, dtypes, batches, resolutions,
                                                                    graphs):
        given = tuple((k, v) for t, k, v in args.option if t == tier)
        option_sets = ([tuple(sorted((("compile-mode", m),) + given)) for m in args.compile_mode]
                       if tier == "compile" else [tuple(sorted(given))])
        for opts in option_sets:
            if graph and not all_tiers()[tier].cuda_graph:
                continue  # --cuda-graph on/both adds graphed cells for the rungs that have that mode
            cells.append(Cell(tier=tier, model=args.model, batch=batch, res=res, dtype=dtype,
                              channels_last=layout, cuda_graph=graph, device=device, options=opts,
                              task=args.task))
    return cells


def refuse(message: str) -> int:
    """A one-line error on stderr (never wrapped or styled), exit status 2."""
    print(message, file=sys.stderr)
    return 2


class Refused(Exception):
    """A one-line reason the ladder will not start (bad path, locked directory, a configuration that cannot fit)."""


def check_output_paths(args) -> None:
    """--out must be (or become) a writable directory; --json/--markdown/--csv writable files, not directories."""
    out = args.out
    if out.exists() and not out.is_dir():
        raise Refused(f"--out {out}: exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise Refused(f"--out {out}: cannot create it ({e.strerror})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise Refused(f"--out {out}: not writable")
    for flag in ("json", "markdown", "csv"):
        path = getattr(args, flag)
        if path is None:
            continue
        if path.is_dir():
            raise Refused(f"--{flag} {path}: is a directory; give a file name")
        parent = path.parent if str(path.parent) else Path(".")
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise Refused(f"--{flag} {path}: cannot create {parent} ({e.strerror})") from None
        if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise Refused(f"--{flag} {path}: not writable")


def memory_limits(model: str, res: int, device: str) -> list[tuple[str, int, int]]:
    """(where, capacity bytes, bytes per image) for each memory a cell's batch fills: on the GPU its activations,
    on the host the input file with its pageable and pinned copies (e2e pass); on the CPU both in host memory."""
    from harness.env import gpu_handle
    from harness.memory import activation_bytes_per_image, host_available_bytes

    try:
        act = activation_bytes_per_image(model, res)
    except Exception:  # the model cannot run at this size: its cells record the eager reference's failure
        return []
    nv, h = gpu_handle()
    device_total = nv.nvmlDeviceGetMemoryInfo(h).total if device == "cuda" and h is not None else None
    inp = 3 * res * res * 4
    return ([("GPU memory", device_total, act)] if device_total else []) + [
        ("host memory", host_available_bytes(), 3 * inp if device == "cuda" else act + inp)]


def fitting(model: str, cells: list[Cell], device: str, drop: bool) -> list[Cell]:
    """The cells whose batch fits in 80% of each memory it fills. drop=False refuses the run if one does not,
    naming the largest batch that would; drop=True (a sweep) leaves such cells out, saying which."""
    kept = []
    for res in sorted({c.res for c in cells}):
        limits = [(where, capacity, per) for where, capacity, per in memory_limits(model, res, device) if capacity]
        largest = min((int(0.8 * capacity // per), where, capacity, per) for where, capacity, per in limits) \
            if limits else None
        for c in (c for c in cells if c.res == res):
            if largest is None or c.batch <= largest[0]:
                kept.append(c)
                continue
            fits, where, capacity, per = largest
            message = (f"batch {c.batch} at res {res} needs about {c.batch * per / 2**30:.1f} GiB of {where} "
                       f"({capacity / 2**30:.1f} GiB here); the largest batch that fits is about {fits}")
            if not drop:
                raise Refused(message)
            print(f"sweep: left out: {message}", file=sys.stderr)
    return kept


def run_identity(meta: dict) -> dict:
    """What must match for a rerun to add cells to an existing run directory."""
    env = meta["environment"]
    return {"model": meta.get("model"), "device": env.get("device"), "gpu": (env.get("gpu") or {}).get("name"),
            **{k: env.get(k) for k in ("torch", "torch_cuda", "cudnn", "triton", "onnxruntime", "python")},
            "source": (env.get("source") or {}).get("digest"), "isolation": meta.get("isolation"),
            "protocol": meta.get("protocol")}


def cmd_ladder(args) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from harness import report
    from harness.env import device_slug, environment
    from harness.runner import Context, Protocol, RunDir, RunLocked, measure_cells, ordered, prepare
    from harness import proc as procs

    t_start = time.perf_counter()
    console = Console()
    device = args.device or default_device()
    if device == "cuda" and default_device() != "cuda":
        return refuse("ladder: --device cuda: no NVIDIA GPU visible (NVML found none); valid here: cpu")
    suffix = ("-sweep" if args.command == "sweep" else "") + ("-train" if args.task == "train" else "")
    args.out = (args.out or Path("runs") / f"{args.model}-{device}{suffix}").resolve()
    protocol = Protocol(warmup_max=args.warmup_max, warmup_s=args.warmup_s, iters=args.iters,
                        min_time_s=args.min_time, max_time_s=max(args.max_time, args.min_time),
                        precision=args.precision, util_s=args.util_s, e2e_iters=args.e2e_iters,
                        timeout_s=args.timeout)
    cells = plan(args, device)
    try:
        check_output_paths(args)
        run = RunDir(args.out, args.model, device)
        run.lock()
        cells = fitting(args.model, cells, device, drop=args.command == "sweep")
    except (Refused, RunLocked) as e:
        return refuse(f"ladder: {e}")

    env = environment(device, host_probe=args.host_probe)
    meta = {"model": args.model, "isolation": args.isolation, "environment": env,
            "protocol": dataclasses.asdict(protocol),
            "peak_tflops": {"datasheet": (env.get("gpu") or {}).get("datasheet_peak_tflops")}}
    meta_path = run.path / "run.json"
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        before, now = run_identity(old), run_identity(meta)
        differ = [k for k in now if before.get(k) != now[k]]
        if differ:
            return refuse(f"ladder: {run.path} holds a run with another {', '.join(differ)}; its cells would be "
                          "mislabelled: give another --out")
        meta = old
    else:
        if device == "cuda":
            with console.status("measuring the GPU's matmul peak (cuBLAS)"):
                peak_file = run.path / "peak.json"
                from harness.runner import REPO, child_env

                proc = procs.run([sys.executable, "-m", "harness.reference", "peak", str(peak_file)], cwd=REPO,
                                 env=child_env(), capture_output=True, text=True)
                if proc.returncode != 0:
                    print(f"ladder: measuring the matmul peak failed: {' '.join(proc.stderr.split())[-500:]}",
                          file=sys.stderr)
                    return 1
                meta["peak_tflops"]["measured"] = json.loads(peak_file.read_text())["tflops"]
        meta_path.write_text(json.dumps(meta, indent=1))
    run.write_weights(args.task)

    done = {} if args.rerun else run.done()
    todo = [c for c in cells if c.identity not in done]
    console.print(f"{len(cells)} cells ({len(cells) - len(todo)} already recorded in {run.path}), {args.model} on "
                  f"{device}, one process per {args.isolation}", markup=False)
    planned = {c.identity for c in cells}
    records = {k: v for k, v in done.items() if k in planned}

    def stop(signum, _frame):  # SIGTERM (timeout, a batch scheduler) and SIGHUP end the ladder as Ctrl-C does
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)
    ctx = Context(run=run, protocol=protocol, isolation=args.isolation, peak_tflops=meta.get("peak_tflops"),
                  tunings=None if args.retune else device_slug(env), isolation_check=args.isolation_check)
    groups = ordered(todo)
    interrupted = False
    builds: dict = {}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as progress:
        try:
            if args.isolation == "rung" and todo:
                task = progress.add_task("prepare", total=None)
                t = time.perf_counter()
                builds = prepare(ctx, groups, args.jobs,
                                 on_progress=lambda s: progress.update(task, description=escape(f"prepare: {s}")))
                progress.update(task, description=f"prepare: done in {time.perf_counter() - t:.0f} s", total=1,
                                completed=1)
            task = progress.add_task("ladder", total=len(todo))

            def on_phase(cell: Cell, ph: str) -> None:
                progress.update(task, description=escape(f"{cell.label} b{cell.batch} r{cell.res} {cell.dtype}: {ph}"))

            ctx.on_phase = on_phase

            def on_record(rec: dict) -> None:
                run.append(rec)
                records[Cell.of_record(rec).identity] = rec
                line = (f"{rec['latency_ms']['median']:.3f} ms" if rec["status"] == "ok" else
                        f"{rec['status']}: {rec.get('reason')}")
                flag = "  (contended)" if (rec.get("contention") or {}).get("flagged") else ""
                progress.console.print(f"  {rec['label']:26.26s} b{rec['batch']:<4d} {rec['dtype']:5s} "
                                       f"{rec['layout']} {line[:200]}{flag}", markup=False,
                                       style=None if rec["status"] == "ok" else "red")
                progress.advance(task)

            for tier_cells in groups.values():
                measure_cells(ctx, tier_cells, on_record)
        except KeyboardInterrupt:  # the cell in flight is recorded as interrupted; every finished one is kept
            interrupted = True
    if interrupted:
        console.print(f"interrupted: {sum(r['status'] != 'interrupted' for r in records.values())} of {len(cells)} "
                      f"cells recorded in {run.path}; the same command goes on from there", markup=False,
                      style="yellow")
    ordered_records = [records[c.identity] for c in cells if c.identity in records]
    wall = time.perf_counter() - t_start
    doc = report.document(ordered_records, meta["environment"], meta["protocol"],
                          {"peak_tflops": meta.get("peak_tflops"), "isolation": meta.get("isolation"),
                           "command": " ".join(["python -m harness", *sys.argv[1:]]), "wall_s": wall,
                           "builds": builds})
    what = " (training steps)" if args.task == "train" else ""
    if ordered_records:
        console.print(report.rich_table(ordered_records, wide=args.wide,
                                        title=f"{args.model}{what} on {device_slug(meta['environment'])}"))
    for line in report.failure_lines(ordered_records):
        console.print(line, markup=False, style="red", overflow="ellipsis", no_wrap=True)
    for line in report.fastest_lines(ordered_records):
        console.print(line, markup=False)
    if meta["environment"].get("host_cpu"):
        console.print(report.host_cpu_line(meta["environment"]["host_cpu"]), markup=False)
    report.write(doc, args.json or run.path / "ladder.json", args.markdown or run.path / "ladder.md", args.csv)
    console.print(f"{wall:.0f} s. JSON: {args.json or run.path / 'ladder.json'}  markdown: "
                  f"{args.markdown or run.path / 'ladder.md'}", markup=False)
    if args.retune and (run.path / "cache").is_dir():
        console.print(f"tunings of this run: {run.path / 'cache'}/<rung>/ (tuned.json, engines.tsv); to ship them "
                      f"for this GPU, copy them to kernels/tunings/{device_slug(env)}/<rung>.json|tsv",
                      markup=False)
    return 130 if interrupted else 0


def cmd_report(args) -> int:
    from rich.console import Console

    from harness import report

    try:
        records, meta = report.load_records(args.inputs)
    except report.BadInput as e:
        return refuse(f"report: {e}")
    if not records:
        return refuse(f"report: no records in {', '.join(map(str, args.inputs))}")
    one_run = {k: meta[k] for k in ("isolation", "command", "wall_s", "builds") if k in meta and len(args.inputs) == 1}
    doc = report.document(records, meta.get("environment", {}), meta.get("protocol", {}),
                          {"peak_tflops": meta.get("peak_tflops"), "runs": meta["runs"], **one_run})
    console = Console()
    console.print(report.rich_table(records, wide=args.wide))
    for line in report.failure_lines(records):
        console.print(line, markup=False, style="red", overflow="ellipsis", no_wrap=True)
    report.write(doc, args.json, args.markdown, args.csv)
    return 0


def cmd_compare(args) -> int:
    from rich.console import Console

    from harness import compare, report

    loaded = []
    for path in (args.a, args.b):
        try:
            records, _ = report.load_records([path])
        except report.BadInput as e:
            return refuse(f"compare: {e}")
        if not records:
            return refuse(f"compare: no records in {path}")
        loaded.append(records)
    rows = compare.compare(*loaded, threshold=args.threshold)
    console = Console()
    both = [r for r in rows if not r["verdict"].startswith("only in")]
    console.print(compare.rich_table(both, title=f"B/A: median latency, B = {args.b}, A = {args.a}"))
    for side in ("A", "B"):
        alone = sum(r["verdict"] == f"only in {side}" for r in rows)
        if alone:
            console.print(f"{alone} cells only in {side} (listed in --markdown)", markup=False)
    n = compare.regressions(rows)
    changed = sum(r["verdict"] == "improvement" for r in rows)
    console.print(f"{n} regression{'s' if n != 1 else ''}, {changed} improvement{'s' if changed != 1 else ''}, "
                  f"{sum(r['verdict'] == 'within noise' for r in rows)} within noise (threshold "
                  f"{args.threshold:.1%}; 95% bootstrap CI of the median's ratio)", markup=False)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(compare.markdown(rows, str(args.a), str(args.b), args.threshold))
    return 1 if n else 0


def cmd_accuracy(args) -> int:
    import torch
    import torchvision
    from rich.console import Console

    from harness import accuracy, report
    from harness.env import environment
    from harness.plots import accuracy_curves
    from harness.worker import set_math_mode
    from tiers import all_tiers

    device = args.device or default_device()
    if device == "cuda" and default_device() != "cuda":
        return refuse("train-to-accuracy: --device cuda: no NVIDIA GPU visible (NVML found none); valid here: cpu")
    dtype = args.dtype or ("bf16" if device == "cuda" else "fp32")
    out = (args.out or Path("runs") / f"accuracy-{args.model}-{device}").resolve()
    try:
        x_train, y_train, x_test, y_test, data = (accuracy.image_folder(args.data, args.res) if args.data
                                                  else accuracy.digits(args.res))
    except (ValueError, OSError) as e:
        return refuse(f"train-to-accuracy: {e}")
    if args.batch > len(y_train):
        return refuse(f"train-to-accuracy: --batch {args.batch} exceeds the {len(y_train)} training images")
    console = Console()
    torch.manual_seed(args.seed)
    initial = torchvision.models.get_model(args.model, weights=None, num_classes=data["classes"])
    set_math_mode(dtype)
    results, skipped = [], {}
    for name in args.tiers:
        tier = all_tiers()[name]
        cell = Cell(tier=name, model=args.model, batch=args.batch, res=args.res, dtype=dtype,
                    channels_last=device == "cuda", device=device, task="train")
        reason = tier.availability(device) or tier.supports(cell)
        if reason or tier.kind != "python":
            skipped[name] = reason or f"{name} trains in its own program, which takes no dataset yet"
            console.print(f"{name}: skipped: {skipped[name]}", markup=False, style="yellow")
            continue
        torch._dynamo.reset()
        results.append(accuracy.train_rung(
            tier, initial, (x_train, y_train, x_test, y_test), cell, args.epochs, args.seed,
            lambda c, e: console.print(f"  {c.label:12s} epoch {e['epoch']:2d}: test accuracy "
                                       f"{100 * e['test_accuracy']:5.1f}%, train loss {e['train_loss']:.3f}, "
                                       f"{e['epoch_s']:.1f} s", markup=False)))
    doc = {"model": args.model, "device": device, "dtype": dtype, "epochs": args.epochs, "batch": args.batch,
           "res": args.res, "seed": args.seed, "data": data, "environment": environment(device),
           "recipe": "the step of harness/train.py (SGD, momentum 0.9, weight decay 1e-4, lr 0.1 x batch / 256), "
                     "full shuffled batches; accuracy by the eager model in eval mode with the rung's weights",
           "command": " ".join(["python -m harness", *sys.argv[1:]]), "rungs": results, "skipped": skipped}
    out.mkdir(parents=True, exist_ok=True)
    (out / "accuracy.json").write_text(json.dumps(doc, indent=1))
    plot = accuracy_curves(doc, out / "plots" / "accuracy.png") if results else None
    table = [{"rung": r["rung"], **{f"epoch {c['epoch']}": f"{100 * c['test_accuracy']:.1f}" for c in r["curve"]},
              "train s": f"{sum(c['epoch_s'] for c in r['curve']):.1f}", "build s": f"{r['build_s']:.1f}"}
             for r in results]
    lines = [f"# Train to accuracy: {args.model} on {data['dataset']}", "",
             f"{data['train_images']} training and {data['test_images']} test images, {data['classes']} classes; "
             f"{args.epochs} epochs at batch {args.batch}, res {args.res}, {dtype}, on {device}, seed {args.seed}. "
             f"Recipe: {doc['recipe']}. Test accuracy (top-1, %) after each epoch:", "",
             *report.markdown_table(table), ""]
    lines += [f"- {name}: skipped: {reason}" for name, reason in skipped.items()]
    if plot:
        lines += ["", "![test accuracy per epoch](plots/accuracy.png)", ""]
    (out / "accuracy.md").write_text("\n".join(lines))
    for r in results:
        console.print(f"{r['rung']}: {100 * r['final_test_accuracy']:.1f}% test accuracy after {args.epochs} "
                      "epochs", markup=False)
    console.print(f"JSON: {out / 'accuracy.json'}  markdown: {out / 'accuracy.md'}", markup=False)
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
    rows = tier.micro(args.batch, args.res, args.dtype, args.layout == "nhwc")
    # The terminal shows each layer's name and its timings; --json and --markdown keep every column.
    cols = report.columns(rows)
    shown = cols[:1] + [c for c in cols if c.endswith(("_ms", "tflops"))]
    table = Table(title=f"{args.tier}: per-layer microbenchmark, batch {args.batch}, res {args.res}, {args.dtype}",
                  caption="every column: --json, --markdown")
    for c in shown:
        table.add_column(c, overflow="fold")
    for r in rows:
        table.add_row(*[f"{r[c]:.3f}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in shown])
    Console().print(table)
    if args.json:
        args.json.write_text(json.dumps({"environment": environment("cuda"), "tier": args.tier, "batch": args.batch,
                                         "res": args.res, "dtype": args.dtype, "rows": rows}, indent=1))
    if args.markdown:
        md = report.markdown_table(rows)
        args.markdown.write_text(f"# {args.tier} microbenchmark (batch {args.batch}, res {args.res}, "
                                 f"{args.dtype})\n\n" + "\n".join(md) + "\n")
    return 0
