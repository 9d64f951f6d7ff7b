"""`python -m harness ladder|sweep|tiers|micro|report|compare|train-to-accuracy`: the command line. It parses the
arguments and calls the function that does the work (harness/ladder.py `run`, ...); a refusal is one line on stderr
and exit status 2."""
from __future__ import annotations

import argparse
import math
import os
import sys
import warnings
from pathlib import Path

from core.cell import DTYPES, FRAMEWORK_DTYPES, TASKS
from core.env import default_device
from core.model import CLASSIFIERS
from core.mutations import FORWARD, TRAINING
from harness import accuracy, census_report, ladder, layers_report, listing, micro, mutations
from harness.child.contract import Protocol
from harness.results import compare, report
from harness.results.load import BadInput
from harness.run.executor import EXECUTORS
from harness.run.plan import LadderConfig
from harness.run.refusal import Refusal
from tiers import all_tiers

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


def _rung_dtype(tier_names: list[str]):
    """RUNG:DTYPE, an inference cell of train-to-accuracy's --infer."""
    def parse(text: str) -> tuple[str, str]:
        tier, _, dtype = text.partition(":")
        if tier not in tier_names or dtype not in DTYPES:
            raise argparse.ArgumentTypeError(f"{text!r} is not RUNG:DTYPE (rungs: {', '.join(tier_names)}; dtypes: "
                                             f"{', '.join(DTYPES)})")
        return tier, dtype
    return parse


def _rung_option(text: str) -> tuple[str, str, str]:
    """TIER:KEY=VALUE or TIER:KEY=V1,V2 (one cell per value), checked against the options the rung declares
    (tiers/base.py Tier.options)."""
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
    for each in value.split(","):
        if valid[key] is None and not (each.isdigit() and int(each) > 0):
            raise argparse.ArgumentTypeError(f"{tier}:{key} takes a positive integer, not {each!r}")
        if valid[key] is not None and each not in valid[key]:
            raise argparse.ArgumentTypeError(f"invalid choice {each!r} for {tier}:{key} (choose from "
                                             f"{', '.join(valid[key])})")
    return tier, key, value


def ladder_arguments(tier_names: list[str]) -> argparse.ArgumentParser:
    """The options `ladder` and `sweep` share."""
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
                     help="comma list from fp32,tf32,fp16,bf16,fp8 (default: fp32,tf32,bf16 on GPU, bf16 in a "
                          "sweep; fp32 on CPU; fp8: the triton rung's e4m3 convolutions, bf16 activations)")
    lad.add_argument("--layout", choices=("nchw", "nhwc", "both"), default=None,
                     help="activation layout (default: nhwc, channels-last, on GPU: every rung's best practice; "
                          "nchw on CPU)")
    lad.add_argument("--cuda-graph", choices=("off", "on", "both"), default="off",
                     help="run graph-capable rungs captured in a CUDA graph")
    lad.add_argument("--compile-mode", type=_list(str, COMPILE_MODES), default=["default"],
                     help="comma list from default,reduce-overhead,max-autotune (for the compile rung)")
    lad.add_argument("--option", type=_rung_option, action="append", default=[], metavar="TIER:KEY=VALUE",
                     help="rung-specific option, e.g. eager:cudnn-benchmark=on,off (a cell per value), "
                          "triton:autotune=off, tensorrt:trt-max-batch=512 (repeatable)")
    lad.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if a GPU is present")
    lad.add_argument("--isolation", choices=("rung", "cell"), default="rung",
                     help="rung: one process per rung measures its cells in turn, caches kept (default, fast); "
                          "cell: a fresh process with fresh caches for every cell (strict, slow)")
    lad.add_argument("--executor", choices=EXECUTORS, default="local",
                     help="local: this host, one rung's process per GPU at a time (every GPU of the host); ray: each "
                          "rung's cells a Ray task reserving one GPU (pip install -e '.[ray]')")
    lad.add_argument("--ray-address", default=None, metavar="auto|HOST:PORT",
                     help="--executor ray: the cluster to join (default: start one on this host)")
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
    lad.add_argument("--util-s", type=_number(0, low_open=False), default=None,
                     help="seconds of the utilisation pass, whose board energy gives img/J (default 2 on the GPU: "
                          "NVML's energy counter needs seconds; 0.3 on the CPU)")
    lad.add_argument("--sustain", type=_number(0, low_open=False), default=0.0, metavar="SECONDS",
                     help="GPU cells at --sustain-batch or more also run SECONDS of back-to-back load, then are "
                          "measured for 2 s more: the sustained throughput, clocks, power and img/J")
    lad.add_argument("--sustain-batch", type=_positive_int, default=256, help="smallest batch --sustain applies to")
    lad.add_argument("--e2e-iters", type=_positive_int, default=3, help="iterations of each end-to-end variant")
    lad.add_argument("--timeout", type=_number(0), default=900.0, help="seconds before a cell is killed and recorded")
    lad.add_argument("--jobs", type=_positive_int, default=os.cpu_count() or 1,
                     help="parallel jobs of the prepare stage (builds, exports, warm caches)")
    lad.add_argument("--host-probe", action="store_true",
                     help="time the host CPU's steadiness for 2 s at the start (harness.run.host_noise)")
    lad.add_argument("--out", type=Path, default=None, help="run directory (default runs/<model>-<device>); reruns "
                     "into the same directory skip cells already recorded")
    lad.add_argument("--rerun", action="store_true", help="measure again cells already recorded in --out")
    lad.add_argument("--json", type=Path, help="write the JSON document here")
    lad.add_argument("--markdown", type=Path, help="write the markdown report here")
    lad.add_argument("--csv", type=Path, help="write the table as CSV here")
    lad.add_argument("--wide", action="store_true", help="the final table with every column (default: the columns "
                     "that fit 80 columns)")

    return lad


