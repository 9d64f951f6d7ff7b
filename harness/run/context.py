"""What every cell of one ladder run shares: its directory, protocol, isolation, peaks, tunings and prepared files."""
from __future__ import annotations

import dataclasses
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from core.cell import Cell, Store
from core.paths import TUNINGS
from harness.child.contract import Protocol
from harness.run.rundir import RunDir, cell_dir


def shipped_tunings(gpu: str | None, tier: str) -> Path | None:
    """The rung's tuned choices shipped for this GPU model (kernels/tunings/<gpu>/<rung>.json|tsv), if any."""
    if gpu is None:
        return None
    return next((p for ext in ("json", "tsv") if (p := TUNINGS / gpu / f"{tier}.{ext}").is_file()), None)


@dataclass
class Context:
    run: RunDir
    protocol: Protocol
    isolation: str = "rung"            # 'rung': one process per rung (its cells in turn); 'cell': one per cell
    peak_tflops: dict | None = None
    tunings: str | None = None         # GPU slug whose shipped tunings apply, None under --retune
    isolation_check: str = "warn"      # 'warn': flag a contended cell; 'error': also refuse it
    gpu: str | None = None             # the GPU its children run on, as CUDA_VISIBLE_DEVICES names it (None: all)
    processes_root: int | None = None  # the process whose tree is the ladder's own here (None: this; Ray: raylet)
    stop: threading.Event = dataclasses.field(default_factory=threading.Event)  # Ctrl-C, for children on threads
    on_phase: Callable[[Cell, str], None] = lambda cell, phase: None
    prepared: dict[str, dict] = dataclasses.field(default_factory=dict)  # cell key -> prepare facts

    def tunings_file(self, tier: str) -> Path | None:
        return shipped_tunings(self.tunings, tier)

    def store(self, cell: Cell) -> Store:
        """The rung's kept caches, or under --isolation cell a fresh, empty one for each cell (a true cold start),
        and its shipped tunings."""
        if self.isolation == "cell":
            cache = cell_dir(self.run, cell) / "cache"
            shutil.rmtree(cache, ignore_errors=True)
            cache.mkdir(parents=True)
        else:
            cache = self.run.cache(cell.tier)
        return Store(cache=cache, tunings=self.tunings_file(cell.tier))

    def store_args(self, store: Store) -> dict[str, str]:
        """The store as the contract's options: how every child, Python or C++, learns of it."""
        return {"cache-dir": str(store.cache), "tunings": str(store.tunings or "")}
