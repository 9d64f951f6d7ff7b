"""A cell's status: what its record's `status` holds, each with its meaning, in one place. A str enum, so that a
record written to JSON holds the plain word and a record read back (a plain string) compares equal to its member."""
from __future__ import annotations

from enum import Enum


class Status(str, Enum):
    __str__ = str.__str__  # the word itself in messages and f-strings (enum.StrEnum's behaviour, from Python 3.11)
    __format__ = str.__format__

    OK = "ok"
    PARITY_FAIL = "parity-fail"
    CRASHED = "crashed"
    OOM = "oom"
    TIMEOUT = "timeout"
    ERROR = "error"
    INTERRUPTED = "interrupted"
    CONTENDED = "contended"
    UNAVAILABLE = "unavailable"
    SKIPPED = "skipped"


MEANING = {
    Status.OK: "measured, parity ok",
    Status.PARITY_FAIL: "output differs from the eager fp32 reference; timings withheld",
    Status.CRASHED: "killed by a signal or a non-zero exit",
    Status.OOM: "an allocator refused, or the kernel's OOM killer",
    Status.TIMEOUT: "no result within --timeout",
    Status.ERROR: "an exception, a failed build of our own code, or a failed eager reference",
    Status.INTERRUPTED: "Ctrl-C, SIGTERM or SIGHUP while it ran",
    Status.CONTENDED: "measured beside another busy process under --isolation-check error; timings withheld",
    Status.UNAVAILABLE: "rung cannot run here",
    Status.SKIPPED: "rung does not implement this configuration",
}

KEPT = (Status.OK, Status.PARITY_FAIL, Status.SKIPPED)  # a rerun keeps these and tries the rest again
FAILED = (Status.CRASHED, Status.OOM, Status.TIMEOUT, Status.ERROR, Status.PARITY_FAIL, Status.CONTENDED)
NOT_RUN = (Status.UNAVAILABLE, Status.SKIPPED)  # cells the compact table leaves out

DEFINITION = ("one of: " + "; ".join(f"'{s}' ({MEANING[s]})" for s in Status) + "; 'reason' says why. A rerun keeps "
              + ", ".join(KEPT) + " and tries the rest again")
