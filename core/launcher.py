"""`python -I core/launcher.py PPID PROGRAM...`: sets PR_SET_PDEATHSIG=SIGKILL, then execs PROGRAM in place, so
the kernel kills it when the ladder (PPID) dies, even by SIGKILL. Standard library only: it runs isolated (-I)."""
import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def _launch(parent: int, argv: list[str]) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the ladder died before the line above: follow it now
        os._exit(137)
    os.execvp(argv[0], argv)

if __name__ == "__main__":
    _launch(int(sys.argv[1]), sys.argv[2:])