def parser() -> argparse.ArgumentParser:
    tier_names = list(all_tiers())
    p = argparse.ArgumentParser(prog="python -m harness", description="Run one network down the abstraction ladder.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    lad = ladder_arguments(tier_names)
    sub.add_parser("ladder", parents=[lad], help="measure rungs x configurations")
    sub.add_parser("sweep", parents=[lad], help="batch x resolution (x dtype) for chosen rungs: the ladder with "
                   "sweep defaults, its latency and throughput plotted against batch size")
    sub.add_parser("tiers", help="list every rung: available here or why not")

    acc = sub.add_parser("train-to-accuracy", help="train each rung E epochs on real data from the same seed and "
                         "weights; test accuracy per epoch per rung, and a plot")
    acc.add_argument("--tiers", type=_list(str, tier_names), default=["eager", "torchscript", "compile"],
                     help="rungs that train (default: eager,torchscript,compile)")
    acc.add_argument("--model", default="resnet18", choices=CLASSIFIERS, metavar="MODEL",
                     help=f"one of {', '.join(CLASSIFIERS)} (default resnet18)")
    acc.add_argument("--epochs", type=_positive_int, default=30, help="epochs each rung trains (default 30)")
    acc.add_argument("--batch", type=_positive_int, default=64, help="images per training step (default 64)")
    acc.add_argument("--res", type=_positive_int, default=32, help="image size the data is resized to")
    acc.add_argument("--dtype", choices=FRAMEWORK_DTYPES, default=None, help="default: bf16 on GPU, fp32 on CPU")
    acc.add_argument("--data", type=Path, default=None, help="an ImageFolder tree with train/ and test/ (or val/) "
                     "(default: scikit-learn's handwritten digits, shipped with it)")
    acc.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda where a GPU is visible")
    acc.add_argument("--seed", type=int, default=0, help="initial weights and batch order")
    acc.add_argument("--out", type=Path, default=None, help="default runs/accuracy-<model>-<device>")
    acc.add_argument("--infer", type=_list(_rung_dtype(tier_names)), default=[], metavar="RUNG:DTYPE,...",
                     help="then evaluate the network eager trained on the test set with these inference cells "
                     "(e.g. triton:fp8,triton:bf16,triton:fp32), beside eager fp32: top-1 accuracy and agreement")

    cmp = sub.add_parser("compare", help="B against A, cell by cell, with a bootstrap CI of the median's ratio "
                         "(several runs a side: their spread in the interval; one: each cell's noise floor); exit "
                         "status 1 on any regression, 3 when no cell could be judged")
    cmp.add_argument("runs", type=Path, nargs="+", metavar="RUN",
                     help="ladder.json or results.jsonl files: A B (baseline, candidate), or A1 A2 ... -- B1 B2 ... "
                     "(several runs of each side)")
    cmp.add_argument("--threshold", type=_share, default=0.03,
                     help="smallest change called a regression or an improvement (default 3%%)")
    cmp.add_argument("--markdown", type=Path, help="write the comparison as markdown here")
    cmp.add_argument("--include-contended", action="store_true",
                     help="judge cells measured beside another busy process too, marked as such (default: shown, "
                          "not judged)")

    mic = sub.add_parser("micro", parents=[lad], help="where each rung's time goes: --tiers A,B,...: each rung's "
                         "kernel census side by side, by layer group; --tier NAME: a hand-written rung's per-layer "
                         "microbenchmark")
    mic.add_argument("--tier", choices=[t for t, v in all_tiers().items() if v.has_micro],
                     help="a hand-written rung's per-layer microbenchmark against cuDNN and Inductor (one batch, "
                     "default 32; res 224, bf16, nhwc; --task train: every step of its training schedule, per pass)")
    mic.add_argument("--census-steps", type=_positive_int, default=census_report.CENSUS_STEPS,
                     help="calls profiled per cell in the census pass (default %(default)s)")
    mic.add_argument("--layers", action="store_true",
                     help="with --tiers: each distinct layer alone on each rung that runs a sub-network (its "
                     "convolution, BatchNorm and epilogue), parity against eager fp32, against its roofline")
    mic.add_argument("--reps", type=_positive_int, default=50, help="--layers: timed calls per layer (default 50)")

    mut = sub.add_parser("mutations", help="the parity checks against plausible wrong networks: every mutant, "
                         "computed by each Python rung at each dtype, must fail and the right network pass; exit "
                         "status 1 if not")
    mut.add_argument("--model", default="resnet50", choices=CLASSIFIERS, metavar="MODEL",
                     help=f"one of {', '.join(CLASSIFIERS)} (default resnet50)")
    mut.add_argument("--tiers", type=_list(str, mutations.RUNGS), default=list(mutations.RUNGS),
                     help=f"comma list of the rungs checked (default {','.join(mutations.RUNGS)})")
    mut.add_argument("--batch", type=_positive_int, default=8, help="images per forward (default 8)")
    mut.add_argument("--res", type=_positive_int, default=224, help="image size (default 224)")
    mut.add_argument("--dtype", type=_list(str, DTYPES), default=list(DTYPES),
                     help=f"comma list (default {','.join(DTYPES)}; a rung skips the dtypes it lacks)")
    mut.add_argument("--mutants", type=_list(str, [m.name for m in FORWARD + TRAINING]), default=[],
                     help="by name (default: all)")
    mut.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda where a GPU is visible")
    mut.add_argument("--out", type=Path, default=None, help="where mutations.json and mutations.md go")

    rep = sub.add_parser("report", help="re-render (and merge) results.jsonl or JSON files; a census.json (from "
                         "micro --tiers) alone: its side-by-side, markdown and plot again, beside it")
    rep.add_argument("inputs", type=Path, nargs="+", metavar="RESULTS",
                     help="results.jsonl (with its run.json) or ladder.json files; later files win on the same cell")
    rep.add_argument("--json", type=Path, help="write the merged JSON document here (the source of truth)")
    rep.add_argument("--markdown", type=Path, help="write the markdown report here, its plots in plots/ beside it")
    rep.add_argument("--csv", type=Path, help="write one CSV row per cell here")
    rep.add_argument("--wide", action="store_true", help="every column in the terminal table")
    return p


def main(argv: list[str] | None = None) -> int:
    # Warnings meant for the user (a torn results line, say) as one plain line each, not Python's two
    warnings.formatwarning = lambda message, category, filename, lineno, line=None: f"warning: {message}\n"
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(sides_marked(argv))
    args.argv = argv  # recorded with the results
    try:
        return COMMANDS[args.command](args)
    except Refusal as e:
        return refuse(f"{args.command}: {e}", e.status)
    except BadInput as e:
        return refuse(f"{args.command}: {e}")
    except KeyboardInterrupt:  # a command without stages of its own to keep (ladder's keep every finished cell)
        return refuse(f"{args.command}: interrupted", 130)


def sides_marked(argv: list[str]) -> list[str]:
    """compare's `--` between A's runs and B's as compare.SIDE_BREAK: argparse drops a `--`."""
    if argv[:1] != ["compare"] or "--" not in argv:
        return argv
    i = argv.index("--")
    return [*argv[:i], compare.SIDE_BREAK, *argv[i + 1:]]


def refuse(message: str, status: int = 2) -> int:
    """A one-line error on stderr (never wrapped or styled)."""
    print(message, file=sys.stderr)
    return status


def ladder_config(args: argparse.Namespace) -> LadderConfig:
    protocol = Protocol(warmup_max=args.warmup_max, warmup_s=args.warmup_s, iters=args.iters,
                        min_time_s=args.min_time, max_time_s=max(args.max_time, args.min_time),
                        precision=args.precision, e2e_iters=args.e2e_iters, timeout_s=args.timeout,
                        sustain_s=args.sustain, sustain_batch=args.sustain_batch)
    shared = ("command", "model", "task", "tiers", "batch", "res", "dtype", "layout", "cuda_graph", "device",
              "isolation", "executor", "ray_address", "retune", "isolation_check", "jobs", "host_probe", "out",
              "rerun", "json", "markdown", "csv", "wide", "argv")
    # --compile-mode is the compile rung's option `compile-mode` (tiers/compile.py), given as a list of its own
    option = [*args.option, ("compile", "compile-mode", ",".join(args.compile_mode))]
    return LadderConfig(protocol=protocol, util_s=args.util_s, option=option,
                        **{k: getattr(args, k) for k in shared})


def micro_command(args: argparse.Namespace) -> int:
    """One configuration: a hand-written rung's per-layer table (--tier), or the census of each rung (--tiers)."""
    if (args.tier is None) == (args.tiers is None):
        raise Refusal("give --tier NAME (a hand-written rung's per-layer microbenchmark) or --tiers A,B,... (each "
                      "rung's kernel census side by side)")
    for flag in ("batch", "res", "dtype"):
        if len(getattr(args, flag) or []) > 1:
            raise Refusal(f"--{flag}: micro measures one configuration; give one value")
    if args.layout == "both":
        raise Refusal("--layout: micro measures one layout; give nchw or nhwc")
    gpu = (args.device or default_device()) == "cuda"
    one = {"batch": (args.batch or [256 if args.tiers else 32])[0], "res": (args.res or [224 if gpu else 64])[0],
           "dtype": (args.dtype or ["bf16" if gpu else "fp32"])[0]}
    if args.tier:
        micro.run(args.tier, one["batch"], one["res"], one["dtype"], args.layout != "nchw", args.task, args.json,
                  args.markdown)
        return 0
    if args.layers:
        out = args.out or Path("runs") / f"micro-layers-{args.model}-{'cuda' if gpu else 'cpu'}-b{one['batch']}-{one['dtype']}"
        return layers_report.run(args.tiers, args.model, one["batch"], one["res"], one["dtype"],
                                (args.layout or ("nhwc" if gpu else "nchw")) == "nhwc", "cuda" if gpu else "cpu",
                                out, args.reps, args.json, args.markdown)
    config = ladder_config(args)
    config.batch, config.res, config.dtype = [one["batch"]], [one["res"]], [one["dtype"]]
    config.json = config.markdown = config.csv = None  # --json, --markdown: the census's files
    config.protocol.census_steps = args.census_steps
    config.out = args.out or Path("runs") / (f"micro-{args.model}-{'cuda' if gpu else 'cpu'}-b{one['batch']}-"
                                              f"{one['dtype']}{'-train' if args.task == 'train' else ''}")
    return census_report.run(config, args.json, args.markdown)


def report_command(args: argparse.Namespace) -> int:
    if len(args.inputs) == 1 and args.inputs[0].name == "census.json":
        census_report.rerender(args.inputs[0])
    else:
        report.rerender(args.inputs, args.json, args.markdown, args.csv, args.wide)
    return 0


def accuracy_config(args: argparse.Namespace) -> accuracy.AccuracyConfig:
    return accuracy.AccuracyConfig(**{k: v for k, v in vars(args).items() if k != "command"})


def mutations_command(args: argparse.Namespace) -> int:
    device = args.device or default_device()
    config = mutations.MutationConfig(model=args.model, batch=args.batch, res=args.res, device=device,
                                      rungs=tuple(args.tiers), dtypes=tuple(args.dtype), mutants=tuple(args.mutants),
                                      train_dtypes=("fp32", "bf16") if device == "cuda" else ("fp32",))
    return 0 if mutations.caught(mutations.run(config, args.out)) else 1


COMMANDS = {
    "ladder": lambda a: ladder.run(ladder_config(a)),
    "sweep": lambda a: ladder.run(ladder_config(a)),
    "tiers": lambda a: listing.show(),
    "micro": lambda a: micro_command(a),
    "report": lambda a: report_command(a),
    "compare": lambda a: compare.run(a.runs, a.threshold, a.markdown, a.include_contended),
    "train-to-accuracy": lambda a: accuracy.run(accuracy_config(a)) or 0,
    "mutations": mutations_command,
}
