"""The environment a result was measured in, and NVML access for the runner (which holds no CUDA context)."""
from __future__ import annotations

import datetime
import functools
import hashlib
import importlib
import os
import platform
import socket
import subprocess
from pathlib import Path
from typing import Any

import torch

from core.paths import REPO

# Datasheet dense (no sparsity) peaks in TFLOP/s, for 'share of peak'; the run also measures cuBLAS's rate.
DATASHEET_PEAK_TFLOPS = {
    "H100 80GB HBM3": {"fp32": 66.9, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4},  # SXM5
    "H200": {"fp32": 66.9, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4},
    "H100 PCIe": {"fp32": 51.2, "tf32": 378.0, "fp16": 756.0, "bf16": 756.0},
    "A100": {"fp32": 19.5, "tf32": 156.0, "fp16": 312.0, "bf16": 312.0},
    "L4": {"fp32": 30.3, "tf32": 60.0, "fp16": 121.0, "bf16": 121.0},
}


def nvml():
    """pynvml, initialised, or None when there is no NVIDIA driver."""
    try:
        import pynvml  # fails without an NVIDIA driver: nvml() says None

        pynvml.nvmlInit()
        return pynvml
    except Exception:
        return None


def gpu_handle(device: str | None = None):
    """(pynvml, the handle of one GPU) or (None, None). `device` names it as CUDA_VISIBLE_DEVICES does (an index or
    a UUID); by default the first GPU this process may use: NVML ignores CUDA_VISIBLE_DEVICES, so it is read here."""
    nv = nvml()
    if nv is None:
        return None, None
    device = device or os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
    try:
        return nv, (nv.nvmlDeviceGetHandleByUUID(device) if device.startswith(("GPU-", "MIG-"))
                    else nv.nvmlDeviceGetHandleByIndex(int(device)))
    except Exception:
        return None, None


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (all of the host's without it)."""
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return [d.strip() for d in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    nv = nvml()
    return [str(i) for i in range(nv.nvmlDeviceGetCount())] if nv else []


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def where(device: str | None) -> dict[str, Any]:
    """Which machine and GPU measure: the host's name, and the GPU's name, UUID and the CPUs nearest it (the cores
    of its NUMA node, where the host says; None otherwise)."""
    out: dict[str, Any] = {"host": socket.gethostname()}
    nv, h = gpu_handle(device)
    if h is None:
        return out
    out["gpu"] = {"name": _text(nv.nvmlDeviceGetName(h)), "uuid": _text(nv.nvmlDeviceGetUUID(h))}
    try:
        bus = _text(nv.nvmlDeviceGetPciInfo(h).busId).lower()[-12:]  # domain:bus:device.function, as sysfs names it
        node = int(Path(f"/sys/bus/pci/devices/{bus}/numa_node").read_text())
        out["numa_cpus"] = (cpu_list(Path(f"/sys/devices/system/node/node{node}/cpulist").read_text())
                            if node >= 0 else None)
    except Exception:  # NVML without PCI info, no sysfs entry, or no NUMA: no pinning
        out["numa_cpus"] = None
    return out


def cpu_text(cpus) -> str:
    """[0, 1, 2, 3, 8] as '0-3,8' (the kernel's cpulist format)."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def cpu_list(text: str) -> list[int]:
    """'0-3,8,10-11' as [0, 1, 2, 3, 8, 10, 11] (the kernel's cpulist format)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        low, _, high = part.partition("-")
        cpus += range(int(low), int(high or low) + 1)
    return cpus


def _version(module: str) -> str | None:
    try:
        return importlib.import_module(module).__version__
    except Exception:
        return None


def datasheet_peak(gpu_name: str | None) -> dict[str, float] | None:
    for key, peaks in DATASHEET_PEAK_TFLOPS.items():
        if gpu_name and key in gpu_name:
            return peaks
    return None


SOURCE = ("pyproject.toml", "core", "harness", "tiers", "kernels", "cpp", "bench")


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def files_digest(*paths: Path) -> str:
    """sha256 over the files under `paths` (names and contents, in a fixed order), build outputs left out."""
    h = hashlib.sha256()
    for path in paths:
        for f in sorted([path] if path.is_file() else path.rglob("*")):
            if f.is_file() and not {"build", "__pycache__"} & set(f.relative_to(REPO).parts):
                h.update(str(f.relative_to(REPO)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


@functools.cache
def source_revision() -> dict[str, Any]:
    """Which code measured: the git commit where the checkout has its .git, and always a digest of the source files
    (a copied tree can carry an older .git: then git_dirty is true and only the digest names the code).
    Computing it in a checkout of commit C tells whether C is the digest's code."""
    out: dict[str, Any] = {"digest": files_digest(*(REPO / p for p in SOURCE))[:16], "git_commit": None,
                           "git_dirty": None}
    try:
        git = ["git", "-C", str(REPO)]
        out["git_commit"] = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True,
                                           check=True).stdout.strip()
        out["git_dirty"] = bool(subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"],
                                               capture_output=True, text=True, check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        pass  # no git, or no .git here: the digest still names the code
    return out


def environment(device: str, host_cpu: dict[str, Any] | None = None) -> dict[str, Any]:
    """What measured: code, host, software, GPU; `host_cpu`: the host's steadiness (harness.run.host_noise), if probed."""
    env: dict[str, Any] = {
        "started_utc": utc_now(),
        "source": source_revision(),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn": _cudnn_version(),
        "torchvision": _version("torchvision"),
        "triton": _version("triton"),
        "onnx": _version("onnx"),
        "onnxruntime": _version("onnxruntime"),
        "tensorrt": _version("tensorrt"),
        "device": device,
        "gpu": None,
        "host_cpu": host_cpu,
    }
    try:
        import onnxruntime  # optional: a rung's availability says why it is missing

        env["onnxruntime_providers"] = onnxruntime.get_available_providers()
    except Exception:
        pass
    nv, h = gpu_handle()
    if device == "cuda" and h is not None:
        def text(v):
            return v.decode() if isinstance(v, bytes) else v

        mem = nv.nvmlDeviceGetMemoryInfo(h)
        name = text(nv.nvmlDeviceGetName(h))
        cuda_driver = nv.nvmlSystemGetCudaDriverVersion()
        env["gpu"] = {
            "name": name,
            "driver": text(nv.nvmlSystemGetDriverVersion()),
            "cuda_driver": f"{cuda_driver // 1000}.{cuda_driver % 1000 // 10}",
            "memory_total_bytes": mem.total,
            "sm_clock_max_mhz": nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM),
            "mem_clock_max_mhz": nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_MEM),
            "sm_clock_idle_mhz": nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
            "power_limit_w": nv.nvmlDeviceGetPowerManagementLimit(h) / 1000,
            "datasheet_peak_tflops": datasheet_peak(name),
        }
    return env


def _cudnn_version() -> str | None:
    try:
        v = torch.backends.cudnn.version()
    except Exception:
        return None
    return f"{v // 10000}.{v % 10000 // 100}.{v % 100}" if v else None


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def device_slug(env: dict[str, Any]) -> str:
    """Folder name under results/ for this device, e.g. 'nvidia-h100-80gb-hbm3' or 'cpu'."""
    name = env["gpu"]["name"] if env.get("gpu") else "cpu"
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-").replace("--", "-")


def default_device() -> str:
    """'cuda' where NVML finds an NVIDIA GPU, else 'cpu' (without creating a CUDA context)."""
    return "cuda" if gpu_handle()[1] is not None else "cpu"
