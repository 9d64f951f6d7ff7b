"""The parent: prepares each rung (builds, exports, warm caches), runs its cells in child processes (one process per
rung, or per cell with `--isolation cell`), watches them through NVML, checks parity, turns raw samples into one
self-describing record per cell and appends it to results.jsonl as soon as the cell ends."""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from harness import proc as procs
from harness import model as model_io
from harness.env import gpu_handle, source_revision, utc_now
from harness.flops import flops_per_image
from harness import train
from harness.parity import compare
from harness.stats import summarize
from tiers import all_tiers
from tiers.base import Cell, ExternalTier, Unavailable

REPO = Path(__file__).resolve().parent.parent
TUNINGS = REPO / "kernels" / "tunings"  # tuned choices shipped per GPU model: <gpu>/<rung>.json|tsv
DONE = "ok"
# Statuses a rerun keeps; the others (crashed, timeout, oom, error, unavailable, interrupted, contended) run again.
KEPT = ("ok", "parity-fail", "skipped")


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
    util_s: float = 0.3
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
    (per-process accounting), device memory in use, GPU utilisation, SM clock and board energy, tagged with the
    child's cell and phase."""

    def __init__(self, pid: int, period: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.pid, self.period = pid, period
        self.cell, self.phase = 0, "start"
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
            s: dict[str, Any] = {"cell": self.cell, "phase": self.phase, "t": time.perf_counter()}
            try:
                procs_ = nv.nvmlDeviceGetComputeRunningProcesses(h)
                mine = [p.usedGpuMemory for p in procs_ if p.pid == self.pid and p.usedGpuMemory is not None]
                s["proc_mem"] = max(mine) if mine else None
                s["dev_mem"] = nv.nvmlDeviceGetMemoryInfo(h).used
                s["util"] = nv.nvmlDeviceGetUtilizationRates(h).gpu
                s["sm_mhz"] = nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)
                s["energy_mj"] = nv.nvmlDeviceGetTotalEnergyConsumption(h)
            except Exception as e:  # a failing NVML query must not take the cell down
                s["error"] = str(e)
            self.samples.append(s)
            self.stop.wait(self.period)

    def summary(self, baseline: int | None, cell: int, shared: bool) -> dict[str, Any]:
        mine = [s for s in self.samples if s["cell"] == cell]
        proc = [s["proc_mem"] for s in mine if s.get("proc_mem") is not None]
        dev = [s["dev_mem"] for s in mine if s.get("dev_mem") is not None]
        util = [s for s in mine if s["phase"] == "util" and "util" in s]
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
            energy = [s for s in util if "energy_mj" in s]
            if len(energy) >= 2:
                out["utilisation"]["energy_j"] = (energy[-1]["energy_mj"] - energy[0]["energy_mj"]) / 1e3
                out["utilisation"]["energy_window_s"] = energy[-1]["t"] - energy[0]["t"]
        return out


class RunLocked(Exception):
    """Another live ladder holds the run directory."""


def read_jsonl(path: Path) -> list[dict]:
    """The records of a results.jsonl. A line that does not parse (torn by a crash mid-write, or two records glued
    by a missing newline) is skipped with a warning naming the file and line."""
    out = []
    for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            warnings.warn(f"{path}:{i}: skipped a line that is not one complete JSON record (torn write?)",
                          stacklevel=2)
            continue
        if isinstance(rec, dict) and "status" in rec:
            out.append(rec)
        else:
            warnings.warn(f"{path}:{i}: skipped a line that is not a ladder record", stacklevel=2)
    return out


