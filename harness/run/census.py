"""The kernel census of a cell: from the Chrome trace of its census pass (harness/child/profile.py in a Python rung's
child, the C++ protocol's own in a C++ rung's), each kernel with its launches, time and share of the step, kernels
per step, the GPU's busy time against the step's wall time, and the kernels' time by layer and layer group.

What counts as a kernel: on the GPU each kernel, copy and memset the trace holds (CUPTI); on the CPU each operator
with its self time (there are no kernels to count). A kernel's time is what it owns: from the later of its start
and the end of the kernel before it on its stream (`owned_time`: a dependent launch starts early and waits). Which
layer a kernel belongs to is read from the trace, innermost first, by the first of these that applies to the host
range that launched it:
- the rung's own ranges: those it adds to the trace with the layer in their args (ONNX Runtime's nodes, named by
  the exporter's module scopes; the cudnn rung's schedule);
- module scopes: the ranges the rung put around each module's forward (core.layers.module_scopes, eager);
- module hierarchy: TorchScript's own record of the module an operator came from;
- autograd: a backward operator belongs to the layer of the forward operator with its sequence number;
- convolutions in order: a convolution operator, matched to the model's convolutions by weight shape in forward
  order (backward convolutions in reverse order), where the rung calls the library's convolution (compile);
- after a convolution: a kernel of none of the above (a fused epilogue of Inductor's) belongs to the block of the
  convolution launched before it. A kernel before every convolution is left unattributed, never guessed.
The census says how much of the kernels' time each basis attributed."""
from __future__ import annotations

import bisect
import json
import re
from collections import defaultdict
from pathlib import Path
from statistics import median
from typing import Any, NamedTuple

from core.layers import BASIS, LAYER, PHASE, SCOPE, Conv, block_of, group_of
from harness.child.contract import CENSUS_STEP

KERNEL_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
HOST_CATS = ("cpu_op", "user_annotation")
CONV_OPS = ("aten::convolution", "aten::convolution_backward")
BACKWARD = "autograd::engine::evaluate_function"
LOSS_OPS = ("aten::cross_entropy_loss", "aten::nll_loss", "aten::nll_loss_nd", "aten::nll_loss_forward",
            "aten::nll_loss_backward", "aten::log_softmax", "aten::_log_softmax", "aten::_log_softmax_backward_data")
GROUP_ORDER = ("stem", "layer1", "layer2", "layer3", "layer4", "head", "loss", "optimizer", "unattributed")
# A census with more of its kernel time than this in no known layer is shown, but neither ranked nor compared by
# group: its groups hold only what could be placed (ONNX Runtime's renamed NHWC convolutions, say), so their
# times would read as wins they are not.
UNATTRIBUTED_LIMIT = 0.05
_HIERARCHY = re.compile(r"([^.():]+)\([^)]*\)::")


class Unit(NamedTuple):
    """What the census counts: a kernel (GPU), or an operator's self time (CPU)."""

    name: str
    start: float  # µs
    dur: float
    launched: float  # when its host range launched it (a CPU operator: its start)
    host: Host | None  # the range that launched it


class Host:
    """A host range (operator or annotation) of the trace, with its parent range on the same thread."""

    __slots__ = ("ev", "ts", "end", "parent", "layer")

    def __init__(self, ev: dict) -> None:
        self.ev, self.ts, self.end = ev, float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0))
        self.parent: Host | None = None
        self.layer: str | None = None  # a convolution operator's: the model's convolution it computes

    @property
    def name(self) -> str:
        return self.ev["name"]

    def ancestors(self):
        h: Host | None = self
        while h is not None:
            yield h
            h = h.parent


def load(path: Path) -> list[dict]:
    """The complete ('X') events of a Chrome trace."""
    doc = json.loads(Path(path).read_text())
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and "ts" in e]


