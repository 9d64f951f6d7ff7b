"""Builds the C++ rungs' CMake projects on demand into a cache keyed by what the binary depends on."""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import time
from pathlib import Path

from core import proc as procs
from core.cell import Unavailable
from core.env import files_digest
from core.paths import REPO, USER_CACHE


def require_tools(*tools: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        raise Unavailable(f"{', '.join(missing)} not found on PATH")


def cuda_toolkit() -> Path | None:
    """The CUDA toolkit the C++ rungs build with, found one way for all of them: $CUDA_HOME, $CUDA_PATH, then
    /usr/local/cuda, each only where it holds bin/nvcc; else the toolkit of PATH's nvcc (a wrapper on PATH would
    hide where the toolkit is, so the named places come first)."""
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.access(Path(home) / "bin" / "nvcc", os.X_OK):
            return Path(home)
    found = shutil.which("nvcc")
    return Path(found).resolve().parent.parent if found else None


class BuildError(RuntimeError):
    """Our own C++ failed to build: an error of the project, not a reason the rung cannot run here."""


def sources_missing() -> str | None:
    """Why the C++ sources cannot be built from this copy of the ladder, or None."""
    if not (REPO / "cpp" / "common").is_dir():
        return (f"the C++ sources (cpp/) are not installed with this copy of the ladder ({REPO}); run from a "
                "checkout, or install it with `pip install -e .`")
    return None


def build_dir(project: str, key: dict[str, str], target: str) -> Path:
    """Where `target` of cpp/<project> is built for `key` and the current sources (one directory per target, so
    two targets of a project build side by side)."""
    digest = files_digest(REPO / "cpp" / project, REPO / "cpp" / "common")[:12]
    tag = hashlib.sha256(repr(sorted(key.items())).encode()).hexdigest()[:8]
    return USER_CACHE / "build" / f"{project}-{target}-{tag}-{digest}"


def cmake_build(project: str, key: dict[str, str], cmake_args: list[str], target: str) -> Path:
    """Configures and builds cpp/<project> (Release) once per key and source digest; returns the target's path.

    `key` names what the binary depends on (torch version, CUDA version, ...); it is part of the cache path so
    a different toolchain never reuses a stale build. Raises Unavailable when a tool or the sources are missing,
    BuildError with the build log's tail when the build fails."""
    require_tools("cmake")
    missing = sources_missing()
    if missing:
        raise Unavailable(missing)
    src = REPO / "cpp" / project
    build = build_dir(project, key, target)
    binary = build / target
    build.mkdir(parents=True, exist_ok=True)
    with open(build / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two processes asking at once build once
        if binary.exists():
            return binary
        t0 = time.perf_counter()
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        steps = [
            ["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", *gen, *cmake_args],
            ["cmake", "--build", str(build), "--target", target, "-j", str(os.cpu_count() or 2)],
        ]
        for step in steps:
            proc = procs.run(step, capture_output=True, text=True)
            if proc.returncode != 0:
                tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
                raise BuildError(f"building cpp/{project} failed: " + " | ".join(tail))
        (build / "build_seconds.txt").write_text(f"{time.perf_counter() - t0:.1f}\n")
        return binary
