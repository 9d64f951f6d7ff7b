"""The parent: runs each cell in a fresh child process, watches it through NVML, checks its parity, turns its raw
samples into one self-describing record and appends that record to results.jsonl as soon as the cell ends."""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from harness import model as model_io
from harness.env import gpu_handle, source_revision, utc_now
from harness.flops import flops_per_image
from harness.parity import compare
from harness.stats import summarize
from tiers import all_tiers
from tiers.base import Cell, Unavailable

REPO = Path(__file__).resolve().parent.parent
DONE = "ok"


@dataclass
class Protocol:
    """The knobs of docs/protocol.md; the same values go to every rung's child."""

    warmup_min: int = 10
    warmup_max: int = 200
    warmup_s: float = 3.0
    iters: int = 50
    min_time_s: float = 1.0
    max_iters: int = 2000
    pipelined_iters: int = 50
    e2e_iters: int = 20
    util_s: float = 2.0
    timeout_s: float = 900.0

    def args(self) -> list[str]:
        out = []
        for f in dataclasses.fields(self):
            if f.name != "timeout_s":
                out += [f"--{f.name.replace('_', '-')}", str(getattr(self, f.name))]
        return out


TIMED_PHASES = ("warmup", "latency", "pipelined", "e2e")


class Sampler(threading.Thread):
    """Samples NVML every `period` s while the child lives, except in its timed phases: the child's own GPU memory
    (per-process accounting), device memory in use, GPU utilisation and SM clock, tagged with the child's phase."""

    def __init__(self, pid: int, period: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.pid, self.period = pid, period
        self.phase = "start"
        self.samples: list[dict[str, Any]] = []
        self.stop = threading.Event()
        self.nv, self.handle = gpu_handle()

    def run(self) -> None:
        if self.handle is None:
            return
        nv, h = self.nv, self.handle
        while not self.stop.is_set():
            if self.phase in TIMED_PHASES:  # NVML calls enter the driver: keep them out of the timed passes
                self.stop.wait(self.period)
                continue
            s: dict[str, Any] = {"phase": self.phase}
            try:
                procs = nv.nvmlDeviceGetComputeRunningProcesses(h)
                mine = [p.usedGpuMemory for p in procs if p.pid == self.pid and p.usedGpuMemory is not None]
                s["proc_mem"] = max(mine) if mine else None
                s["dev_mem"] = nv.nvmlDeviceGetMemoryInfo(h).used
                s["util"] = nv.nvmlDeviceGetUtilizationRates(h).gpu
                s["sm_mhz"] = nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)
            except Exception as e:  # a failing NVML query must not take the cell down
                s["error"] = str(e)
            self.samples.append(s)
            self.stop.wait(self.period)

    def summary(self, baseline: int | None) -> dict[str, Any]:
        proc = [s["proc_mem"] for s in self.samples if s.get("proc_mem") is not None]
        dev = [s["dev_mem"] for s in self.samples if s.get("dev_mem") is not None]
        util = [s for s in self.samples if s["phase"] == "util" and "util" in s]
        out: dict[str, Any] = {"nvml_samples": len(self.samples)}
        if proc:
            out["nvml_process_peak_bytes"] = max(proc)
            out["nvml_source"] = ("per-process used GPU memory (NVML), peak over the child's untimed phases (build, first "
                                  "result, memory, util), CUDA context included")
        elif dev and baseline is not None:
            out["nvml_process_peak_bytes"] = max(dev) - baseline
            out["nvml_source"] = ("device memory used minus before the child started (NVML has no per-process "
                                  "figure here), peak over the child's untimed phases, CUDA context included")
        if util:
            clocks = sorted(s["sm_mhz"] for s in util)
            out["utilisation"] = {
                "gpu_util_pct_mean": sum(s["util"] for s in util) / len(util),
                "sm_clock_mhz_median": clocks[len(clocks) // 2],
                "sm_clock_mhz_min": clocks[0],
                "samples": len(util),
                "what": "NVML GPU utilisation (share of time a kernel was running) and SM clock, sampled every "
                        "20 ms during the util phase (forwards back to back)",
            }
        return out


class RunDir:
    """One run's files: the weights every rung loads, inputs and references per (batch, res), cells, results."""

    def __init__(self, path: Path, model: str, device: str) -> None:
        self.path, self.model, self.device = path, model, device
        path.mkdir(parents=True, exist_ok=True)
        self.results = path / "results.jsonl"
        self.weights = path / f"{model}.weights.safetensors"
        if not self.weights.exists():
            tmp = self.weights.with_suffix(".tmp")
            model_io.write_weights(model_io.build_model(model), tmp)
            tmp.rename(self.weights)

    def input(self, batch: int, res: int) -> Path:
        p = self.path / "inputs" / f"b{batch}_r{res}.safetensors"
        if not p.exists():
            p.parent.mkdir(exist_ok=True)
            model_io.write_input(model_io.make_input(batch, res), p)
        return p

    def reference(self, batch: int, res: int) -> Path:
        p = self.path / "refs" / f"{self.model}_b{batch}_r{res}_{self.device}.safetensors"
        if not p.exists():
            p.parent.mkdir(exist_ok=True)
            child([sys.executable, "-m", "harness.reference", "ref", self.model, str(self.weights),
                   str(self.input(batch, res)), str(p), self.device], check=True)
        return p

    def done(self) -> dict[str, dict]:
        """Records already written, by cell identity: a rerun skips cells measured (or failing parity, or skipped by
        the rung) and tries again those that crashed, timed out, ran out of memory or were unavailable."""
        if not self.results.exists():
            return {}
        out = {}
        for line in self.results.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                if rec["status"] in ("ok", "parity-fail", "skipped"):
                    out[Cell.of_record(rec).identity] = rec
        return out

    def append(self, record: dict) -> None:
        with open(self.results, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())


def device_memory_used() -> int | None:
    """Device memory in use now (NVML), the baseline when NVML has no per-process figure."""
    nv, h = gpu_handle()
    return None if h is None else nv.nvmlDeviceGetMemoryInfo(h).used


def child_env(**extra: str) -> dict[str, str]:
    """The environment of every child: this checkout importable, whatever the caller's working directory."""
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **extra}