def nest(events: list[dict]) -> dict[Any, list[Host]]:
    """Host ranges per thread, sorted by start, each with its innermost enclosing range as parent."""
    threads: dict[Any, list[Host]] = defaultdict(list)
    for e in events:
        if e.get("cat") in HOST_CATS:
            threads[(e.get("pid"), e.get("tid"))].append(Host(e))
    for hosts in threads.values():
        hosts.sort(key=lambda h: (h.ts, -h.end))
        stack: list[Host] = []
        for h in hosts:
            while stack and stack[-1].end < h.ts:
                stack.pop()
            h.parent = stack[-1] if stack else None
            stack.append(h)
    return threads


def innermost(hosts: list[Host], starts: list[float], t: float) -> Host | None:
    """The innermost range of one thread that contains time t."""
    i = bisect.bisect_right(starts, t) - 1
    h = hosts[i] if i >= 0 else None
    while h is not None and h.end < t:
        h = h.parent
    return h


def module_path(hierarchy: str) -> str:
    """'TOP(ResNet)::forward.layer1(Sequential)::forward.0(Bottleneck)::...' -> 'layer1.0...'"""
    return ".".join(_HIERARCHY.findall(hierarchy)[1:])


def conv_weight(h: Host) -> tuple[int, ...] | None:
    """The weight's shape of a convolution operator (forward: its second input; backward: its third)."""
    dims = (h.ev.get("args") or {}).get("Input Dims") or []
    i = 1 if h.name == "aten::convolution" else 2
    return tuple(dims[i]) if len(dims) > i and dims[i] else None


def match_convolutions(hosts: list[Host], convs: tuple[Conv, ...]) -> None:
    """Names each convolution operator (outermost of its kind) by the model's convolution of its weight shape, in
    forward order; backward convolutions from the end."""
    by_shape: dict[tuple, list[str]] = defaultdict(list)
    for c in convs:
        by_shape[c.weight].append(c.path)
    taken: dict[tuple[str, tuple], int] = defaultdict(int)
    for h in hosts:
        if h.name not in CONV_OPS or any(a.name == h.name for a in list(h.ancestors())[1:]):
            continue
        shape = conv_weight(h)
        paths = by_shape.get(shape or ())
        if not paths:
            continue
        n = taken[(h.name, shape)]
        taken[(h.name, shape)] += 1
        backward = h.name.endswith("_backward")
        k = len(paths) - 1 - n % len(paths) if backward else n % len(paths)
        h.layer = paths[k]


def resolve(h: Host | None, forward_layers: dict[int, tuple[str, str]]) -> tuple[str | None, str | None, str,
                                                                             str | None]:
    """(layer, basis, phase, convolution) of the host range that launched a kernel: the first basis of the module's
    docstring that applies, innermost range first; `convolution`: the model's convolution it is part of, if any."""
    chain = list(h.ancestors()) if h is not None else []
    phase = "backward" if any(a.name.startswith(BACKWARD) or a.name.endswith("_backward") for a in chain) \
        else "forward"
    conv = next((a.layer for a in chain if a.layer), None)
    if any(a.name.startswith("Optimizer.") for a in chain):
        return "optimizer", "optimizer step", "optimizer", None
    for a in chain:
        args = a.ev.get("args") or {}
        if args.get(LAYER):  # a rung's own ranges (ONNX Runtime's nodes, the cudnn rung's schedule)
            return args[LAYER], args.get(BASIS, "the rung's profiler"), args.get(PHASE, phase), conv
        if a.ev.get("cat") == "user_annotation" and a.name.startswith(SCOPE):
            return a.name[len(SCOPE):], "module scopes", phase, conv
        path = module_path(args.get("Module Hierarchy", ""))
        if path:
            return path, "module hierarchy", phase, conv
    for a in chain:
        seq = (a.ev.get("args") or {}).get("Sequence number")
        if a.name.startswith(BACKWARD) and seq in forward_layers:
            layer, basis = forward_layers[seq]
            return layer, f"autograd ({basis})", phase, conv
    if conv:
        return conv, "convolutions in order", phase, conv
    if any(a.name in LOSS_OPS for a in chain):
        return "loss", "loss operators", phase, None
    return None, None, phase, None


