"""One child process over cells of one rung (the Python worker or the rung's own program, alike), watched from its
start to the record of each cell it ended: its markers (harness/child/contract.py), NVML beside it, the contention
window of each cell's timed phases, and its timeout, crash or Ctrl-C."""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from core import proc as procs
from core.cell import Cell, Unavailable
from core.env import cpu_text, utc_now, where
from core.files import write_text_atomic
from core.paths import REPO
from harness.child.contract import CELL, ERROR, PHASE, WORKER, contract_argv
from harness.run.contention import Contention
from harness.run.context import Context
from harness.run.failures import cgroup_oom_kills, failure_status
from harness.run.record import base_record, finish_record, stage_reference
from harness.run.rundir import cell_dir, dir_bytes
from harness.run.sampler import Sampler, device_memory_used
from harness.run.status import Status
from tiers import all_tiers
from tiers.base import ExternalTier, PythonTier


@dataclass
class Job:
    """One cell's part of the child's command line."""

    cell: Cell
    files: dict[str, Path]  # weights, input, output, result (and census: the census pass's trace)
    extra: dict[str, str]   # cache-dir, tunings, hot-start


@dataclass
class Ended:
    """How the child ended, as the records of its cells need it."""

    returncode: int | None
    baseline: int | None  # device memory in use before it started (NVML), for the sampler's summary
    stderr_tail: str
    timed_out: bool
    interrupted: bool
    oom_killed: bool  # the kernel's OOM killer's count grew while it ran