def child(cmd: list[str], check: bool = False, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, **kw)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed: {proc.stderr.strip()[-2000:]}")
    return proc


def failure_status(returncode: int, error_line: str | None, stderr_tail: str) -> tuple[str, str]:
    """Classifies a child that did not finish: (status, reason)."""
    if error_line:
        return "error", error_line
    low = stderr_tail.lower()
    if "out of memory" in low or "outofmemoryerror" in low or "cudaerrormemoryallocation" in low:
        return "oom", "out of memory: " + stderr_tail.strip().splitlines()[-1][-300:]
    if returncode < 0:
        name = signal.Signals(-returncode).name
        return "crashed", f"killed by {name}" + (f": {stderr_tail.strip().splitlines()[-1][-300:]}" if stderr_tail.strip() else "")
    last = stderr_tail.strip().splitlines()[-1][-400:] if stderr_tail.strip() else "no output"
    return "crashed", f"exit code {returncode}: {last}"


def contract_argv(program: list[str], cell: Cell, files: dict[str, Path], protocol: Protocol) -> list[str]:
    """The child's command line under the contract of docs/protocol.md (files: weights, input, output, result)."""
    return program + [
        "--tier", cell.tier, "--model", cell.model, "--batch", str(cell.batch), "--res", str(cell.res),
        "--dtype", cell.dtype, "--channels-last", str(int(cell.channels_last)),
        "--cuda-graph", str(int(cell.cuda_graph)), "--device", cell.device,
        *(a for k, v in cell.options for a in ("--option", f"{k}={v}")),
        *(a for k, v in files.items() for a in (f"--{k}", str(v))), *protocol.args()]


