"""The child contract of docs/protocol.md, written once: the protocol's knobs, the command line of a child, the lines
it prints and the keys of the result file it writes. harness/child/worker.py (Python rungs) implements it and
cpp/common/ladder/protocol.h (C++ rungs) mirrors it; tests/test_libtorch.py checks both against these constants."""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

from core import train
from core.cell import Cell

# The phases a child announces, in order (`@@phase NAME`); `census` follows `util` when --census-steps is above 0,
# and `hot` follows `after` in the cell that measures the hot start. In TIMED_PHASES the parent reads no /proc and of
# NVML only the clocks and the power (harness/run/sampler.py).
PHASES = ("load", "build", "first", "warmup", "latency", "pipelined", "e2e", "memory", "util", "after", "done")
TIMED_PHASES = ("warmup", "latency", "pipelined", "e2e")
# The keys of a measured cell's result file (--result).
# `repeatable`: whether one more call after the timed phases gave the first call's logits bit for bit, on the same
# input (None for a training step, whose state moves on).
RESULT_KEYS = frozenset({"cold", "build_stats", "stream", "warmup", "latency", "host", "pipelined", "e2e", "memory",
                         "util", "rss_peak_bytes", "repeatable"})
# With --census-steps N above 0, the census pass (after util, outside every timing): N calls, each in a range named
# CENSUS_STEP and synchronised, profiled into the Chrome trace at --census; the result then holds CENSUS_KEYS under
# "census" (steps; source: the profiler; module_scopes: whether the layers' ranges are the rung's own).
CENSUS_STEP = "census:step"
CENSUS_KEYS = frozenset({"steps", "source", "module_scopes"})
# A training rung's program trained on data (train-to-accuracy, harness/accuracy.py): --train-data FILE (x, y,
# order, lr) and --states DIR in place of the timed phases; it announces these phases and writes these result keys
# (`epochs`: each epoch's number, seconds and mean train loss), and DIR/epoch-E.safetensors after each epoch.
TRAIN_PHASES = ("load", "build", "train", "done")
WORKER = [sys.executable, "-m", "harness.child.worker"]  # the Python rungs' child program (run from the repository)
TRAIN_RESULT_KEYS = frozenset({"cold", "build_stats", "epochs"})
# A Python rung's forward evaluated on data (train-to-accuracy --infer): --eval-data FILE (x: images) in place of the
# timed phases; it announces these phases, writes every image's logits to --output and these result keys (`images`:
# how many). --calibration FILE (x: images): what an fp8 build calibrates its scales on (training images there).
EVAL_PHASES = ("load", "build", "eval", "done")
EVAL_RESULT_KEYS = frozenset({"cold", "build_stats", "images"})
# What a child prints on stdout for the parent: which cell of a `--cells` list begins, which phase, what failed.
CELL, PHASE, ERROR = "@@cell ", "@@phase ", "@@error "
# A sustained cell's figures (Protocol.sustain_s) are its util pass's last seconds: throughput from the pass's
# marks (the result's util.marks: seconds since the pass began and calls done, about every UTIL_MARK_S), clocks,
# power and energy from NVML over the same seconds; energy needs seconds to be read right (harness/run/sampler.py).
SUSTAIN_WINDOW_S = 2.0
UTIL_MARK_S = 0.25


# The util pass by device: back-to-back calls whose board energy gives img/J. NVML's energy counter moves every few
# tens of ms, so on the GPU the window is seconds long (harness/run/sampler.py energy states its error); the CPU has no
# energy counter.
UTIL_S = {"cuda": 2.0, "cpu": 0.3}
# The Protocol's fields the parent keeps to itself (the child sees their effect, not them).
PARENT_ONLY = ("timeout_s", "sustain_s", "sustain_batch")


@dataclass
class Protocol:
    """The knobs of docs/protocol.md; the same values go to every rung's child."""

    warmup_min: int = 5
    warmup_max: int = 200
    warmup_s: float = 1.0
    iters: int = 10
    min_time_s: float = 0.1
    max_time_s: float = 1.0
    max_iters: int = 5000
    precision: float = 0.01
    pipelined_iters: int = 5
    pipelined_s: float = 0.25
    e2e_iters: int = 3
    util_s: float = 2.0  # UTIL_S["cuda"]
    census_steps: int = 0  # the census pass's calls (python -m harness micro --tiers); 0: no census
    # The parent's, not the child's: a cell without a result after this is killed.
    timeout_s: float = 900.0
    # A GPU cell at sustain_batch or more runs its util pass for sustain_s + SUSTAIN_WINDOW_S: its sustained figure
    # is the last SUSTAIN_WINDOW_S, after that much load (0: none). The parent's: the child sees a longer util-s.
    sustain_s: float = 0.0
    sustain_batch: int = 256

    def sustains(self, cell: Cell) -> bool:
        return self.sustain_s > 0 and cell.device == "cuda" and cell.batch >= self.sustain_batch

    def args(self, cell: Cell) -> list[str]:
        """The child's protocol options for `cell`: a sustained cell's util pass is its load and then its window."""
        values = {**dataclasses.asdict(self),
                  "util_s": self.sustain_s + SUSTAIN_WINDOW_S if self.sustains(cell) else self.util_s}
        return [a for k, v in values.items() if k not in PARENT_ONLY for a in (f"--{k.replace('_', '-')}", str(v))]


def contract_argv(program: list[str], cell: Cell, files: dict[str, Path], protocol: Protocol,
                  extra: dict[str, str] | None = None) -> list[str]:
    """The child's command line (files: weights, input, output, result; extra: cache-dir, tunings, hot-start, ...)."""
    return program + [
        "--tier", cell.tier, "--model", cell.model, "--batch", str(cell.batch), "--res", str(cell.res),
        "--dtype", cell.dtype, "--channels-last", str(int(cell.channels_last)),
        "--cuda-graph", str(int(cell.cuda_graph)), "--device", cell.device, "--task", cell.task,
        *(a for k, v in cell.options for a in ("--option", f"{k}={v}")),
        *(a for k, v in files.items() for a in (f"--{k}", str(v))), *protocol.args(cell),
        *(("--parity-steps", str(train.K_STEPS), "--lr", repr(train.LEARNING_RATE)) if cell.task == "train" else ()),
        *(a for k, v in (extra or {}).items() for a in (f"--{k}", v))]


def parse_argv(argv: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """A child's command line back into (the contract's values by name, the rung's options)."""
    if len(argv) % 2:
        raise SystemExit(f"expected --key value pairs, got {argv}")
    kv: dict[str, str] = {}
    options: dict[str, str] = {}
    for key, value in zip(argv[::2], argv[1::2]):
        if not key.startswith("--"):
            raise SystemExit(f"bad argument {key}")
        if key == "--option":
            k, _, v = value.partition("=")
            options[k] = v
        else:
            kv[key[2:]] = value
    return kv, options


def cell_of(kv: dict[str, str], options: dict[str, str]) -> Cell:
    return Cell(tier=kv["tier"], model=kv["model"], batch=int(kv["batch"]), res=int(kv["res"]), dtype=kv["dtype"],
                channels_last=kv["channels-last"] == "1", cuda_graph=kv["cuda-graph"] == "1", device=kv["device"],
                options=tuple(sorted(options.items())), task=kv.get("task", "infer"))