def summarise(events: list[dict], convs: tuple[Conv, ...], group_flops: dict[str, int] | None, batch: int,
              train: bool, group_bytes: dict[str, int] | None = None) -> dict[str, Any]:
    """The census of a trace (see the module's docstring). `group_flops`: FLOPs of one image's forward per group
    (core.flops.flops_per_group), for TFLOP/s per group; `group_bytes`: each group's floor of memory traffic for
    the batch (inference), for the GB/s it moves at least."""
    threads = nest(events)
    starts = {tid: [h.ts for h in hosts] for tid, hosts in threads.items()}
    all_hosts = sorted((h for hs in threads.values() for h in hs), key=lambda h: h.ts)
    steps = sorted((h for h in all_hosts if h.name == CENSUS_STEP), key=lambda h: h.ts)
    if not steps:
        raise ValueError(f"the trace has no {CENSUS_STEP!r} range")
    for s in steps:  # each step calls every convolution once
        match_convolutions([h for h in all_hosts if s.ts <= h.ts <= s.end], convs)

    gpu = any(e.get("cat") in KERNEL_CATS for e in events)
    launches = {(e.get("args") or {}).get("correlation"): e for e in events if e.get("cat") in LAUNCH_CATS}
    units: list[Unit] = []
    if gpu:
        on_streams = []
        for e in events:
            if e.get("cat") not in KERNEL_CATS:
                continue
            launch = launches.get((e.get("args") or {}).get("correlation"))
            tid = (launch.get("pid"), launch.get("tid")) if launch else None
            host = innermost(threads[tid], starts[tid], float(launch["ts"])) if launch and tid in threads else None
            unit = Unit(e["name"], float(e["ts"]), float(e.get("dur", 0)),
                        float(launch["ts"]) if launch else float(e["ts"]), host)
            on_streams.append(((e.get("pid"), e.get("tid")), unit))
        units = owned_time(on_streams)
    else:  # the CPU: each operator's self time
        children: dict[int, float] = defaultdict(float)
        for h in all_hosts:
            if h.parent is not None and h.ev.get("cat") == "cpu_op":
                children[id(h.parent)] += h.end - h.ts
        units = [Unit(h.name, h.ts, max(h.end - h.ts - children[id(h)], 0.0), h.ts, h)
                 for h in all_hosts if h.ev.get("cat") == "cpu_op"]

    forward_layers: dict[int, tuple[str, str]] = {}
    for h in all_hosts:  # what a backward operator's sequence number points at
        seq = (h.ev.get("args") or {}).get("Sequence number")
        if seq is not None and seq not in forward_layers and not h.name.startswith("autograd::"):
            layer, basis, _, _ = resolve(h, {})
            if layer and layer != "loss":
                forward_layers[seq] = (layer, basis)

    step_of = [s.ts for s in steps]
    per_step: list[list[Unit]] = [[] for _ in steps]
    for u in units:
        i = bisect.bisect_right(step_of, u.launched) - 1
        if i >= 0 and u.launched <= steps[i].end:
            per_step[i].append(u)

    n = len(steps)
    kernel_durs: dict[str, list[float]] = defaultdict(list)
    kernel_groups: dict[str, set] = defaultdict(set)
    layers: dict[str, dict] = {}
    basis_us: dict[str, float] = defaultdict(float)
    busy, total = [], []
    for units_i in per_step:
        last_conv: str | None = None
        for u in sorted(units_i, key=lambda u: u.launched):
            layer, basis, phase, conv = resolve(u.host, forward_layers)
            last_conv = conv or last_conv
            if layer is None and last_conv is not None:
                layer, basis = block_of(last_conv), "after a convolution"
            if layer is None:
                layer, basis = "unattributed", "unattributed"
            group = layer if layer in ("optimizer", "loss", "unattributed") else group_of(layer)
            key = f"{layer} ({phase})" if train else layer
            row = layers.setdefault(key, {"layer": layer, "phase": phase, "group": group, "us": 0.0, "kernels": 0,
                                          "basis": set()})
            row["us"] += u.dur
            row["kernels"] += 1
            row["basis"].add(basis)
            basis_us[basis] += u.dur
            kernel_durs[u.name].append(u.dur)
            kernel_groups[u.name].add(group)
        # busy: time at least one kernel ran (on the CPU: at least one operator, its children included)
        busy.append(union_us([(u.start, u.start + u.dur) if gpu else (u.host.ts, u.host.end) for u in units_i]))
        total.append(sum(u.dur for u in units_i))

    kernel_us = sum(total) / n
    groups: dict[str, dict] = {}
    for row in layers.values():
        g = groups.setdefault(row["group"], {"group": row["group"], "us": 0.0, "kernels": 0})
        g["us"] += row["us"]
        g["kernels"] += row["kernels"]
    group_rows = []
    for g in sorted(groups.values(), key=lambda g: (GROUP_ORDER.index(g["group"]) if g["group"] in GROUP_ORDER
                                                    else len(GROUP_ORDER), g["group"])):
        ms = g["us"] / n / 1e3
        flops = (group_flops or {}).get(g["group"])
        nbytes = None if train else (group_bytes or {}).get(g["group"])
        group_rows.append({"group": g["group"], "ms": ms, "kernels": g["kernels"] / n,
                           "share": g["us"] / n / kernel_us if kernel_us else None,
                           "tflops": flops * batch * (3 if train else 1) / (ms * 1e-3) / 1e12 if flops and ms else None,
                           "floor_gbs": nbytes / (ms * 1e6) if nbytes and ms else None})
    walls = [s.end - s.ts for s in steps]
    return {
        "unit": "GPU kernels" if gpu else "CPU operators (self time)",
        "steps": n,
        "wall_ms": median(walls) / 1e3,
        "busy_ms": median(busy) / 1e3,
        "kernel_ms": kernel_us / 1e3,
        "host_gaps_ms": max(median(walls) - median(busy), 0.0) / 1e3,
        "kernels_per_step": sum(len(u) for u in per_step) / n,
        "attribution": {b: us / sum(total) for b, us in sorted(basis_us.items(), key=lambda kv: -kv[1])}
        if sum(total) else {},
        "groups": group_rows,
        "layers": [{**{k: v for k, v in r.items() if k not in ("us", "basis")}, "ms": r["us"] / n / 1e3,
                    "kernels": r["kernels"] / n, "basis": ", ".join(sorted(r["basis"]))} for r in layers.values()],
        "kernels": sorted(({"name": k, "launches": len(d) / n, "total_ms": sum(d) / n / 1e3,
                            "median_us": median(d), "share": sum(d) / n / kernel_us if kernel_us else None,
                            "groups": sorted(kernel_groups[k])} for k, d in kernel_durs.items()),
                          key=lambda r: -r["total_ms"]),
    }


