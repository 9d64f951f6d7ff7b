"""Files written whole or not at all: a reader, or a crash, or a full disk, leaves the old file or the new one,
never a part of one."""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Callable


def write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` fills a temporary file beside `path` (same filesystem), which then replaces `path` in one
    rename; on any failure the temporary file is removed and `path` is as it was."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: Path, text: str) -> None:
    def write(tmp: Path) -> None:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    write_atomic(path, write)