class RunDir:
    """One run's files: the weights every rung loads, inputs and references per (batch, res), cells, caches,
    results. One ladder at a time: `lock` takes an OS-level lock on the directory."""

    def __init__(self, path: Path, model: str, device: str) -> None:
        self.path, self.model, self.device = Path(path).resolve(), model, device
        self.path.mkdir(parents=True, exist_ok=True)
        self.results = self.path / "results.jsonl"
        self.weights = self.path / f"{model}.weights.safetensors"
        self._failed_refs: dict[tuple[int, int], tuple[str, str]] = {}

    def lock(self) -> None:
        """Held until this process exits (a dead holder's lock is released by the OS, so a new ladder takes it)."""
        self._lock = open(self.path / ".lock", "a+")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.seek(0)
            holder = self._lock.read().strip() or "unknown"
            raise RunLocked(f"{self.path} is in use by another ladder (PID {holder}); wait for it or choose "
                            "another --out") from None
        self._lock.seek(0)
        self._lock.truncate()
        self._lock.write(str(os.getpid()))
        self._lock.flush()

    def weights_for(self, task: str) -> Path:
        """The weights a cell starts from: the run's, or for training the run's with residual branches
        zero-initialised (harness.model.zero_init_residual)."""
        return self.weights if task == "infer" else self.path / f"{self.model}.train-weights.safetensors"

    def write_weights(self, task: str = "infer") -> None:
        """The weights file(s) `task` needs, each written once (to a temporary name, then renamed)."""
        for path, make in ((self.weights, lambda: model_io.build_model(self.model)),
                           (self.weights_for(task),
                            lambda: model_io.zero_init_residual(model_io.load_model(self.model, self.weights)))):
            if not path.exists():
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                model_io.write_weights(make(), tmp)
                tmp.rename(path)

    def input(self, batch: int, res: int) -> Path:
        p = self.path / "inputs" / f"b{batch}_r{res}.safetensors"
        if not p.exists():
            p.parent.mkdir(exist_ok=True)
            tmp = p.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            model_io.write_input(model_io.make_input(batch, res), tmp)
            tmp.replace(p)
        return p

    def reference(self, batch: int, res: int, task: str = "infer") -> Path:
        """The eager fp32 reference (TF32 off): the output of one forward, or for training the loss of each parity
        step and the state after them. Raises ReferenceFailed (remembered) if eager cannot compute it."""
        if (batch, res, task) in self._failed_refs:
            raise ReferenceFailed(*self._failed_refs[(batch, res, task)])
        what = "training " if task == "train" else ""
        p = self.path / "refs" / f"{self.model}_{task}_b{batch}_r{res}_{self.device}.safetensors"
        if not p.exists():
            p.parent.mkdir(exist_ok=True)
            proc = procs.run([sys.executable, "-m", "harness.reference", "ref", self.model, str(self.weights_for(task)),
                              str(self.input(batch, res)), str(p), self.device, task], cwd=REPO, env=child_env(),
                             capture_output=True, text=True)
            if proc.returncode != 0:
                status, reason = failure_status(proc.returncode, None, proc.stderr[-3000:])
                self._failed_refs[(batch, res, task)] = (
                    "oom" if status == "oom" else "error",
                    f"eager {what}reference (batch {batch}, res {res}) failed: {reason}")
                raise ReferenceFailed(*self._failed_refs[(batch, res, task)])
        return p

    def cache(self, tier: str) -> Path:
        """The rung's caches kept between its processes (Inductor, Triton, tuning choices)."""
        p = self.path / "cache" / tier
        p.mkdir(parents=True, exist_ok=True)
        return p

    def done(self) -> dict[str, dict]:
        """Records already written, by cell identity: a rerun skips cells measured (or failing parity, or skipped by
        the rung) and tries again the others."""
        if not self.results.exists():
            return {}
        return {Cell.of_record(r).identity: r for r in read_jsonl(self.results) if r["status"] in KEPT}

    def append(self, record: dict) -> None:
        """One write of one complete line, then fsync; a file whose last line lacks its newline (a crash mid-write)
        gets one first, so the new record is never glued to the torn one."""
        line = (json.dumps(record) + "\n").encode()
        fd = os.open(self.results, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size:
                with open(self.results, "rb") as f:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        line = b"\n" + line
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)


class ReferenceFailed(Exception):
    def __init__(self, status: str, reason: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason


def device_memory_used() -> int | None:
    """Device memory in use now (NVML), the baseline when NVML has no per-process figure."""
    nv, h = gpu_handle()
    return None if h is None else nv.nvmlDeviceGetMemoryInfo(h).used


def child_env(**extra: str) -> dict[str, str]:
    """The environment of every child: this checkout importable, whatever the caller's working directory."""
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **extra}