def owned_time(on_streams: list[tuple[Any, Unit]]) -> list[Unit]:
    """Kernels (`(stream, unit)`: Kineto puts each stream on its own row) by the time each owns. One stream runs
    its kernels in order, but a dependent launch (Hopper's programmatic dependent launch) starts while the kernel
    before it still runs and waits for it: each kernel's time counts from the later of its start and the end of the
    kernel before it on its stream, so that no wait is counted twice. Without dependent launches, nothing changes."""
    ends: dict[Any, float] = {}
    owned = []
    for stream, u in sorted(on_streams, key=lambda su: su[1].start):
        start, end = max(u.start, ends.get(stream, u.start)), u.start + u.dur
        ends[stream] = max(end, ends.get(stream, end))
        owned.append(u._replace(start=start, dur=max(end - start, 0.0)))
    return owned


def union_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of intervals: the time at least one kernel ran."""
    covered, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            covered += b - max(a, end)
            end = b
    return covered


def unattributed_share(census: dict) -> float:
    return census["attribution"].get("unattributed", 0.0)


def comparable(census: dict) -> bool:
    """Whether a census's layer groups hold (nearly) all of its kernel time, so that a group compares with another
    rung's."""
    return unattributed_share(census) <= UNATTRIBUTED_LIMIT
