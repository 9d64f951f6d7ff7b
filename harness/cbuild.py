"""Builds the C++ rungs' CMake projects on demand into a cache keyed by what the binary depends on."""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path

from harness.env import files_digest
from tiers.base import Unavailable

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("LADDER_CACHE", Path.home() / ".cache" / "tier-ladder"))


def require_tools(*tools: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        raise Unavailable(f"{', '.join(missing)} not found on PATH")


def cmake_build(project: str, key: dict[str, str], cmake_args: list[str], target: str) -> Path:
    """Configures and builds cpp/<project> (Release) once per key and source digest; returns the target's path.

    `key` names what the binary depends on (torch version, CUDA version, ...); it is part of the cache path so
    a different toolchain never reuses a stale build. Raises Unavailable with the build log's tail on failure."""
    require_tools("cmake")
    src = REPO / "cpp" / project
    digest = files_digest(src, REPO / "cpp" / "common")[:12]
    tag = hashlib.sha256(repr(sorted(key.items())).encode()).hexdigest()[:8]
    build = CACHE / "build" / f"{project}-{tag}-{digest}"
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
            proc = subprocess.run(step, capture_output=True, text=True)
            if proc.returncode != 0:
                tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
                raise Unavailable(f"building cpp/{project} failed: " + " | ".join(tail))
        (build / "build_seconds.txt").write_text(f"{time.perf_counter() - t0:.1f}\n")
        return binary
