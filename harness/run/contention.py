"""What else ran on the machine while a cell was timed: CPU time of processes outside the ladder's process tree
(/proc) and processes outside it on the GPU (NVML), from the start to the end of the cell's timed phases. The tree
is the driver's, or under Ray the raylet's of the host, which started every worker measuring the ladder's units
there: the ladder's cells on a host's other GPUs are its own, as they are in a local run over several GPUs."""
from __future__ import annotations

import collections
import os
import time
from pathlib import Path
from typing import Any

from core.env import gpu_handle

CLK_TCK = os.sysconf("SC_CLK_TCK")
BUSY_CPUS = 0.5  # other processes keeping more than half a CPU busy on average during the timed phases


def _stat(pid: int | str) -> tuple[int, int] | None:
    """(ppid, CPU ticks) of a process, or None if it is gone. The ticks are its own (utime + stime) and those of
    its children that it has waited for (cutime + cstime): a child of the ladder that ends inside a cell's window
    hands its ticks to its parent, so the tree's sum never drops. Without them, a rung's process ending on another
    GPU took its whole CPU time out of 'ours' and made it 'other' (42.5 CPUs busy on a 32-core host)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), sum(int(f) for f in fields[11:15])


def process_tree(root: int) -> dict[int, int]:
    """pid -> CPU ticks of `root` and its descendants."""
    stats = {int(p): s for p in os.listdir("/proc") if p.isdigit() and (s := _stat(p)) is not None}
    tree, frontier = {root}, [root]
    children = collections.defaultdict(list)
    for pid, (ppid, _) in stats.items():
        children[ppid].append(pid)
    while frontier:
        for c in children[frontier.pop()]:
            tree.add(c)
            frontier.append(c)
    return {p: stats[p][1] for p in tree if p in stats}


def ancestor_named(name: str) -> int | None:
    """The nearest ancestor of this process whose command is `name` (/proc/PID/comm), if any."""
    pid = os.getpid()
    while pid > 1 and (stat := _stat(pid)) is not None:
        pid = stat[0]
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == name:
                return pid
        except OSError:
            return None
    return None


def _busy_ticks() -> int:
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4]  # all but idle and iowait


def gpu_process_pids(gpu: str | None = None) -> list[int] | None:
    nv, h = gpu_handle(gpu)
    if h is None:
        return None
    try:
        return [p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses(h)]
    except Exception:
        return None


class Contention:
    """Snapshots at the start and end of a cell's timed phases: CPU time of processes outside the ladder's own
    tree, and processes outside it on the GPU (NVML)."""

    def __init__(self, gpu: str | None = None, root: int | None = None) -> None:
        self.gpu = gpu  # the GPU the cell runs on (CUDA_VISIBLE_DEVICES's name; None: this process's first)
        self.root = root or os.getpid()  # the process whose tree is the ladder's own on this host
        self.start: tuple | None = None
        self.result: dict[str, Any] | None = None

    def snapshot(self) -> tuple:
        ours = process_tree(self.root)
        return time.perf_counter(), _busy_ticks(), sum(ours.values()), set(ours), gpu_process_pids(self.gpu)

    def begin(self) -> None:
        self.start = self.snapshot()

    def end(self) -> None:
        if self.start is None:
            return
        t1, busy1, ours1, tree1, gpu1 = self.snapshot()
        t0, busy0, ours0, tree0, gpu0 = self.start
        wall = max(t1 - t0, 1e-6)
        other_cpus = max(0.0, ((busy1 - busy0) - (ours1 - ours0)) / CLK_TCK / wall)
        ours = tree0 | tree1
        gpu_others = None
        if gpu0 is not None and gpu1 is not None:
            seen = set(gpu0) | set(gpu1)
            # NVML reports PIDs of the host's namespace: if ours are not among them, it cannot tell ours apart
            gpu_others = sorted(seen - ours) if seen & ours or not seen else None
        busy = other_cpus > BUSY_CPUS or bool(gpu_others)
        self.result = {"other_cpus_busy": round(other_cpus, 2), "gpu_other_pids": gpu_others,
                       "window_s": round(wall, 3), "flagged": busy}


def describe(contention: dict) -> str:
    parts = []
    if contention.get("other_cpus_busy", 0) > BUSY_CPUS:
        parts.append(f"other processes kept {contention['other_cpus_busy']:.1f} CPUs busy")
    if contention.get("gpu_other_pids"):
        parts.append(f"other processes on the GPU: PIDs {', '.join(map(str, contention['gpu_other_pids']))}")
    return "; ".join(parts)