class ChildRun:
    """Runs `cells` (of one rung) in one child process; `run()` records each cell it ended through `on_record`
    and returns how many (after a crash or timeout, the caller starts a new process for the rest)."""

    def __init__(self, ctx: Context, cells: list[Cell], on_record: Callable[[dict], None]) -> None:
        self.ctx, self.cells, self.on_record = ctx, cells, on_record
        self.tier = all_tiers()[cells[0].tier]
        self.store = ctx.store(cells[0])
        self.t_start = time.time()
        self.built_before: bool | None = None
        # what the child's stdout says, per cell index: when it began (clock, UTC), its phases, its reported error
        self.index = 0
        self.cell_started = time.time()
        self.began: dict[int, tuple[float, str]] = {0: (time.time(), utc_now())}
        self.phases: dict[int, list[tuple[str, float]]] = collections.defaultdict(list)
        self.errors: dict[int, str] = {}
        self.contention: dict[int, dict | None] = {}
        self.check = Contention(ctx.gpu, ctx.processes_root)
        self.where = where(ctx.gpu)  # this host, the cell's GPU and the CPUs nearest it
        per_gpu = (ctx.peak_tflops or {}).get("per_gpu") or {}
        if "gpu" in self.where and self.where["gpu"]["uuid"] in per_gpu:  # several GPUs: this one's own rate
            self.where["gpu"]["matmul_tflops"] = per_gpu[self.where["gpu"]["uuid"]]

    def run(self) -> int:
        jobs = self.jobs()
        try:
            program = self.program(jobs)
        except Unavailable as e:
            self.on_record({**base_record(self.cells[0]), "status": Status.UNAVAILABLE, "reason": str(e)})
            return 1
        except Exception as e:  # building or preparing the rung's files failed: an error of ours, not 'cannot run here'
            self.on_record({**base_record(self.cells[0]), "status": Status.ERROR,
                            "reason": f"preparing {self.cells[0].tier}: {type(e).__name__}: {e}"})
            return 1
        jobs = jobs[:len(self.cells)]
        cache_kept = bool(self.tier.caches) and dir_bytes(self.store.cache) > 0  # a warm start needs something there
        return self.records(jobs, cache_kept, self.launch(self.argv(program, jobs)))

    def jobs(self) -> list[Job]:
        run = self.ctx.run
        jobs = []
        for i, cell in enumerate(self.cells):
            cdir = cell_dir(run, cell)
            files = {"weights": run.weights_for(cell.task), "input": run.input(cell.batch, cell.res),
                     "output": cdir / "output.safetensors", "result": cdir / "result.json"}
            if self.ctx.protocol.census_steps:
                files["census"] = cdir / "census.trace.json"
            if isinstance(self.tier, PythonTier) and (stages := stage_reference(self.ctx, cell)):
                files["stages"] = stages  # read by the child (a C++ rung gives no stages: its parity says so)
            for k in ("output", "result", "census"):  # what this cell's child writes
                if k in files:
                    files[k].unlink(missing_ok=True)
            # The hot start (a new batch size in the same process) is a deployment's question; training keeps one.
            hot = "1" if i == 0 and self.tier.batch_change and cell.task == "infer" else "0"
            jobs.append(Job(cell, files, {**self.ctx.store_args(self.store), "hot-start": hot}))
        return jobs

    def program(self, jobs: list[Job]) -> list[str]:
        """The child's program; for a C++ rung, built (cached) and the files each cell needs made from the weights
        (a cell whose files fail after the first is left to the next process, where it fails first)."""
        if isinstance(self.tier, PythonTier):
            return WORKER
        assert isinstance(self.tier, ExternalTier)
        run = self.ctx.run
        self.built_before = self.tier.built(self.cells[0])
        program = self.tier.command(self.cells[0])
        for i, job in enumerate(jobs):
            try:
                opts = self.ctx.prepared.get(job.cell.key, {}).get("options")
                if opts is None:
                    opts = self.tier.prepare(job.cell, run.weights_for(job.cell.task), cell_dir(run, job.cell),
                                             run.cache(self.tier.name))
            except Exception:
                if i == 0:
                    raise
                self.cells = self.cells[:i]
                break
            job.cell = dataclasses.replace(job.cell, options=job.cell.options + tuple(opts.items()))
        return program

    def argv(self, program: list[str], jobs: list[Job]) -> list[str]:
        protocol = self.ctx.protocol
        if len(jobs) == 1:
            return contract_argv(program, jobs[0].cell, jobs[0].files, protocol, jobs[0].extra)
        # one process measures the cells in turn (harness/child/worker.py and cpp/common/ladder/protocol.h `--cells`)
        listing = cell_dir(self.ctx.run, self.cells[0]) / "cells.json"
        write_text_atomic(listing, json.dumps([contract_argv([], j.cell, j.files, protocol, j.extra) for j in jobs],
                                      ensure_ascii=False))
        return program + ["--cells", str(listing)]

    def launch(self, argv: list[str]) -> Ended:
        """Starts the child, with NVML sampled beside it, and waits for it."""
        stderr_path = cell_dir(self.ctx.run, self.cells[0]) / "stderr.txt"
        oom_before = cgroup_oom_kills()
        with open(stderr_path, "w") as err:
            baseline = device_memory_used(self.ctx.gpu)
            pinned = {"CUDA_VISIBLE_DEVICES": self.ctx.gpu} if self.ctx.gpu else {}
            proc = procs.popen(argv, cwd=REPO, env=procs.child_env(PYTHONUNBUFFERED="1", **pinned),
                               stdout=subprocess.PIPE, stderr=err, text=True)
            self.where["cpu_affinity"] = self.pin(proc.pid)
            self.where["omp_num_threads"] = os.environ.get("OMP_NUM_THREADS")  # what the child inherits
            self.sampler = sampler = Sampler(proc.pid, self.ctx.gpu)
            sampler.start()
            reader = threading.Thread(target=lambda: [self.line(line.rstrip("\n")) for line in proc.stdout],
                                      daemon=True)
            reader.start()
            timed_out, interrupted = self.wait(proc)
            sampler.stop.set()
            sampler.join()
            reader.join(timeout=5)
        tail = "\n".join(stderr_path.read_text(errors="replace").splitlines()[-30:])
        oom_after = cgroup_oom_kills()
        oom_killed = oom_before is not None and oom_after is not None and oom_after > oom_before
        return Ended(proc.returncode, baseline, tail, timed_out, interrupted, oom_killed)

    def pin(self, pid: int) -> str | None:
        """The child's CPUs: the cores of its GPU's NUMA node where the host says which (its threads, started
        later, inherit them), as a cpulist; None where the platform cannot say."""
        try:
            if self.where.get("numa_cpus"):
                os.sched_setaffinity(pid, self.where["numa_cpus"])
            return cpu_text(os.sched_getaffinity(pid))
        except (AttributeError, OSError):  # not Linux, or the child already gone
            return None

    def wait(self, proc: subprocess.Popen) -> tuple[bool, bool]:
        """Until the child exits, its cell runs past the timeout, or Ctrl-C / SIGTERM: (timed out, interrupted).
        The child runs in its own session, so the parent ends its whole group."""
        timed_out = interrupted = False
        try:
            while proc.poll() is None:
                if time.time() - self.cell_started > self.ctx.protocol.timeout_s:
                    timed_out = True
                    break
                if self.ctx.stop.is_set():  # Ctrl-C reached the ladder while this child ran on another thread
                    interrupted = True
                    break
                time.sleep(0.05)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            if proc.poll() is None:
                procs.kill_group(proc)
        return timed_out, interrupted

    def line(self, line: str) -> None:
        """One line of the child's stdout: a new cell, a new phase, or a cell's error."""
        if line.startswith(CELL):
            self.index, self.cell_started = int(line[len(CELL):]), time.time()
            self.began.setdefault(self.index, (time.time(), utc_now()))
            self.sampler.cell = self.index
            self.check.start = None  # a new cell: its own window
        elif line.startswith(PHASE):
            ph = line[len(PHASE):]
            self.phases[self.index].append((ph, time.time()))
            self.sampler.phase = ph
            if ph == "warmup":
                self.check.begin()
            elif ph == "memory":
                self.check.end()
                self.contention[self.index] = self.check.result
            self.ctx.on_phase(self.cells[min(self.index, len(self.cells) - 1)], ph)
        elif line.startswith(ERROR):
            self.errors.setdefault(self.index, line[len(ERROR):])

    def observed(self, i: int, cell: Cell, baseline: int | None) -> dict:
        """What the parent saw of cell i: when it began, its wall time per phase, NVML and contention."""
        record = base_record(cell)
        began = self.began.get(i)
        if began:  # when this cell's measurement began (a process over several cells begins them in turn)
            record["measured_at"] = began[1]
        ends = [self.began[j][0] for j in self.began if j > i]
        end = min(ends) if ends else time.time()
        record["wall_s"] = end - (began[0] if began else self.t_start)
        record["isolation"] = self.ctx.isolation
        record["where"] = {k: v for k, v in self.where.items() if k != "numa_cpus"}
        record["process_position"] = i  # cells this process measured before this one
        # Where the cell's wall time went, phase by phase ('start': process start and imports, or the step since
        # the previous cell)
        marks = ([("start", began[0])] if began else []) + self.phases.get(i, []) + [("", end)]
        record["phase_s"] = {ph: round(t1 - t0, 3) for (ph, t0), (_, t1) in zip(marks, marks[1:]) if ph != "done"}
        record["nvml"] = self.sampler.summary(baseline, i, i > 0, self.ctx.protocol.sustains(cell))
        record["contention"] = self.contention.get(i)
        return record

    def records(self, jobs: list[Job], cache_kept: bool, ended: Ended) -> int:
        """The record of each cell the child ended, in order; stops at the first it did not reach."""
        recorded = 0
        for i, job in enumerate(jobs):
            record = self.observed(i, self.cells[i], ended.baseline)
            wall_s = record.pop("wall_s")
            if job.files["result"].exists():
                raw = json.loads(job.files["result"].read_text())
                record["start"] = "hot" if i else ("warm-start" if cache_kept or self.built_before else "cold")
                record["cache_bytes"] = dir_bytes(self.store.cache) if self.tier.caches else None
                record["prepared"] = self.ctx.prepared.get(job.cell.key, {}).get("facts")
                self.on_record(finish_record(self.ctx, record, self.cells[i], raw, wall_s))
                recorded += 1
                continue
            if i in self.errors:
                status, reason = failure_status(0, self.errors[i], "", disk=self.ctx.run.path)
                self.on_record({**record, "status": status, "reason": reason})
                recorded += 1
                if len(jobs) > 1:
                    continue  # the child reported it and went on with the next cell
                return recorded
            if i != self.index and not ended.interrupted:
                return recorded  # not reached: the caller starts a new process for the rest
            phase = self.sampler.phase
            if ended.interrupted:
                self.on_record({**record, "status": Status.INTERRUPTED,
                                "reason": f"ladder interrupted (last phase: {phase})"})
                raise KeyboardInterrupt
            if ended.timed_out:
                self.on_record({**record, "status": Status.TIMEOUT, "stderr_tail": ended.stderr_tail,
                                "reason": f"no result after {self.ctx.protocol.timeout_s:g} s (last phase: {phase})"})
            else:
                status, reason = failure_status(ended.returncode, None, ended.stderr_tail, ended.oom_killed,
                                                disk=self.ctx.run.path)
                self.on_record({**record, "status": status, "reason": reason, "last_phase": phase,
                                "stderr_tail": ended.stderr_tail})
            return recorded + 1
        if ended.interrupted:  # every cell it reached had its result (one stopped in its hot start included)
            raise KeyboardInterrupt
        return recorded