def cgroup_oom_kills() -> int | None:
    """The kernel OOM killer's count for this cgroup (cgroup v2), to tell its SIGKILL from others."""
    try:
        for line in Path("/sys/fs/cgroup/memory.events").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    except OSError:
        pass
    return None


OOM_WORDS = ("out of memory", "outofmemoryerror", "cudaerrormemoryallocation", "std::bad_alloc", "cannot allocate")


def failure_status(returncode: int, error_line: str | None, stderr_tail: str, oom_killed: bool = False) -> tuple[str, str]:
    """Classifies a child that did not finish: (status, reason). An allocator's refusal is 'oom' whoever reports it."""
    last = stderr_tail.strip().splitlines()[-1][-300:] if stderr_tail.strip() else ""
    if error_line:
        return ("oom" if any(w in error_line.lower() for w in OOM_WORDS) else "error"), error_line
    if any(w in stderr_tail.lower() for w in OOM_WORDS):
        return "oom", "out of memory: " + last
    if returncode < 0:
        import signal

        name = signal.Signals(-returncode).name
        if oom_killed:
            return "oom", f"killed by {name} from the kernel's OOM killer (cgroup memory.events oom_kill grew)"
        return "crashed", f"killed by {name}" + (f": {last}" if last else "")
    return "crashed", f"exit code {returncode}: {last or 'no output'}"


def contract_argv(program: list[str], cell: Cell, files: dict[str, Path], protocol: Protocol,
                  extra: dict[str, str] | None = None) -> list[str]:
    """The child's command line under the contract of docs/protocol.md (files: weights, input, output, result)."""
    return program + [
        "--tier", cell.tier, "--model", cell.model, "--batch", str(cell.batch), "--res", str(cell.res),
        "--dtype", cell.dtype, "--channels-last", str(int(cell.channels_last)),
        "--cuda-graph", str(int(cell.cuda_graph)), "--device", cell.device, "--task", cell.task,
        *(a for k, v in cell.options for a in ("--option", f"{k}={v}")),
        *(a for k, v in files.items() for a in (f"--{k}", str(v))), *protocol.args(),
        *(("--parity-steps", str(train.K_STEPS), "--lr", repr(train.LEARNING_RATE)) if cell.task == "train" else ()),
        *(a for k, v in (extra or {}).items() for a in (f"--{k}", v))]


# --- contention: what else ran on the machine while a cell was timed ------------------------------------------

CLK_TCK = os.sysconf("SC_CLK_TCK")
BUSY_CPUS = 0.5  # other processes keeping more than half a CPU busy on average during the timed phases


def _stat(pid: int | str) -> tuple[int, int] | None:
    """(ppid, utime + stime ticks) of a process, or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), int(fields[11]) + int(fields[12])


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


def _busy_ticks() -> int:
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4]  # all but idle and iowait


def gpu_process_pids() -> list[int] | None:
    nv, h = gpu_handle()
    if h is None:
        return None
    try:
        return [p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses(h)]
    except Exception:
        return None


class Contention:
    """Snapshots at the start and end of a cell's timed phases: CPU time of processes outside the ladder's own
    tree, and processes outside it on the GPU (NVML)."""

    def __init__(self) -> None:
        self.start: tuple | None = None
        self.result: dict[str, Any] | None = None

    @staticmethod
    def snapshot() -> tuple:
        ours = process_tree(os.getpid())
        return time.perf_counter(), _busy_ticks(), sum(ours.values()), set(ours), gpu_process_pids()

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


# --- the cells of one child process ------------------------------------------------------------------------------

@dataclass
class Context:
    """What every cell of a ladder run shares."""

    run: RunDir
    protocol: Protocol
    isolation: str = "rung"            # 'rung': one process per rung (its cells in turn); 'cell': one per cell
    peak_tflops: dict | None = None
    tunings: str | None = None         # GPU slug whose shipped tunings apply, None under --retune
    isolation_check: str = "warn"      # 'warn': flag a contended cell; 'error': also refuse it
    on_phase: Callable[[Cell, str], None] = lambda cell, phase: None
    prepared: dict[str, dict] = dataclasses.field(default_factory=dict)  # cell key -> prepare facts

    def tunings_file(self, tier: str) -> Path | None:
        if self.tunings is None:
            return None
        for ext in ("json", "tsv"):
            p = TUNINGS / self.tunings / f"{tier}.{ext}"
            if p.is_file():
                return p
        return None

    def cache_dir(self, cell: Cell) -> Path:
        """The rung's kept caches, or under --isolation cell a fresh, empty one for each cell (a true cold start)."""
        if self.isolation == "cell":
            p = cell_dir(self.run, cell) / "cache"
            shutil.rmtree(p, ignore_errors=True)
            p.mkdir(parents=True)
            return p
        return self.run.cache(cell.tier)