def run_cell(run: RunDir, cell: Cell, protocol: Protocol, on_phase: Callable[[str], None] = lambda p: None,
             fresh_cache: bool = True, peak_tflops: dict | None = None) -> dict[str, Any]:
    """Runs one cell in a fresh process and returns its record (never raises for a rung's failure)."""
    tier = all_tiers()[cell.tier]
    record = base_record(cell)
    t_start = time.time()
    reason = tier.availability(cell.device)
    if reason:
        return {**record, "status": "unavailable", "reason": reason}
    reason = tier.supports(cell)
    if reason:
        return {**record, "status": "skipped", "reason": reason}
    cdir = run.path / "cells" / hashlib.sha1(cell.key.encode()).hexdigest()[:12]
    cdir.mkdir(parents=True, exist_ok=True)
    files = {"weights": run.weights, "input": run.input(cell.batch, cell.res),
             "output": cdir / "output.safetensors", "result": cdir / "result.json"}
    for p in (files["output"], files["result"]):
        p.unlink(missing_ok=True)
    ref = run.reference(cell.batch, cell.res)
    try:
        if tier.kind == "python":
            program = [sys.executable, "-m", "harness.worker"]
        else:
            program = tier.command(cell)
            for k, v in tier.prepare(cell, run.weights, cdir).items():
                cell = dataclasses.replace(cell, options=cell.options + ((k, v),))
    except Unavailable as e:
        return {**record, "status": "unavailable", "reason": str(e)}
    except Exception as e:  # preparing the rung's files failed: recorded like any other failure of the cell
        return {**record, "status": "error", "reason": f"preparing {cell.tier}: {type(e).__name__}: {e}"}
    argv = contract_argv(program, cell, files, protocol)
    env = child_env(PYTHONUNBUFFERED="1")
    if fresh_cache:  # cold means cold: no Inductor / Triton cache from an earlier cell or run
        env["TORCHINDUCTOR_CACHE_DIR"] = str(cdir / "inductor-cache")
        env["TRITON_CACHE_DIR"] = str(cdir / "triton-cache")
    stderr_path = cdir / "stderr.txt"
    with open(stderr_path, "w") as err:
        baseline = device_memory_used()
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True,
                                start_new_session=True)
        sampler = Sampler(proc.pid)
        sampler.start()
        tail: collections.deque[str] = collections.deque(maxlen=40)
        error_line: list[str] = []

        def read_stdout() -> None:
            for line in proc.stdout:
                line = line.rstrip("\n")
                if line.startswith("@@phase "):
                    sampler.phase = line[8:]
                    on_phase(sampler.phase)
                elif line.startswith("@@error "):
                    error_line.append(line[8:])
                else:
                    tail.append(line)

        reader = threading.Thread(target=read_stdout, daemon=True)
        reader.start()
        try:
            proc.wait(timeout=protocol.timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:  # on a timeout, and on Ctrl-C in the parent: the child runs in its own session, so end it here
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            sampler.stop.set()
            sampler.join()
            reader.join(timeout=5)
    stderr_tail = "\n".join(stderr_path.read_text(errors="replace").splitlines()[-30:])
    record["wall_s"] = time.time() - t_start
    record["jit_cache"] = "fresh per cell" if fresh_cache else "shared (warm)"
    record["nvml"] = sampler.summary(baseline)
    if timed_out:
        return {**record, "status": "timeout", "reason": f"no result after {protocol.timeout_s:.0f} s "
                f"(last phase: {sampler.phase})", "stderr_tail": stderr_tail}
    if proc.returncode != 0 or not files["result"].exists():
        status, reason = failure_status(proc.returncode, error_line[0] if error_line else None, stderr_tail)
        return {**record, "status": status, "reason": reason, "last_phase": sampler.phase,
                "stderr_tail": stderr_tail}
    raw = json.loads(files["result"].read_text())
    parity = compare(model_io.read_tensor(files["output"], "output"), model_io.read_tensor(ref, "output"),
                     cell.dtype)
    return finish_record(record, cell, raw, parity, peak_tflops)


def base_record(cell: Cell) -> dict[str, Any]:
    d = cell.to_dict()
    return {"key": cell.key, "label": cell.label, **d, "status": None, "reason": None, "parity": {"ok": None},
            "measured_at": utc_now(), "source": source_revision()["digest"]}


def finish_record(record: dict, cell: Cell, raw: dict, parity: dict, peak_tflops: dict | None) -> dict:
    record["parity"] = parity
    record["cold"] = {**raw["cold"], "time_to_first_result_s": sum(raw["cold"].values())}
    record["build_stats"] = raw["build_stats"]
    record["stream"] = raw["stream"]
    nvml = record.pop("nvml")
    mem = dict(raw["memory"])
    if "nvml_process_peak_bytes" in nvml:
        mem["nvml_process_peak_bytes"] = nvml["nvml_process_peak_bytes"]
        mem["nvml_source"] = nvml["nvml_source"]
    mem["rss_peak_bytes"] = raw["rss_peak_bytes"]
    record["memory"] = mem
    record["utilisation"] = nvml.get("utilisation")
    if not parity["ok"]:
        record.update(status="parity-fail", reason=f"parity failed: {parity.get('reason')}; timings withheld")
        return record
    lat = summarize(raw["latency"]["samples_ms"])
    record["status"] = DONE
    record["latency_ms"] = lat
    record["latency_samples_ms"] = raw["latency"]["samples_ms"]
    record["throughput_img_s"] = cell.batch / lat["median"] * 1e3
    pipe = raw["pipelined"]
    record["pipelined"] = {"iters": pipe["iters"], "ms_per_iter": pipe["total_ms"] / pipe["iters"],
                           "throughput_img_s": cell.batch * pipe["iters"] / pipe["total_ms"] * 1e3}
    record["host_overhead_us"] = summarize(raw["host"]["samples_us"])
    record["e2e_ms"] = {k.removesuffix("_ms"): summarize(v) for k, v in raw["e2e"].items()}
    record["warmup"] = raw["warmup"]
    flops = flops_per_image(cell.model, cell.res) * cell.batch
    achieved = flops / (lat["median"] * 1e-3) / 1e12
    peaks = peak_tflops or {}
    record["tflops"] = {
        "flops_per_forward": flops,
        "achieved": achieved,
        "measured_peak": peaks.get("measured", {}).get(cell.dtype),
        "share_of_measured_peak": achieved / peaks["measured"][cell.dtype] if peaks.get("measured") else None,
        "datasheet_peak": (peaks.get("datasheet") or {}).get(cell.dtype),
        "share_of_datasheet_peak": (achieved / peaks["datasheet"][cell.dtype]) if peaks.get("datasheet") else None,
    }
    return record
