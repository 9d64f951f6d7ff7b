"""NVML beside a child: its GPU memory, the device's utilisation, SM clock and board energy, outside timed phases."""
from __future__ import annotations

import threading
import time
from typing import Any

from core.env import gpu_handle
from core.stats import median
from harness.child.contract import SUSTAIN_WINDOW_S, TIMED_PHASES


def device_memory_used(gpu: str | None = None) -> int | None:
    """Device memory in use now on `gpu` (NVML), the baseline when NVML has no per-process figure."""
    nv, h = gpu_handle(gpu)
    return None if h is None else nv.nvmlDeviceGetMemoryInfo(h).used


# In the timed phases the sampler reads the clocks and the power only (no process list, no memory query), at a tenth
# of its period: what the GPU ran at while the samples were taken, at a cost the timing cannot see.
TIMED_PERIOD_S = 0.1
# NVML's clocks-event reasons that hold the SM clock below its maximum while the GPU works, by bit.
HELD_BY = {0x4: "power cap", 0x8: "hardware slowdown", 0x20: "thermal (software)", 0x40: "thermal (hardware)",
           0x80: "power brake"}


class Sampler(threading.Thread):
    """Samples NVML every `period` s while the child lives, tagged with the child's cell and phase: the child's
    own GPU memory (per-process accounting), device memory in use, GPU utilisation and board energy outside the
    timed phases; SM and memory clock, power and the reasons the clock is held, in every phase (TIMED_PERIOD_S in
    the timed ones)."""

    def __init__(self, pid: int, gpu: str | None = None, period: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.pid, self.period = pid, period
        self.cell, self.phase = 0, "start"
        self.samples: list[dict[str, Any]] = []
        self.stop = threading.Event()
        self.nv, self.handle = gpu_handle(gpu)
        # newer NVML bindings name it "clocks event reasons", older ones "throttle reasons"
        self.reasons = getattr(self.nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            self.nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
        self.limits: dict[str, float] = {}
        if self.handle is not None:
            nv, h = self.nv, self.handle
            try:
                self.limits = {"sm_clock_max_mhz": nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM),
                               "mem_clock_max_mhz": nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_MEM),
                               "power_limit_w": nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1e3}
            except Exception:  # without them a cell's clocks are recorded, not judged
                pass

    def run(self) -> None:
        if self.handle is None:
            return
        while not self.stop.is_set():
            timed = self.phase in TIMED_PHASES
            self.samples.append(self.clocks() if timed else self.sample())
            self.stop.wait(TIMED_PERIOD_S if timed else self.period)

    def clocks(self) -> dict[str, Any]:
        nv, h = self.nv, self.handle
        s: dict[str, Any] = {"cell": self.cell, "phase": self.phase, "t": time.perf_counter()}
        try:
            s["sm_mhz"] = nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)
            s["mem_mhz"] = nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM)
            s["power_w"] = nv.nvmlDeviceGetPowerUsage(h) / 1e3
            s["reasons"] = self.reasons(h)
        except Exception as e:  # a failing NVML query must not take the cell down
            s["error"] = str(e)
        return s

    def sample(self) -> dict[str, Any]:
        nv, h = self.nv, self.handle
        s = self.clocks()
        try:
            mine = [p.usedGpuMemory for p in nv.nvmlDeviceGetComputeRunningProcesses(h)
                    if p.pid == self.pid and p.usedGpuMemory is not None]
            s["proc_mem"] = max(mine) if mine else None
            s["dev_mem"] = nv.nvmlDeviceGetMemoryInfo(h).used
            s["util"] = nv.nvmlDeviceGetUtilizationRates(h).gpu
            s["energy_mj"] = nv.nvmlDeviceGetTotalEnergyConsumption(h)
        except Exception as e:
            s["error"] = str(e)
        return s

    def summary(self, baseline: int | None, cell: int, shared: bool, sustained: bool = False) -> dict[str, Any]:
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
        if timed := clocks([s for s in mine if s["phase"] in TIMED_PHASES]):
            out["timed_clocks"] = {**timed, **self.limits}
        util = [s for s in mine if s["phase"] == "util" and "util" in s]
        if util:
            out["utilisation"] = {**utilisation(util), **self.limits}
            if sustained:  # the window's last seconds, after the load before them
                last = [s for s in util if s["t"] >= util[-1]["t"] - SUSTAIN_WINDOW_S]
                out["sustained"] = {**clocks(last), **energy(last), **self.limits}
        return out


def clocks(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """SM and memory clock and board power over `samples`, and how often each reason held the clock."""
    samples = [s for s in samples if "reasons" in s]
    if not samples:
        return {}
    sm, mem, power = ([s[k] for s in samples] for k in ("sm_mhz", "mem_mhz", "power_w"))
    held = {name: sum(bool(s["reasons"] & bit) for s in samples) / len(samples) for bit, name in HELD_BY.items()}
    return {"sm_clock_mhz_median": median(sm), "sm_clock_mhz_min": min(sm), "mem_clock_mhz_median": median(mem),
            "mem_clock_mhz_min": min(mem), "power_w_median": median(power), "power_w_max": max(power),
            "held_by": {k: round(v, 3) for k, v in held.items() if v}, "clock_samples": len(samples)}


def energy(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The board energy counter over `samples` (read at least twice): joules, the window, how often the counter
    moved (its update period, which bounds the window's error: energy_rel_err, one update over the window) and the
    average power it gives."""
    read = [s for s in samples if "energy_mj" in s]
    if len(read) < 2:
        return {}
    window = read[-1]["t"] - read[0]["t"]
    joules = (read[-1]["energy_mj"] - read[0]["energy_mj"]) / 1e3
    moves = [b["t"] for a, b in zip(read, read[1:]) if b["energy_mj"] != a["energy_mj"]]
    update = (moves[-1] - moves[0]) / (len(moves) - 1) if len(moves) >= 2 else None
    return {"energy_j": joules, "energy_window_s": window, "energy_update_s": update,
            "energy_rel_err": update / window if update and window > 0 else None,
            "average_power_w": joules / window if window > 0 else None}


def utilisation(util: list[dict[str, Any]]) -> dict[str, Any]:
    """The util phase's samples summarised: utilisation, clocks and power, and the energy over the pass."""
    return {
        "gpu_util_pct_mean": sum(s["util"] for s in util) / len(util),
        **clocks(util),
        "samples": len(util),
        "what": "NVML GPU utilisation (share of time a kernel was running), SM and memory clocks and board power, "
                "sampled every 20 ms during the util phase (forwards back to back), and the board energy counter "
                "over it",
        **energy(util),
    }