def cell_dir(run: RunDir, cell: Cell) -> Path:
    d = run.path / "cells" / hashlib.sha1(cell.key.encode()).hexdigest()[:12]
    d.mkdir(parents=True, exist_ok=True)
    return d


def cache_env(cache: Path, tunings: Path | None) -> dict[str, str]:
    env = {"TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TRITON_CACHE_DIR": str(cache / "triton"),
           "LADDER_CACHE_DIR": str(cache)}
    if tunings:
        env["LADDER_TUNINGS"] = str(tunings)
    return env


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def base_record(cell: Cell) -> dict[str, Any]:
    d = cell.to_dict()
    return {"key": cell.key, "label": cell.label, **d, "layout": "nhwc" if cell.channels_last else "nchw",
            "status": None, "reason": None, "parity": {"ok": None}, "measured_at": utc_now(),
            "source": source_revision()["digest"]}


def screen(ctx: Context, cell: Cell) -> dict | None:
    """The record of a cell that needs no process (unavailable, skipped, reference failed), else None."""
    tier = all_tiers()[cell.tier]
    record = base_record(cell)
    reason = tier.availability(cell.device)
    if reason:
        return {**record, "status": "unavailable", "reason": reason}
    reason = tier.supports(cell)
    if reason:
        return {**record, "status": "skipped", "reason": reason}
    try:
        ctx.run.reference(cell.batch, cell.res, cell.task)
    except ReferenceFailed as e:
        return {**record, "status": e.status, "reason": e.reason}
    return None


def measure_cells(ctx: Context, cells: list[Cell], on_record: Callable[[dict], None]) -> None:
    """Measures `cells` (of one rung) in one child process under --isolation rung (each in its own otherwise), the
    Python worker or the rung's own program alike. After a crash or timeout the remaining cells go on in a new
    process. Calls `on_record` as each cell ends; raises KeyboardInterrupt after recording the cell in flight."""
    pending = []
    for cell in cells:
        rec = screen(ctx, cell)
        if rec is not None:
            on_record(rec)
        else:
            pending.append(cell)
    shared = ctx.isolation == "rung"
    while pending:
        batch = pending if shared else pending[:1]
        done = run_process(ctx, batch, on_record)
        pending = pending[done:]


