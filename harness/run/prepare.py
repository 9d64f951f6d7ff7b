"""The prepare stage: what the rungs need before anything is timed, in parallel (nothing is timed meanwhile): the C++
builds, the files an external rung's cells need (`prepare`), the eager references, and for rungs whose caches take
no timing to fill (`warm_in_prepare`) a build-only pass over their cells, one process per dtype: its first cell
starts with empty caches (cold), the next ones in the same process (hot)."""
from __future__ import annotations

import collections
import concurrent.futures
import json
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

from core import proc as procs
from core.cell import Cell
from core.parity import NEARER_THAN_ANOTHER_INPUT
from core.files import write_text_atomic
from core.paths import REPO
from harness.child.contract import WORKER, contract_argv
from harness.run.context import Context
from harness.run.record import recipe_references
from harness.run.rundir import ReferenceFailed, cell_dir
from tiers import all_tiers
from tiers.base import ExternalTier


class PrepareStage:
    def __init__(self, ctx: Context, on_progress: Callable[[str], None]) -> None:
        self.ctx, self.on_progress = ctx, on_progress
        self.tiers = all_tiers()
        self.running = 0
        self.lock = threading.Lock()
        self.builds: dict[str, Any] = {}  # the C++ builds' facts, by rung
        self.stopped = threading.Event()  # set on Ctrl-C: a job starts nothing more

    def counted(self, label: str, fn: Callable[[], Any]) -> tuple[Any, int]:
        """fn()'s result, and how many other jobs ran when it started."""
        if self.stopped.is_set():
            raise RuntimeError("the ladder was interrupted")
        with self.lock:
            self.running += 1
            beside = self.running - 1
        self.on_progress(label)
        try:
            return fn(), beside
        finally:
            with self.lock:
                self.running -= 1

    def build(self, tier_name: str, cell: Cell) -> None:
        tier = self.tiers[tier_name]
        cached = tier.built(cell)
        t = time.perf_counter()
        try:
            self.counted(f"building {tier_name}", lambda: tier.command(cell))
            self.builds[tier_name] = {"seconds": round(time.perf_counter() - t, 1), "cached": cached}
        except Exception as e:  # recorded per cell when the cell runs (the build is tried again there)
            self.builds[tier_name] = {"error": f"{type(e).__name__}: {e}"}

    def export(self, cells: list[Cell]) -> None:
        """One dtype's cells in turn: those that share a file (an AOTInductor package serves every batch size) find
        it made instead of holding a job slot while they wait for it."""
        run = self.ctx.run
        for cell in cells:
            tier = self.tiers[cell.tier]
            t = time.perf_counter()
            try:
                opts, beside = self.counted(f"preparing {cell.label} b{cell.batch} {cell.dtype}", lambda: tier.prepare(
                    cell, run.weights_for(cell.task), cell_dir(run, cell), run.cache(tier.name)))
                self.ctx.prepared[cell.key] = {"options": opts, "facts": {"prepare_s": time.perf_counter() - t,
                                                                          "concurrent_jobs": beside}}
            except Exception:
                pass  # prepared again, and its failure recorded, when the cell runs

    def warm(self, cells: list[Cell]) -> None:
        """The same child as the measured one (harness.child.worker), asked to stop after each cell's first result."""
        ctx, tier = self.ctx, self.tiers[cells[0].tier]
        store = ctx.store(cells[0])
        listing = cell_dir(ctx.run, cells[0]) / "warm.json"
        argvs = []
        for c in cells:
            d = cell_dir(ctx.run, c)
            files = {"weights": ctx.run.weights_for(c.task), "input": ctx.run.input(c.batch, c.res),
                     "output": d / "warm-output.safetensors", "result": d / "warm.json.result"}
            argvs.append(contract_argv([], c, files, ctx.protocol, {"build-only": "1", **ctx.store_args(store)}))
        write_text_atomic(listing, json.dumps(argvs))
        # A build that would autotune (a shape missing from the tables) must not time kernels beside other jobs:
        # in this process it takes the untuned configuration instead, and the measured process tunes it alone.
        env = procs.child_env(LADDER_NO_AUTOTUNE="1")
        proc, beside = self.counted(f"warming {tier.name} {cells[0].dtype} caches", lambda: procs.run(
            [*WORKER, "--cells", str(listing)], cwd=REPO, env=env,
            capture_output=True, text=True, timeout=ctx.protocol.timeout_s * len(cells)))
        for i, c in enumerate(cells):
            result = Path(argvs[i][argvs[i].index("--result") + 1])
            if result.exists():
                cold = json.loads(result.read_text())["cold"]
                ctx.prepared[c.key] = {"facts": {"start": "hot" if i else "cold",
                                                 "time_to_first_result_s": sum(cold.values()), **cold,
                                                 "concurrent_jobs": beside}}

    def references(self, keys: list[tuple]) -> None:
        """The eager references and the recipes' outputs, in one process (RunDir.references)."""
        try:
            self.counted(f"{len(keys)} reference{'s' if len(keys) > 1 else ''}",
                         lambda: self.ctx.run.references(keys))
        except ReferenceFailed:
            pass  # remembered by the run directory and recorded for each of its cells

    def tasks(self, groups: dict[str, list[Cell]]) -> list[Callable[[], None]]:
        """Every job, longest first as they usually run (exports and AOT compiles, then compiling warm-ups, then
        C++ builds, then the eager references, all in one job), so that the slowest start first when there are more
        than jobs."""
        exports: list[Callable[[], None]] = []
        warms: list[Callable[[], None]] = []
        builds: list[Callable[[], None]] = []
        configs, recipes = set(), set()
        for name, cells in groups.items():
            tier = self.tiers[name]
            runnable = [c for c in cells if tier.availability(c.device) is None and tier.supports(c) is None]
            configs |= {(c.batch, c.res, c.task, 0) for c in runnable}
            # another input's reference, for the dtypes whose parity also measures against it (core/parity.py)
            configs |= {(c.batch, c.res, c.task, 1) for c in runnable if c.dtype in NEARER_THAN_ANOTHER_INPUT}
            recipes |= {(c.batch, c.res, key) for c in runnable for key in recipe_references(c).values()}
            by_dtype: dict[str, list[Cell]] = collections.defaultdict(list)
            for c in runnable:
                by_dtype[c.dtype].append(c)
            if runnable and isinstance(tier, ExternalTier):
                builds.append(lambda n=name, c=runnable[0]: self.build(n, c))
                if tier.prepares_files:
                    exports += [lambda cs=cs: self.export(cs) for cs in by_dtype.values()]
            elif runnable and tier.caches and tier.warm_in_prepare and self.ctx.isolation == "rung":
                warms += [lambda cs=cs: self.warm(cs) for cs in by_dtype.values()]
        for batch, res, _, seed in configs:
            self.ctx.run.input(batch, res, seed)  # written once, here, not by the parallel jobs
        keys = [(b, r, t, s, None) for b, r, t, s in sorted(configs)]
        keys += [(b, r, "infer", 0, k) for b, r, k in sorted(recipes)]
        return exports + warms + builds + ([lambda: self.references(keys)] if keys else [])


def prepare(ctx: Context, groups: dict[str, list[Cell]], jobs: int,
            on_progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Runs the prepare stage over `groups` (cells by rung) with `jobs` in parallel; fills ctx.prepared and
    returns the C++ builds' facts."""
    stage = PrepareStage(ctx, on_progress)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs))
    try:
        for f in [pool.submit(t) for t in stage.tasks(groups)]:
            try:
                f.result()
            except Exception as e:  # a failed preparation is tried again, and recorded, when its cells run
                warnings.warn(f"prepare: {type(e).__name__}: {e}", stacklevel=1)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: end the running jobs' processes, start no other job
        stage.stopped.set()
        pool.shutdown(wait=False, cancel_futures=True)
        while procs.kill_all():  # again, for a job that started its process as the first were ended
            time.sleep(0.1)
        raise
    pool.shutdown()
    return stage.builds
