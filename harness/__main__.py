import os
import signal
import sys


def _interrupted_while_starting(signum, frame):
    # Exits at once rather than raising KeyboardInterrupt inside an import, where a library's bare `except:` can
    # swallow it and the program runs on as if no Ctrl-C had come.
    print("interrupted while starting; nothing was measured", file=sys.stderr, flush=True)
    os._exit(130)


# Ctrl-C while torch imports (the first seconds): one line, not a traceback; SIGINT left ignored where it was
starting = signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
if starting:
    signal.signal(signal.SIGINT, _interrupted_while_starting)
from harness.cli import main  # noqa: E402

if starting:
    signal.signal(signal.SIGINT, signal.default_int_handler)
sys.exit(main())
