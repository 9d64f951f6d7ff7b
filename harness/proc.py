"""Child processes that never outlive the ladder.

Every process the ladder starts goes through `popen` / `run`: it starts in a session (process group) of its own, so
Ctrl-C in the terminal reaches only the ladder, which then ends the group; and on Linux it carries
PR_SET_PDEATHSIG=SIGKILL, set by a small launcher (`python harness/proc.py PPID PROGRAM...`, stdlib only, which then
execs the program in place), so the kernel kills it even when the ladder itself is killed with SIGKILL. The launcher is used
instead of `preexec_fn`, which is unsafe in a process with threads (the ladder samples NVML on one)."""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from typing import Any

PR_SET_PDEATHSIG = 1
LINUX = sys.platform.startswith("linux")


def wrap(argv: list[str]) -> list[str]:
    return [sys.executable, "-I", os.path.abspath(__file__), str(os.getpid()), *argv] if LINUX else argv


def popen(argv: list[str], **kw: Any) -> subprocess.Popen:
    return subprocess.Popen(wrap(argv), start_new_session=True, **kw)


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


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the child's whole process group (its own children too), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _launch(parent: int, argv: list[str]) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the ladder died before the line above: follow it now
        os._exit(137)
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    _launch(int(sys.argv[1]), sys.argv[2:])
