"""Child processes that never outlive the ladder.

Every process the ladder starts goes through `popen` / `run`: it starts in a session (process group) of its own, so
Ctrl-C in the terminal reaches only the ladder, which then ends the group; and on Linux it carries
PR_SET_PDEATHSIG=SIGKILL, set by a small launcher (`python core/launcher.py PPID PROGRAM...`, stdlib only, which then
execs the program in place), so the kernel kills it even when the ladder itself is killed with SIGKILL. The
launcher is used instead of `preexec_fn`, which is unsafe in a process with threads (the ladder samples NVML on one)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from core.paths import REPO

LAUNCHER = Path(__file__).with_name("launcher.py")
LINUX = sys.platform.startswith("linux")


def wrap(argv: list[str]) -> list[str]:
    return [sys.executable, "-I", str(LAUNCHER), str(os.getpid()), *argv] if LINUX else argv


_LIVE: set[subprocess.Popen] = set()  # every child started here, until it is seen to have ended
_LIVE_LOCK = threading.Lock()


def popen(argv: list[str], **kw: Any) -> subprocess.Popen:
    proc = subprocess.Popen(wrap(argv), start_new_session=True, **kw)
    with _LIVE_LOCK:
        _LIVE.difference_update([p for p in _LIVE if p.poll() is not None])
        _LIVE.add(proc)
    return proc


def kill_all() -> int:
    """Ends every child still running (each whole group): what a Ctrl-C does to jobs running on other threads,
    which then return at once instead of when their build or export would have ended. Returns how many."""
    with _LIVE_LOCK:
        running = [p for p in _LIVE if p.poll() is None]
    for proc in running:
        kill_group(proc)
    return len(running)


def run(argv: list[str], timeout: float | None = None, **kw: Any) -> subprocess.CompletedProcess:
    """subprocess.run through `popen`: on a timeout or an exception (KeyboardInterrupt) the whole group ends."""
    kw.setdefault("capture_output", False)
    if kw.pop("capture_output"):
        kw.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc = popen(argv, **kw)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        kill_group(proc)
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def child_env(**extra: str) -> dict[str, str]:
    """The environment of every child the ladder starts: this checkout importable, whatever the caller's working
    directory, plus `extra`."""
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **extra}


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the child's whole process group (its own children too), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