def run_process(ctx: Context, cells: list[Cell], on_record: Callable[[dict], None]) -> int:
    """One child process over `cells` in turn; returns how many of them it ended (recorded)."""
    tier = all_tiers()[cells[0].tier]
    run, protocol = ctx.run, ctx.protocol
    t_start = time.time()
    cache = ctx.cache_dir(cells[0])
    tunings = ctx.tunings_file(cells[0].tier)
    extra = {"cache-dir": str(cache), "tunings": str(tunings or "")}
    jobs, files_of = [], []
    for i, cell in enumerate(cells):
        cdir = cell_dir(run, cell)
        files = {"weights": run.weights_for(cell.task), "input": run.input(cell.batch, cell.res),
                 "output": cdir / "output.safetensors", "result": cdir / "result.json"}
        for p in (files["output"], files["result"]):
            p.unlink(missing_ok=True)
        files_of.append(files)
        # The hot start (a new batch size in the same process) is a deployment's question; training keeps one.
        hot = "1" if i == 0 and tier.batch_change and cell.task == "infer" else "0"
        jobs.append((cell, files, {**extra, "hot-start": hot}))
    record0 = base_record(cells[0])
    built_before = None
    try:
        if tier.kind == "python":
            program = [sys.executable, "-m", "harness.worker"]
        else:
            built_before = tier.built(cells[0])
            program = tier.command(cells[0])
            for i, (cell, files, extra) in enumerate(jobs):  # the files each cell needs, made from the weights
                try:
                    opts = ctx.prepared.get(cell.key, {}).get("options")
                    if opts is None:
                        opts = tier.prepare(cell, run.weights_for(cell.task), cell_dir(run, cell),
                                            run.cache(tier.name))
                except Exception:
                    if i == 0:
                        raise
                    cells, jobs, files_of = cells[:i], jobs[:i], files_of[:i]  # cell i fails first in the next process
                    break
                jobs[i] = (dataclasses.replace(cell, options=cell.options + tuple(opts.items())), files, extra)
    except Unavailable as e:
        on_record({**record0, "status": "unavailable", "reason": str(e)})
        return 1
    except Exception as e:  # building or preparing the rung's files failed: an error of ours, not 'cannot run here'
        on_record({**record0, "status": "error", "reason": f"preparing {cells[0].tier}: {type(e).__name__}: {e}"})
        return 1
    if len(jobs) == 1:
        argv = contract_argv(program, *jobs[0][:2], protocol, jobs[0][2])
    else:  # one process measures the cells in turn (harness/worker.py and cpp/common/ladder/protocol.h `--cells`)
        listing = cell_dir(run, cells[0]) / "cells.json"
        listing.write_text(json.dumps([contract_argv([], c, f, protocol, x) for c, f, x in jobs], ensure_ascii=False))
        argv = program + ["--cells", str(listing)]

    cache_kept = tier.caches and dir_bytes(cache) > 0  # a warm start needs something in the caches
    env = child_env(PYTHONUNBUFFERED="1", **cache_env(cache, tunings))
    stderr_path = cell_dir(run, cells[0]) / "stderr.txt"
    state = {"index": 0, "started": time.time(), "errors": {}, "contention": {}, "began": {0: (time.time(), utc_now())},
             "phases": collections.defaultdict(list)}
    oom_before = cgroup_oom_kills()
    with open(stderr_path, "w") as err:
        baseline = device_memory_used()
        proc = procs.popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        sampler = Sampler(proc.pid)
        sampler.start()
        check = Contention()

        def read_stdout() -> None:
            for line in proc.stdout:
                line = line.rstrip("\n")
                if line.startswith("@@cell "):
                    state["index"], state["started"] = int(line[7:]), time.time()
                    state["began"].setdefault(state["index"], (time.time(), utc_now()))
                    sampler.cell = state["index"]
                    check.start = None  # a new cell: its own window
                elif line.startswith("@@phase "):
                    ph = line[8:]
                    state["phases"][state["index"]].append((ph, time.time()))
                    sampler.phase = ph
                    if ph == "warmup":
                        check.begin()
                    elif ph == "memory":
                        check.end()
                        state["contention"][state["index"]] = check.result
                    ctx.on_phase(cells[min(state["index"], len(cells) - 1)], ph)
                elif line.startswith("@@error "):
                    state["errors"].setdefault(state["index"], line[8:])

        reader = threading.Thread(target=read_stdout, daemon=True)
        reader.start()
        timed_out = interrupted = False
        try:
            while proc.poll() is None:
                if time.time() - state["started"] > protocol.timeout_s:
                    timed_out = True
                    break
                time.sleep(0.05)
        except KeyboardInterrupt:
            interrupted = True
        finally:  # on a timeout and on Ctrl-C / SIGTERM: the child runs in its own session, so end its group here
            if proc.poll() is None:
                procs.kill_group(proc)
            sampler.stop.set()
            sampler.join()
            reader.join(timeout=5)
    stderr_tail = "\n".join(stderr_path.read_text(errors="replace").splitlines()[-30:])
    oom_after = cgroup_oom_kills()
    oom_killed = oom_before is not None and oom_after is not None and oom_after > oom_before

    ended = 0
    for i, cell in enumerate(cells):
        record = base_record(cell)
        files = files_of[i]
        began = state["began"].get(i)
        if began:  # when this cell's measurement began (a process over several cells begins them in turn)
            record["measured_at"] = began[1]
        ends = [state["began"][j][0] for j in state["began"] if j > i]
        wall_s = (min(ends) if ends else time.time()) - (began[0] if began else t_start)
        record["isolation"] = ctx.isolation
        record["process_position"] = i  # cells this process measured before this one
        # Where the cell's wall time went, phase by phase ('start': process start and imports, or the step since
        # the previous cell)
        end = began[0] + wall_s if began else time.time()
        marks = ([("start", began[0])] if began else []) + state["phases"].get(i, []) + [("", end)]
        record["phase_s"] = {ph: round(t1 - t0, 3) for (ph, t0), (_, t1) in zip(marks, marks[1:]) if ph != "done"}
        record["nvml"] = sampler.summary(baseline, i, i > 0)
        record["contention"] = state["contention"].get(i)
        if files["result"].exists():
            raw = json.loads(files["result"].read_text())
            record["start"] = "hot" if i else ("warm-start" if cache_kept or built_before else "cold")
            record["cache_bytes"] = dir_bytes(cache) if tier.caches else None
            record["prepared"] = ctx.prepared.get(cell.key, {}).get("facts")
            on_record(finish_record(ctx, record, cell, raw, wall_s))
            ended += 1
            continue
        if i in state["errors"]:
            status, reason = failure_status(0, state["errors"][i], "")
            on_record({**record, "status": status, "reason": reason})
            ended += 1
            if len(cells) > 1:
                continue  # the child reported it and went on with the next cell
            return ended
        if i != state["index"] and not interrupted:
            return ended  # not reached: the caller starts a new process for the rest
        phase = sampler.phase
        if interrupted:
            on_record({**record, "status": "interrupted", "reason": f"ladder interrupted (last phase: {phase})"})
            raise KeyboardInterrupt
        if timed_out:
            on_record({**record, "status": "timeout", "reason": f"no result after {protocol.timeout_s:g} s "
                       f"(last phase: {phase})", "stderr_tail": stderr_tail})
        else:
            status, reason = failure_status(proc.returncode, None, stderr_tail, oom_killed)
            on_record({**record, "status": status, "reason": reason, "last_phase": phase,
                       "stderr_tail": stderr_tail})
        return ended + 1
    return ended


