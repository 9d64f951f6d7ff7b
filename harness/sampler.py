"""NVML beside a child: its GPU memory, the device's utilisation, SM clock and board energy, outside timed phases."""
from __future__ import annotations

import threading
import time
from typing import Any

from core.env import gpu_handle
from core.stats import median
from harness.contract import TIMED_PHASES


def device_memory_used(gpu: str | None = None) -> int | None:
    """Device memory in use now on `gpu` (NVML), the baseline when NVML has no per-process figure."""
    nv, h = gpu_handle(gpu)
    return None if h is None else nv.nvmlDeviceGetMemoryInfo(h).used


class Sampler(threading.Thread):
    """Samples NVML every `period` s while the child lives, except in its timed phases: the child's own GPU memory
    (per-process accounting), device memory in use, GPU utilisation, SM clock and board energy, tagged with the
    child's cell and phase."""

    def __init__(self, pid: int, gpu: str | None = None, period: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.pid, self.period = pid, period
        self.cell, self.phase = 0, "start"
        self.samples: list[dict[str, Any]] = []
        self.stop = threading.Event()
        self.nv, self.handle = gpu_handle(gpu)

    def run(self) -> None:
        if self.handle is None:
            return
        while not self.stop.is_set():
            if self.phase in TIMED_PHASES:  # NVML calls enter the driver: keep them out of the timed passes
                self.stop.wait(self.period)
                continue
            self.samples.append(self.sample())
            self.stop.wait(self.period)

    def sample(self) -> dict[str, Any]:
        nv, h = self.nv, self.handle
        s: dict[str, Any] = {"cell": self.cell, "phase": self.phase, "t": time.perf_counter()}
        try:
            mine = [p.usedGpuMemory for p in nv.nvmlDeviceGetComputeRunningProcesses(h)
                    if p.pid == self.pid and p.usedGpuMemory is not None]
            s["proc_mem"] = max(mine) if mine else None
            s["dev_mem"] = nv.nvmlDeviceGetMemoryInfo(h).used
            s["util"] = nv.nvmlDeviceGetUtilizationRates(h).gpu
            s["sm_mhz"] = nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)
            s["energy_mj"] = nv.nvmlDeviceGetTotalEnergyConsumption(h)
        except Exception as e:  # a failing NVML query must not take the cell down
            s["error"] = str(e)
        return s

    def summary(self, baseline: int | None, cell: int, shared: bool) -> dict[str, Any]:
        mine = [s for s in self.samples if s["cell"] == cell]
        proc = [s["proc_mem"] for s in mine if s.get("proc_mem") is not None]
        dev = [s["dev_mem"] for s in mine if s.get("dev_mem") is not None]
        out: dict[str, Any] = {"nvml_samples": len(mine)}
        where = (" (a process that measured earlier cells of the rung first; the allocator's cache emptied "
                 "between cells)" if shared else "")
        if proc:
            out["nvml_process_peak_bytes"] = max(proc)
            out["nvml_source"] = ("per-process used GPU memory (NVML), peak over the cell's untimed phases (build, "
                                  "first result, memory, util), CUDA context included" + where)
        elif dev and baseline is not None:
            out["nvml_process_peak_bytes"] = max(dev) - baseline
            out["nvml_source"] = ("device memory used minus before the child started (NVML has no per-process "
                                  "figure here), peak over the cell's untimed phases, CUDA context included" + where)
        util = [s for s in mine if s["phase"] == "util" and "util" in s]
        if util:
            out["utilisation"] = utilisation(util)
        return out


def utilisation(util: list[dict[str, Any]]) -> dict[str, Any]:
    """The util phase's samples summarised; energy over the pass where the counter was read twice or more."""
    clocks = [s["sm_mhz"] for s in util]
    out = {
        "gpu_util_pct_mean": sum(s["util"] for s in util) / len(util),
        "sm_clock_mhz_median": median(clocks),
        "sm_clock_mhz_min": min(clocks),
        "samples": len(util),
        "what": "NVML GPU utilisation (share of time a kernel was running) and SM clock, sampled every "
                "20 ms during the util phase (forwards back to back)",
    }
    energy = [s for s in util if "energy_mj" in s]
    if len(energy) >= 2:
        out["energy_j"] = (energy[-1]["energy_mj"] - energy[0]["energy_mj"]) / 1e3
        out["energy_window_s"] = energy[-1]["t"] - energy[0]["t"]
    return out
