"""Where the rungs' processes run. The unit is the same everywhere: one rung's cells, measured by `measure_cells` in
one child process per rung (or per cell under --isolation cell), each record handed to the driver's `on_record`,
which writes it into the one run directory.

- `local`: this host. With several GPUs, one rung's process per GPU at a time, each pinned to its GPU with
  CUDA_VISIBLE_DEVICES (and to the cores of its NUMA node, harness/run/watch.py); otherwise one process at a time.
- `ray`: each unit a Ray task that reserves one GPU (`num_gpus=1`, so that no two cells share a GPU) in a worker
  process retired after the task (`max_calls=1`: a cold start stays cold); a task whose worker or node is lost runs
  again once (`max_retries=1`), so a lost worker costs time, not cells. On a CPU run the units go one at a time:
  two CPU cells side by side would measure each other."""
from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from core.cell import Cell
from core.env import visible_gpus, where
from core.paths import REPO
from harness.run.contention import ancestor_named
from harness.run.context import Context
from harness.run.measure import measure_cells
from harness.run.record import base_record
from harness.run.refusal import Refusal
from harness.run.rundir import RunDir
from harness.run.status import Status

EXECUTORS = ("local", "ray")
# The environment a Ray worker needs from the driver's: this checkout importable, the extra rungs and caches the
# driver was told of, Triton's interpreter on a CPU run.
FORWARDED_ENV = ("LADDER_EXTRA_TIERS", "LADDER_CACHE", "TRITON_INTERPRET")

OnRecord = Callable[[dict], None]


def run_units(ctx: Context, units: list[list[Cell]], on_record: OnRecord, executor: str,
              ray_address: str | None = None) -> None:
    """Measures every unit (one rung's cells); raises KeyboardInterrupt after recording what was in flight."""
    if executor == "ray":
        run_ray(ctx, units, on_record, ray_address)
    else:
        gpus = visible_gpus() if units and units[0][0].device == "cuda" else []
        run_local(ctx, units, on_record, gpus if len(gpus) > 1 else [None])


def run_local(ctx: Context, units: list[list[Cell]], on_record: OnRecord, slots: list[str | None]) -> None:
    """One unit per slot at a time (a slot: a GPU as CUDA_VISIBLE_DEVICES names it; None: the process's own)."""
    if len(slots) == 1:
        for cells in units:
            measure_cells(dataclasses.replace(ctx, gpu=slots[0]), cells, on_record)
        return
    lock = threading.Lock()
    free: queue.Queue = queue.Queue()
    for slot in slots:
        free.put(slot)

    def locked(record: dict) -> None:  # one record at a time into results.jsonl and the progress
        with lock:
            on_record(record)

    def unit(cells: list[Cell]) -> None:
        slot = free.get()
        try:
            if not ctx.stop.is_set():
                measure_cells(dataclasses.replace(ctx, gpu=slot), cells, locked)
        finally:
            free.put(slot)

    with ThreadPoolExecutor(len(slots)) as pool:
        futures = [pool.submit(unit, cells) for cells in units]
        try:
            for f in futures:
                f.result()
        except KeyboardInterrupt:  # the children on other threads end as interrupted (ChildRun.wait sees ctx.stop)
            ctx.stop.set()
            for f in futures:
                f.exception()
            raise


def portable(ctx: Context) -> dict:
    """The context as a Ray task takes it: plain data (the run directory by its path; no callbacks, no locks)."""
    fields = {f.name: getattr(ctx, f.name) for f in dataclasses.fields(ctx)
              if f.name not in ("run", "on_phase", "stop", "gpu")}
    return {**fields, "run": (str(ctx.run.path), ctx.run.model, ctx.run.device)}


def measure_unit(context: dict, cells: list[Cell], omp_threads: str | None) -> tuple[list[dict], float, float]:
    """A Ray task's body, in its worker: the unit's records, in order (the GPU is the one Ray assigned, which
    CUDA_VISIBLE_DEVICES names in this process), and when the body began and ended (epoch seconds).
    `omp_threads`: the driver's OMP_NUM_THREADS. Ray sets a worker's to its num_cpus (1) where the driver has none;
    the rung's process must inherit the driver's, as under --executor local, or its CPU cells and its host-side
    work run on one thread."""
    began = time.time()
    if omp_threads is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = omp_threads
    path, model, device = context.pop("run")
    ctx = Context(run=RunDir(path, model, device), **context)
    ctx.processes_root = ancestor_named("raylet")  # every worker of this host: the ladder's units on its other GPUs
    if device == "cuda":  # the driver measured none of the workers' GPUs: this one's own rate, once per run
        uuid = where(None)["gpu"]["uuid"]
        peaks = ctx.peak_tflops or {}
        ctx.peak_tflops = {**peaks, "per_gpu": {**peaks.get("per_gpu", {}), uuid: ctx.run.matmul_peak(uuid=uuid)}}
    records: list[dict] = []
    measure_cells(ctx, cells, records.append)
    return records, began, time.time()


def run_ray(ctx: Context, units: list[list[Cell]], on_record: OnRecord, address: str | None) -> None:
    """Each unit a Ray task; records written as each task returns. A unit whose task fails twice (its worker or
    node lost again) records its first cell as crashed and its other cells go on in a new task."""
    import ray  # optional (pip install -e ".[ray]"): the ladder checks for it before any work

    started = not ray.is_initialized()
    if started:
        env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
        ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                 runtime_env={"env_vars": env})
    gpu = bool(units) and units[0][0].device == "cuda"
    task = ray.remote(num_gpus=1 if gpu else 0, num_cpus=1, max_calls=1, max_retries=1)(measure_unit)
    # As many units in flight as the cluster has GPUs (one at a time for CPU cells): a task then starts as soon as
    # Ray can start it, and the time from its submission to its body is Ray's own cost, never a wait for a GPU.
    slots = int(ray.cluster_resources().get("GPU", 0)) if gpu else 1
    if slots < 1:
        raise Refusal("--executor ray: the Ray cluster has no GPU (ray start --num-gpus, or a GPU host)")
    waiting = list(units)
    running: dict = {}  # task -> (its cells, when it was submitted)
    try:
        while waiting or running:
            while waiting and len(running) < slots:
                cells = waiting.pop(0)
                running[task.remote(portable(ctx), cells, os.environ.get("OMP_NUM_THREADS"))] = cells, time.time()
            done, _ = ray.wait(list(running), num_returns=1)
            cells, submitted = running.pop(done[0])
            try:
                records, began, ended = ray.get(done[0])
                overhead = {"dispatch_s": began - submitted, "return_s": time.time() - ended,
                            "unit_cells": len(cells)}
            except ray.exceptions.RayError as e:  # its worker or node lost twice, or an error of ours in it
                on_record({**base_record(cells[0]), "status": Status.CRASHED,
                           "reason": " ".join(f"its Ray task failed: {type(e).__name__}: {e}".split())[:500]})
                if cells[1:]:
                    waiting.insert(0, cells[1:])
                continue
            for record in records:  # Ray's cost of the unit: task submission to body, body's end to its result here
                on_record({**record, "ray": overhead})
    except KeyboardInterrupt:
        for ref, (cells, _) in running.items():
            ray.cancel(ref, force=True)  # its worker and the rung's process under it (PDEATHSIG) end now
            on_record({**base_record(cells[0]), "status": Status.INTERRUPTED,
                       "reason": "ladder interrupted; its Ray task was cancelled"})
        raise
    finally:
        if started:
            ray.shutdown()