def finish_record(ctx: Context, record: dict, cell: Cell, raw: dict, wall_s: float) -> dict:
    ref = ctx.run.reference(cell.batch, cell.res, cell.task)
    files_out = cell_dir(ctx.run, cell) / "output.safetensors"
    if cell.task == "train":
        from safetensors.torch import load_file

        start = load_file(ctx.run.weights_for(cell.task))
        parity = train.compare(load_file(files_out), load_file(ref), start, cell.dtype)
    else:
        parity = compare(model_io.read_tensor(files_out, "output"), model_io.read_tensor(ref, "output"), cell.dtype)
    record["wall_s"] = wall_s
    record["parity"] = parity
    record["cold"] = {**raw["cold"], "time_to_first_result_s": sum(raw["cold"].values())}
    record["build_stats"] = raw["build_stats"]
    record["hot_start"] = raw.get("hot_start")
    record["stream"] = raw["stream"]
    nvml = record.pop("nvml")
    mem = dict(raw["memory"])
    if "nvml_process_peak_bytes" in nvml:
        mem["nvml_process_peak_bytes"] = nvml["nvml_process_peak_bytes"]
        mem["nvml_source"] = nvml["nvml_source"]
    mem["rss_peak_bytes"] = raw["rss_peak_bytes"]
    record["memory"] = mem
    record["utilisation"] = nvml.get("utilisation")
    util = record["utilisation"] or {}
    if util.get("energy_j") and raw["util"]["seconds"] > 0:
        images_per_s = raw["util"]["iters"] * cell.batch / raw["util"]["seconds"]
        util["img_per_joule"] = images_per_s * util["energy_window_s"] / util["energy_j"]
    if not parity["ok"]:
        record.update(status="parity-fail", reason=f"parity failed: {parity.get('reason')}; timings withheld")
        return record
    contention = record.get("contention") or {}
    if contention.get("flagged") and ctx.isolation_check == "error":
        record.update(status="contended", reason=f"measured beside other busy processes ({describe(contention)}); "
                      "timings withheld (--isolation-check error)")
        return record
    lat = summarize(raw["latency"]["samples_ms"])
    record["status"] = DONE
    record["latency_ms"] = lat
    record["latency_samples_ms"] = raw["latency"]["samples_ms"]
    record["latency_stopped"] = raw["latency"].get("stopped")
    record["throughput_img_s"] = cell.batch / lat["median"] * 1e3
    pipe = raw["pipelined"]
    record["pipelined"] = {"iters": pipe["iters"], "ms_per_iter": pipe["total_ms"] / pipe["iters"],
                           "throughput_img_s": cell.batch * pipe["iters"] / pipe["total_ms"] * 1e3}
    record["host_overhead_us"] = summarize(raw["host"]["samples_us"])
    record["e2e_ms"] = {k.removesuffix("_ms"): summarize(v) for k, v in raw["e2e"].items()}
    record["warmup"] = raw["warmup"]
    # A training step is counted as 3 forwards (the backward computes gradients of activations and of weights).
    flops = flops_per_image(cell.model, cell.res) * cell.batch * (3 if cell.task == "train" else 1)
    achieved = flops / (lat["median"] * 1e-3) / 1e12
    peaks = ctx.peak_tflops or {}
    record["tflops"] = {
        "flops_per_step" if cell.task == "train" else "flops_per_forward": flops,
        "achieved": achieved,
        "measured_peak": (peaks.get("measured") or {}).get(cell.dtype),
        "share_of_measured_peak": achieved / peaks["measured"][cell.dtype] if peaks.get("measured") else None,
        "datasheet_peak": (peaks.get("datasheet") or {}).get(cell.dtype),
        "share_of_datasheet_peak": (achieved / peaks["datasheet"][cell.dtype]) if peaks.get("datasheet") else None,
    }
    return record


