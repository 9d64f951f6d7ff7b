"""Why a child ended without a result: its status ('oom', 'crashed', 'error') and reason in one line."""
from __future__ import annotations

import shutil
import signal
from pathlib import Path

from core.files import disk_free
from harness.run.status import Status

DISK_FULL_WORDS = ("no space left on device", "errno 28", "disk quota exceeded")
DISK_NEARLY_FULL = 16 << 20  # free bytes under which a child's silent death is put down to the disk

OOM_WORDS = ("out of memory", "outofmemoryerror", "cudaerrormemoryallocation", "std::bad_alloc", "cannot allocate")


def cgroup_oom_kills() -> int | None:
    """The kernel OOM killer's count for this cgroup (cgroup v2), to tell its SIGKILL from others."""
    try:
        for line in Path("/sys/fs/cgroup/memory.events").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def failure_status(returncode: int, error_line: str | None, stderr_tail: str,
                   oom_killed: bool = False, disk: Path | None = None) -> tuple[str, str]:
    """Classifies a child that did not finish: (status, reason). An allocator's refusal is 'oom' whoever reports it;
    a write refused for space, or a death without a word while `disk` (the run directory) is full, is 'error' with
    the disk named."""
    last = stderr_tail.strip().splitlines()[-1][-300:] if stderr_tail.strip() else ""
    said_full = any(w in f"{error_line or ''} {stderr_tail}".lower() for w in DISK_FULL_WORDS)
    if disk is not None and (said_full or shutil.disk_usage(disk).free < DISK_NEARLY_FULL):
        return Status.ERROR, f"disk full: {disk_free(disk)}; " + (error_line or last or f"exit code {returncode}, no output")
    if error_line:
        return (Status.OOM if any(w in error_line.lower() for w in OOM_WORDS) else Status.ERROR), error_line
    if any(w in stderr_tail.lower() for w in OOM_WORDS):
        return Status.OOM, "out of memory: " + last
    if returncode < 0:
        name = signal.Signals(-returncode).name
        if oom_killed:
            return Status.OOM, f"killed by {name} from the kernel's OOM killer (cgroup memory.events oom_kill grew)"
        return Status.CRASHED, f"killed by {name}" + (f": {last}" if last else "")
    return Status.CRASHED, f"exit code {returncode}: {last or 'no output'}"
