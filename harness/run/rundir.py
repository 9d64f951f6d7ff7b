"""One run's directory: the weights every rung loads, inputs and eager references per (batch, res), a folder per cell,
the rungs' caches, and results.jsonl, to which each cell's record is appended (and fsynced) as it ends."""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

from core import model as model_io
from core import proc as procs
from core.cell import Cell
from core.files import disk_free, write_atomic
from core.paths import REPO
from harness.run.failures import failure_status
from harness.run.refusal import Refusal
from harness.run.status import KEPT, Status
from tiers import identity


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
        self._failed_refs: dict[tuple, tuple[str, str]] = {}  # (batch, res, task, seed) -> (status, reason)

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

    def check_writable(self, need_bytes: int) -> None:
        """Before anything is measured: results.jsonl can be appended to, and the disk's free space and what the
        directory already holds come to `need_bytes`.
        Raises OSError with the one line to show."""
        # a refused run leaves no results file behind: where there is none yet, a probe file stands in for it
        target = self.results if self.results.exists() else self.path / f".write-check.{os.getpid()}"
        try:
            with open(target, "a"):
                pass
        except OSError as e:
            raise OSError(f"{self.results}: cannot append to it ({e.strerror})") from None
        finally:
            if target != self.results:
                target.unlink(missing_ok=True)
        free = shutil.disk_usage(self.path).free
        # what the directory already holds (a resumed run's weights, caches) counts; walked only when short
        if free < need_bytes and free + (held := dir_bytes(self.path)) < need_bytes:
            raise OSError(f"{self.path}: {free / 2**20:.0f} MiB free on its disk and {held / 2**20:.0f} MiB held "
                          f"in it; a run here needs about {need_bytes / 2**20:.0f} MiB (weights, references, caches)")

    def weights_for(self, task: str) -> Path:
        """The weights a cell starts from: the run's, or for training the run's with residual branches damped
        further (core.model.training_start)."""
        return self.weights if task == "infer" else self.path / f"{self.model}.train-weights.safetensors"

    def write_weights(self, task: str = "infer") -> None:
        """The weights file(s) `task` needs, each written once (to a temporary name, then renamed)."""
        for path, make in ((self.weights, lambda: model_io.build_model(self.model)),
                           (self.weights_for(task),
                            lambda: model_io.training_start(model_io.load_model(self.model, self.weights)))):
            if not path.exists():
                write_atomic(path, lambda tmp, make=make: model_io.write_weights(make(), tmp))

    def input(self, batch: int, res: int, seed: int = 0) -> Path:
        """The run's input of this shape (seed 0: what every cell computes on; another seed: another input)."""
        p = self.path / "inputs" / f"b{batch}_r{res}{_seeded(seed)}.safetensors"
        if not p.exists():
            p.parent.mkdir(exist_ok=True)
            write_atomic(p, lambda tmp: model_io.write_input(model_io.make_input(batch, res, seed), tmp))
        return p

    def reference(self, batch: int, res: int, task: str = "infer", seed: int = 0,
                  recipe: tuple[str, str, str] | None = None) -> Path:
        """The eager fp32 reference (TF32 off): the output of one forward, or for training the loss of each parity
        step and the state after them; of the input of `seed` (core.parity's other input: seed 1). With `recipe`
        (name, dtype, layout): that recipe's output at that dtype (core/recipes.py) instead. Raises
        ReferenceFailed (remembered) if it cannot be computed."""
        key = (batch, res, task, seed, recipe)
        if key in self._failed_refs:
            raise ReferenceFailed(*self._failed_refs[key])
        p, job = self._reference_job(*key)
        if not p.exists():
            proc = procs.run([sys.executable, "-m", "harness.child.reference", *job], cwd=REPO, env=procs.child_env(),
                             capture_output=True, text=True)
            if proc.returncode != 0:
                status, reason = failure_status(proc.returncode, None, proc.stderr[-3000:], disk=self.path)
                what = "training " if task == "train" else ""
                name = f"{recipe[0]} {recipe[1]} recipe " if recipe else f"eager {what}"
                self._failed_refs[key] = (Status.OOM if status == Status.OOM else Status.ERROR,
                                          f"{name}reference (batch {batch}, res {res}) failed: {reason}")
                raise ReferenceFailed(*self._failed_refs[key])
        return p

    def references(self, keys: list[tuple]) -> None:
        """The references of `keys` (reference()'s arguments, in order) not yet made, all in one process: each
        child start imports torch and torchvision (about 5 s on a 2-core host). Any the shared process did not
        write (it stops at the first that fails) is made alone by reference(), which says why it failed; raises
        the first ReferenceFailed after trying every key."""
        jobs = [job for p, job in (self._reference_job(*key) for key in keys) if not p.exists()]
        if len(jobs) > 1:
            (self.path / "refs").mkdir(exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.path / "refs", suffix=".jobs.json") as listing:
                listing.write(json.dumps(jobs))
                listing.flush()
                procs.run([sys.executable, "-m", "harness.child.reference", "jobs", listing.name], cwd=REPO,
                          env=procs.child_env(), capture_output=True, text=True)  # what failed is retried alone
        failed = None
        for key in keys:
            try:
                self.reference(*key)
            except ReferenceFailed as e:
                failed = failed or e
        if failed:
            raise failed

    def _reference_job(self, batch: int, res: int, task: str, seed: int,
                       recipe: tuple[str, str, str] | None) -> tuple[Path, list[str]]:
        """Where a reference is kept, and harness.child.reference's arguments that make it."""
        mark = "_".join(("", *recipe)) if recipe else ""
        p = self.path / "refs" / f"{self.model}_{task}_b{batch}_r{res}{_seeded(seed)}{mark}_{self.device}.safetensors"
        p.parent.mkdir(exist_ok=True)
        files = self._files(task, batch, res, seed, p)
        return p, (["recipe", *files, *recipe] if recipe else ["ref", *files, task])

    def _files(self, task: str, batch: int, res: int, seed: int, out: Path) -> list[str]:
        return [self.model, str(self.weights_for(task)), str(self.input(batch, res, seed)), str(out), self.device]

    def matmul_peak(self, gpu: str | None = None, uuid: str | None = None) -> dict[str, float]:
        """cuBLAS's dense matmul rate per dtype on `gpu` (as CUDA_VISIBLE_DEVICES names it; None: this process's
        first), in a process of its own (the caller keeps no CUDA context). With the GPU's `uuid`, measured once
        per run and kept here under it, where every host of a Ray cluster finds it."""
        peak_file = self.path / (f"peak-{uuid}.json" if uuid else "peak.json")
        if uuid and peak_file.exists():
            return json.loads(peak_file.read_text())["tflops"]
        proc = procs.run([sys.executable, "-m", "harness.child.reference", "peak", str(peak_file)], cwd=REPO,
                         env=procs.child_env(**({"CUDA_VISIBLE_DEVICES": gpu} if gpu else {})), capture_output=True,
                         text=True)
        if proc.returncode != 0:
            raise Refusal(f"measuring the matmul peak failed: {' '.join(proc.stderr.split())[-500:]}", status=1)
        return json.loads(peak_file.read_text())["tflops"]

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
        return {identity(Cell.of_record(r)): r for r in read_jsonl(self.results) if r["status"] in KEPT}

    def append(self, record: dict) -> None:
        """All of one complete line, then fsync; a file whose last line lacks its newline (a crash mid-write) gets
        one first, so the new record is never glued to the torn one. A write that stops short (a full disk) is cut
        back to where the file ended, and raises RecordNotSaved: the record is either whole on disk or absent."""
        line = (json.dumps(record) + "\n").encode()
        fd = os.open(self.results, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            if size:
                with open(self.results, "rb") as f:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        line = b"\n" + line
            try:
                left = memoryview(line)
                while left:  # os.write may take only part of the bytes (a disk that fills between two calls)
                    written = os.write(fd, left)
                    if not written:
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                    left = left[written:]
                os.fsync(fd)
            except OSError as e:
                os.ftruncate(fd, size)
                cell = f"{record.get('label')} b{record.get('batch')} {record.get('dtype')}"
                raise RecordNotSaved(f"{cell} not saved: writing {self.results} failed ({e.strerror}) on "
                                     f"{disk_free(self.results)}") from None
        finally:
            os.close(fd)

    def saved(self) -> int:
        """How many records results.jsonl holds whole: what a message may say is on disk."""
        return len(read_jsonl(self.results)) if self.results.exists() else 0


class RecordNotSaved(OSError):
    """A record that did not reach results.jsonl whole (the file is as it was before it)."""


class ReferenceFailed(Exception):
    def __init__(self, status: str, reason: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason


def _seeded(seed: int) -> str:
    """A file name's mark of another input than the run's own (seed 0 keeps the names runs already have)."""
    return f"_s{seed}" if seed else ""


def cell_dir(run: RunDir, cell: Cell) -> Path:
    d = run.path / "cells" / hashlib.sha1(cell.key.encode()).hexdigest()[:12]
    d.mkdir(parents=True, exist_ok=True)
    return d


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0