def describe(contention: dict) -> str:
    parts = []
    if contention.get("other_cpus_busy", 0) > BUSY_CPUS:
        parts.append(f"other processes kept {contention['other_cpus_busy']:.1f} CPUs busy")
    if contention.get("gpu_other_pids"):
        parts.append(f"other processes on the GPU: PIDs {', '.join(map(str, contention['gpu_other_pids']))}")
    return "; ".join(parts)


# --- the prepare stage: builds, exports and warm caches, in parallel, before anything is timed -----------------

def prepare(ctx: Context, groups: dict[str, list[Cell]], jobs: int,
            on_progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Runs what the rungs need before measuring, in parallel (nothing is timed meanwhile): the C++ builds, the
    files an external rung's cells need (`prepare`), and for rungs with caches that take no timing to fill
    (`warm_in_prepare`) a build-only pass over their cells, one process per dtype: its first cell starts with
    empty caches (cold), the next ones in the same process (hot). Fills ctx.prepared; returns the builds' facts."""
    tiers = all_tiers()
    running = [0]
    lock = threading.Lock()
    builds: dict[str, Any] = {}

    def counted(label: str, fn: Callable[[], Any]) -> Any:
        with lock:
            running[0] += 1
            beside = running[0] - 1
        on_progress(label)
        try:
            return fn(), beside
        finally:
            with lock:
                running[0] -= 1

    def build(tier_name: str, cell: Cell) -> None:
        tier = tiers[tier_name]
        cached = tier.built(cell)
        t = time.perf_counter()
        try:
            counted(f"building {tier_name}", lambda: tier.command(cell))
            builds[tier_name] = {"seconds": round(time.perf_counter() - t, 1), "cached": cached}
        except Exception as e:  # recorded per cell when the cell runs (the build is tried again there)
            builds[tier_name] = {"error": f"{type(e).__name__}: {e}"}

    def export(cells: list[Cell]) -> None:
        # One dtype's cells in turn: those that share a file (an AOTInductor package serves every batch size) find
        # it made instead of holding a job slot while they wait for it.
        for cell in cells:
            tier = tiers[cell.tier]
            t = time.perf_counter()
            try:
                opts, beside = counted(f"preparing {cell.label} b{cell.batch} {cell.dtype}",
                                       lambda: tier.prepare(cell, ctx.run.weights_for(cell.task),
                                                            cell_dir(ctx.run, cell),
                                                            ctx.run.cache(tier.name)))
                ctx.prepared[cell.key] = {"options": opts, "facts": {"prepare_s": time.perf_counter() - t,
                                                                     "concurrent_jobs": beside}}
            except Exception:
                pass  # prepared again, and its failure recorded, when the cell runs

    def warm(cells: list[Cell]) -> None:
        # The same child as the measured one (harness.worker), asked to stop after the first result.
        tier = tiers[cells[0].tier]
        cache = ctx.run.cache(tier.name)
        tunings = ctx.tunings_file(tier.name)
        listing = cell_dir(ctx.run, cells[0]) / "warm.json"
        argvs = []
        for c in cells:
            d = cell_dir(ctx.run, c)
            files = {"weights": ctx.run.weights_for(c.task), "input": ctx.run.input(c.batch, c.res),
                     "output": d / "warm-output.safetensors", "result": d / "warm.json.result"}
            argvs.append(contract_argv([], c, files, ctx.protocol, {"build-only": "1", "cache-dir": str(cache),
                                                                    "tunings": str(tunings or "")}))
        listing.write_text(json.dumps(argvs))
        # A build that would autotune (a shape missing from the tables) must not time kernels beside other jobs:
        # in this process it takes the untuned configuration instead, and the measured process tunes it alone.
        env = child_env(LADDER_NO_AUTOTUNE="1", **cache_env(cache, tunings))
        (proc, beside) = counted(f"warming {tier.name} {cells[0].dtype} caches", lambda: procs.run(
            [sys.executable, "-m", "harness.worker", "--cells", str(listing)], cwd=REPO, env=env,
            capture_output=True, text=True, timeout=ctx.protocol.timeout_s * len(cells)))
        for i, c in enumerate(cells):
            result = Path(argvs[i][argvs[i].index("--result") + 1])
            if result.exists():
                cold = json.loads(result.read_text())["cold"]
                ctx.prepared[c.key] = {"facts": {"start": "hot" if i else "cold",
                                                 "time_to_first_result_s": sum(cold.values()), **cold,
                                                 "concurrent_jobs": beside}}

    configs = {(c.batch, c.res, c.task) for cells in groups.values() for c in cells
               if tiers[c.tier].availability(c.device) is None and tiers[c.tier].supports(c) is None}
    for batch, res, _ in configs:
        ctx.run.input(batch, res)  # written once, here, not by the parallel jobs

    def reference(batch: int, res: int, task: str) -> None:
        try:
            counted(f"eager {task} reference b{batch} r{res}", lambda: ctx.run.reference(batch, res, task))
        except ReferenceFailed:
            pass  # remembered by the run directory and recorded for each of its cells

    # Submitted longest first, as they usually run (exports and AOT compiles, then compiling warm-ups, then C++
    # builds, then the eager references), so that the slowest start first when there are more tasks than jobs.
    exports: list[Callable[[], None]] = []
    warms: list[Callable[[], None]] = []
    program_builds: list[Callable[[], None]] = []
    for name, cells in groups.items():
        tier = tiers[name]
        runnable = [c for c in cells if tier.availability(c.device) is None and tier.supports(c) is None]
        if not runnable:
            continue
        by_dtype: dict[str, list[Cell]] = collections.defaultdict(list)
        for c in runnable:
            by_dtype[c.dtype].append(c)
        if tier.kind == "external":
            program_builds.append(lambda n=name, c=runnable[0]: build(n, c))
            if type(tier).prepare is not ExternalTier.prepare:
                exports += [lambda cs=cs: export(cs) for cs in by_dtype.values()]
        elif tier.caches and tier.warm_in_prepare and ctx.isolation == "rung":
            warms += [lambda cs=cs: warm(cs) for cs in by_dtype.values()]
    tasks = exports + warms + program_builds + [lambda b=b, r=r, t=t: reference(b, r, t) for b, r, t in sorted(configs)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for f in [pool.submit(t) for t in tasks]:
            try:
                f.result()
            except Exception as e:  # a failed preparation is tried again, and recorded, when its cells run
                warnings.warn(f"prepare: {type(e).__name__}: {e}", stacklevel=1)
    return builds


def ordered(cells: Iterable[Cell]) -> dict[str, list[Cell]]:
    groups: dict[str, list[Cell]] = {}
    for c in cells:
        groups.setdefault(c.tier, []).append(c)
    return groups
