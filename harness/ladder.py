"""`ladder.run(config)`: one ladder (or sweep) from its configuration to its reports. It plans the cells, takes the
run directory, checks that a rerun adds to a run of the same identity, measures the GPU's matmul peak once, runs
the prepare stage and then each rung's cells with live progress, and writes the JSON, markdown and CSV."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import signal
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from core.cell import Cell
from core.env import default_device, device_slug, environment, visible_gpus, where
from core.files import write_text_atomic
from harness.child.contract import UTIL_S
from harness.results import derive, report
from harness.run.context import Context
from harness.run.executor import run_units
from harness.run.host_noise import host_cpu_probe
from harness.run.measure import ordered
from harness.run.plan import LadderConfig, check_output_paths, command_line, fitting, plan, run_identity
from harness.run.prepare import prepare
from harness.run.record import contended_line, document
from harness.run.refusal import Refusal
from harness.run.rundir import RecordNotSaved, RunDir, RunLocked
from harness.run.status import Status
from tiers import identity

# Free disk a run directory needs before its first cell: the weights (98 MB for ResNet-50, twice for training), inputs,
# references and each rung's caches (on the H100, AOTInductor's packages alone were 544 MB).
NEEDS_BYTES = {"cuda": 2 << 30, "cpu": 512 << 20}


def run(config: LadderConfig) -> int:
    """The ladder; 0 when it ran to the end, 130 when interrupted (every finished cell kept). Raises Refusal.
    SIGTERM (a timeout, a batch scheduler) and SIGHUP stop it as Ctrl-C does, in every stage."""
    def stop(signum, _frame):
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return run_stages(config)
    except KeyboardInterrupt:  # the stages that measure or write catch their own: here nothing was measured yet
        raise Refusal("interrupted before any cell was measured", status=130) from None
    finally:  # a caller in the same process (a test, a notebook) gets its own handlers back
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_stages(config: LadderConfig) -> int:
    t_start = time.perf_counter()
    console = Console()
    device = config.device or default_device()
    if device == "cuda" and default_device() != "cuda":
        raise Refusal("--device cuda: no NVIDIA GPU visible (NVML found none); valid here: cpu")
    suffix = ("-sweep" if config.command == "sweep" else "") + ("-train" if config.task == "train" else "")
    config.out = (config.out or Path("runs") / f"{config.model}-{device}{suffix}").resolve()
    config.protocol = dataclasses.replace(config.protocol, util_s=UTIL_S[device] if config.util_s is None
                                          else config.util_s)
    cells = plan(config, device)
    if config.executor == "ray" and importlib.util.find_spec("ray") is None:
        raise Refusal("--executor ray: Ray is not installed here: pip install -e '.[ray]'")
    if config.ray_address and config.executor != "ray":
        raise Refusal("--ray-address is for --executor ray")
    try:
        check_output_paths(config)
        run_dir = RunDir(config.out, config.model, device)
        run_dir.lock()
        run_dir.check_writable(NEEDS_BYTES[device])
        cells = fitting(config.model, cells, device, drop=config.command == "sweep")
    except (RunLocked, OSError) as e:
        raise Refusal(str(e)) from None
    meta = run_metadata(run_dir, config, device, console)
    run_dir.write_weights(config.task)

    done = {} if config.rerun else run_dir.done()
    todo = [c for c in cells if identity(c) not in done]
    console.print(f"{len(cells)} cells ({len(cells) - len(todo)} already recorded in {run_dir.path}), "
                  f"{config.model} on {device}, one process per {config.isolation}", markup=False)
    planned = {identity(c) for c in cells}
    records = {k: v for k, v in done.items() if k in planned}
    ctx = Context(run=run_dir, protocol=config.protocol, isolation=config.isolation,
                  peak_tflops=meta.get("peak_tflops"),
                  tunings=None if config.retune else device_slug(meta["environment"]),
                  isolation_check=config.isolation_check)
    try:
        interrupted, builds = measure(ctx, todo, records, config, console)
    except OSError as e:  # a disk that filled up mid-run: what is on disk stays, the reason is one line
        raise Refusal(f"{e if isinstance(e, RecordNotSaved) else f'writing failed: {e}'}; {on_disk(run_dir)} on disk "
                      f"in {run_dir.results}; free space and run the same command to go on",
                      status=1) from None
    if interrupted:
        console.print(f"interrupted: {sum(r['status'] != 'interrupted' for r in records.values())} of {len(cells)} "
                      f"cells recorded in {run_dir.path}; the same command goes on from there", markup=False,
                      style="yellow")
    ordered_records = [records[identity(c)] for c in cells if identity(c) in records]
    def rerender() -> str:  # read only where a write failed: results.jsonl is parsed to count what is on disk
        return f"{on_disk(run_dir)} in {run_dir.results}, and `python -m harness report {run_dir.results}` renders them"

    try:
        write_reports(ordered_records, meta, config, run_dir, builds, time.perf_counter() - t_start, console)
    except OSError as e:  # each report is written whole or not at all (core/files.py): the old one stays valid
        raise Refusal(f"writing the reports failed: {e}; {rerender()}", status=1) from None
    except KeyboardInterrupt:
        raise Refusal(f"interrupted while writing the reports; {rerender()}", status=130) from None
    return 130 if interrupted else 0


def on_disk(run_dir: RunDir) -> str:
    n = run_dir.saved()
    return f"{n} cell is" if n == 1 else f"{n} cells are"


def run_metadata(run_dir: RunDir, config: LadderConfig, device: str, console: Console) -> dict[str, Any]:
    """run.json: the run's environment, protocol and peaks, written by its first ladder; a rerun must match it."""
    host_cpu = host_cpu_probe() if config.host_probe else None
    env = environment(device, host_cpu)
    meta = {"model": config.model, "isolation": config.isolation, "environment": env,
            "protocol": dataclasses.asdict(config.protocol),
            "peak_tflops": {"datasheet": (env.get("gpu") or {}).get("datasheet_peak_tflops")}}
    meta_path = run_dir.path / "run.json"
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        before, now = run_identity(old), run_identity(meta)
        differ = [k for k in now if before.get(k) != now[k]]
        if differ:
            raise Refusal(f"{run_dir.path} holds a run with another {', '.join(differ)}; its cells would be "
                          "mislabelled: give another --out")
        return old
    if device == "cuda":
        with console.status("measuring the GPU's matmul peak (cuBLAS)"):
            meta["peak_tflops"]["measured"] = run_dir.matmul_peak()
            gpus = visible_gpus() if config.executor == "local" else []
            if len(gpus) > 1:  # cells spread over them: a speed-up across two GPUs must know if they differ
                meta["peak_tflops"]["per_gpu"] = {where(g)["gpu"]["uuid"]: run_dir.matmul_peak(g) for g in gpus}
    write_text_atomic(meta_path, json.dumps(meta, indent=1))
    return meta


