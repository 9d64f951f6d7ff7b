"""What a ladder run is: its configuration (the command line's, as data), its cells, whether they fit in memory,
and what must match for a rerun to add cells to a run directory."""
from __future__ import annotations

import itertools
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from core.cell import DTYPES, Cell
from core.env import gpu_handle
from core.memory import activation_bytes_per_image, host_available_bytes
from harness.child.contract import Protocol
from harness.run.refusal import Refusal
from tiers import all_tiers


@dataclass
class LadderConfig:
    """Everything `python -m harness ladder|sweep` takes; None means the device's default (plan)."""

    command: str = "ladder"  # or 'sweep': its batch and dtype defaults, cells that cannot fit left out
    model: str = "resnet50"
    task: str = "infer"
    tiers: list[str] | None = None
    batch: list[int] | None = None
    res: list[int] | None = None
    dtype: list[str] | None = None
    layout: str | None = None  # nchw, nhwc or both
    cuda_graph: str = "off"    # off, on or both
    option: list[tuple[str, str, str]] = field(default_factory=list)  # (rung, key, values: comma-separated)
    device: str | None = None
    isolation: str = "rung"
    executor: str = "local"  # where the rungs' processes run (harness/run/executor.py)
    ray_address: str | None = None  # --executor ray: an existing cluster ('auto', HOST:PORT); None starts one here
    retune: bool = False
    isolation_check: str = "warn"
    protocol: Protocol = field(default_factory=Protocol)
    util_s: float | None = None  # the protocol's util pass; None: the device's (harness/child/contract.py UTIL_S)
    jobs: int = os.cpu_count() or 1
    host_probe: bool = False
    out: Path | None = None
    rerun: bool = False
    json: Path | None = None
    markdown: Path | None = None
    csv: Path | None = None
    wide: bool = False
    argv: list[str] = field(default_factory=list)  # the command line that made it (recorded with the results)


def command_line(argv: list[str]) -> str:
    """What the results record as the command that made them."""
    return " ".join(["python -m harness", *argv]) if argv else "harness.ladder.run, called from Python"


SWEEP_BATCHES = {"cuda": [8, 16, 32, 64, 128, 256, 512, 1024], "cpu": [1, 2, 4, 8, 16]}


SMALLEST_WHOLE_RES = 32  # the input size below which a ResNet's last stage sees 1x1 maps (its strides multiply to 32)


def plan(args: LadderConfig, device: str) -> list[Cell]:
    """The cells of a ladder or sweep: rungs x layouts x dtypes x batches x resolutions x CUDA-graph modes x each
    rung's options (a cell per value)."""
    gpu = device == "cuda"
    sweep = args.command == "sweep"
    tiers = args.tiers or list(all_tiers())
    batches = args.batch or (SWEEP_BATCHES[device] if sweep else [1, 32, 256] if gpu else [1])
    resolutions = args.res or ([224] if gpu else [64])
    for res in (r for r in resolutions if r < SMALLEST_WHOLE_RES):
        print(f"note: at res {res} the feature maps shrink to 1x1 before the last stage (ResNet divides by 32): "
              "the network runs, but its later layers compute on single pixels", file=sys.stderr)
    dtypes = args.dtype or ((["bf16"] if sweep else ["fp32", "tf32", "bf16"]) if gpu else ["fp32"])
    layouts = {"nchw": [False], "nhwc": [True], "both": [False, True]}[args.layout or ("nhwc" if gpu else "nchw")]
    graphs = {"off": [False], "on": [True], "both": [False, True]}[args.cuda_graph]
    cells = []
    for tier in tiers:
        tier_dtypes = args.dtype or deployed_dtypes(tier, dtypes, tiers, args.task)
        for layout, dtype, batch, res, graph in itertools.product(layouts, tier_dtypes, batches, resolutions, graphs):
            given = [[(k, v) for v in values.split(",")] for t, k, values in args.option if t == tier]
            option_sets = [tuple(sorted(choice)) for choice in itertools.product(*given)]
            for opts in option_sets:
                if graph and not all_tiers()[tier].cuda_graph:
                    continue  # --cuda-graph on/both adds graphed cells for the rungs that have that mode
                cells.append(Cell(tier=tier, model=args.model, batch=batch, res=res, dtype=dtype,
                                  channels_last=layout, cuda_graph=graph, device=device, options=opts,
                                  task=args.task))
    return cells


def deployed_dtypes(tier: str, dtypes: list[str], tiers: list[str], task: str) -> list[str]:
    """A rung's default dtypes: its 16-bit cell in the type it is deployed in (`Tier.half`: fp16 for ONNX Runtime
    and TensorRT), and eager's in each such type of the planned rungs that run the task, the baseline of their
    speed-ups."""
    rungs = all_tiers()
    halves = ({rungs[t].half for t in tiers if task == "infer" or not rungs[t].cannot_train} if tier == "eager"
              else {rungs[tier].half})
    return [d for x in dtypes for d in ([h for h in DTYPES if h in halves] if x == "bf16" else [x])]


def check_output_paths(args: LadderConfig) -> None:
    """--out must be (or become) a writable directory; --json/--markdown/--csv writable files, not directories."""
    out = args.out
    if out.exists() and not out.is_dir():
        raise Refusal(f"--out {out}: exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise Refusal(f"--out {out}: cannot create it ({e.strerror})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise Refusal(f"--out {out}: not writable")
    for flag in ("json", "markdown", "csv"):
        path = getattr(args, flag)
        if path is None:
            continue
        if path.is_dir():
            raise Refusal(f"--{flag} {path}: is a directory; give a file name")
        parent = path.parent if str(path.parent) else Path(".")
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise Refusal(f"--{flag} {path}: cannot create {parent} ({e.strerror})") from None
        if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise Refusal(f"--{flag} {path}: not writable")


def memory_limits(model: str, res: int, device: str) -> list[tuple[str, int, int]]:
    """(where, capacity bytes, bytes per image) for each memory a cell's batch fills: on the GPU its activations,
    on the host the input file with its pageable and pinned copies (e2e pass); on the CPU both in host memory."""
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
            budget = f"80% of the {capacity / 2**30:.1f} GiB of {where} here"
            message = (f"batch {c.batch} at res {res} needs about {c.batch * per / 2**30:.1f} GiB of {where}, more "
                       f"than {budget}; " + (f"the largest batch that fits is about {fits}" if fits else
                                             f"even batch 1 needs {per / 2**30:.1f} GiB: choose a smaller --res"))
            if not drop:
                raise Refusal(message)
            print(f"sweep: left out: {message}", file=sys.stderr)
    return kept


def run_identity(meta: dict) -> dict:
    """What must match for a rerun to add cells to an existing run directory."""
    env = meta["environment"]
    return {"model": meta.get("model"), "device": env.get("device"), "gpu": (env.get("gpu") or {}).get("name"),
            **{k: env.get(k) for k in ("torch", "torch_cuda", "cudnn", "triton", "onnxruntime", "python")},
            "source": (env.get("source") or {}).get("digest"), "isolation": meta.get("isolation"),
            "protocol": meta.get("protocol")}
