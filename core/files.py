"""Files written whole or not at all: a reader, or a crash, or a full disk, leaves the old file or the new one,
never a part of one."""
from __future__ import annotations

import os
import shutil
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


def mount_point(path: Path) -> Path:
    """The mount point of the filesystem that holds `path` (which may not exist yet)."""
    path = Path(path).resolve()
    while not path.exists():
        path = path.parent
    while not os.path.ismount(path):
        path = path.parent
    return path


def disk_free(path: Path) -> str:
    """`path`'s disk in words, for a message: its mount point and the MiB free on it."""
    mount = mount_point(path)
    return f"the disk mounted at {mount} ({shutil.disk_usage(mount).free / 2**20:.0f} MiB free)"