def measure(ctx: Context, todo: list[Cell], records: dict[str, dict], config: LadderConfig,
            console: Console) -> tuple[bool, dict]:
    """The prepare stage, then each rung's cells, with live progress; each record appended to results.jsonl and to
    `records` as it ends. Returns (interrupted, the C++ builds' facts)."""
    builds: dict = {}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as progress:
        try:
            groups = ordered(todo)
            if config.isolation == "rung" and todo:
                task = progress.add_task("prepare", total=None)
                t = time.perf_counter()
                builds = prepare(ctx, groups, config.jobs,
                                 on_progress=lambda s: progress.update(task, description=escape(f"prepare: {s}")))
                progress.update(task, description=f"prepare: done in {time.perf_counter() - t:.0f} s", total=1,
                                completed=1)
            task = progress.add_task("ladder", total=len(todo))
            ctx.on_phase = lambda cell, ph: progress.update(
                task, description=escape(f"{cell.label} b{cell.batch} r{cell.res} {cell.dtype}: {ph}"))

            said: set[tuple] = set()  # (rung, status, reason) already shown: the final lines count the cells

            def on_record(rec: dict) -> None:
                ctx.run.append(rec)
                records[identity(Cell.of_record(rec))] = rec
                repeat = (rec["label"], rec["status"], rec.get("reason"))
                if rec["status"] == Status.OK or repeat not in said:
                    said.add(repeat)
                    progress.console.print(report.progress_line(rec), markup=False, no_wrap=True,
                                           overflow="ellipsis", style=None if rec["status"] == Status.OK else "red")
                progress.advance(task)

            run_units(ctx, list(groups.values()), on_record, config.executor, config.ray_address)
        except KeyboardInterrupt:  # the cell in flight is recorded as interrupted; every finished one is kept
            return True, builds
    return False, builds


def write_reports(records: list[dict], meta: dict, config: LadderConfig, run_dir: RunDir, builds: dict,
                  wall: float, console: Console) -> None:
    """The terminal's table, failures and fastest lines; the JSON, markdown (with plots) and CSV files."""
    doc = document(records, meta["environment"], meta["protocol"],
                   {"model": config.model, "peak_tflops": meta.get("peak_tflops"),
                    "isolation": meta.get("isolation"), "command": command_line(config.argv), "wall_s": wall,
                    "builds": builds})
    what = " (training steps)" if config.task == "train" else ""
    if records:
        title = f"{config.model}{what} on {device_slug(meta['environment'])}"
        report.print_table(console, report.rich_table(records, wide=config.wide, title=title), config.wide)
    for line in report.failure_lines(records):
        console.print(line, markup=False, style="red", overflow="ellipsis", no_wrap=True)
    for line in derive.fastest_lines(records):
        console.print(line, markup=False)
    if busy := contended_line(records):
        console.print(busy, markup=False, style="yellow")
    for line in derive.clock_lines(records):
        console.print(line, markup=False, style="yellow")
    if report.ray_line(records):
        console.print(report.ray_line(records), markup=False)
    if meta["environment"].get("host_cpu"):
        console.print(report.host_cpu_line(meta["environment"]["host_cpu"]), markup=False)
    json_path, md_path = config.json or run_dir.path / "ladder.json", config.markdown or run_dir.path / "ladder.md"
    report.write(doc, json_path, md_path, config.csv)
    console.print(f"{wall:.0f} s. JSON: {json_path}  markdown: {md_path}", markup=False)
    if config.retune and (run_dir.path / "cache").is_dir():
        console.print(f"tunings of this run: {run_dir.path / 'cache'}/<rung>/ (tuned.json, engines.tsv); to ship them "
                      f"for this GPU, copy them to kernels/tunings/{device_slug(meta['environment'])}/<rung>.json|tsv",
                      markup=False)
