"""Rung `tensorrt`: the ONNX model of the `onnxruntime` rung (tiers/exports/onnx.py) built into a TensorRT engine
with the `tensorrt` Python API and run with execute_async_v3 on a torch side stream, reading and writing torch's
device buffers directly (no copies, no allocator of its own between calls).

Precision comes from the graph: the ONNX is exported in the cell's dtype and parsed into a *strongly typed*
network, so TensorRT computes in exactly the types the graph names; TF32 is allowed for `tf32` cells only.
The optimisation profile covers batch 1 .. max(batch, option `trt-max-batch`, default 256), tuned for the cell's
batch. Engines and the timing cache are kept in the rung's cache directory (the run's cache/tensorrt/), keyed by
everything an engine depends on; build_stats says whether the engine was built (and how long that took: the
rung's JIT overhead) or loaded from the cache.

Where only TensorRT-RTX is installed (`tensorrt_rtx`, the consumer-GPU edition with the same API) it is used
through the same code; its differences are in `is_rtx` and `RTX_COMPUTE_CAPABILITIES`."""
from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from core.cell import Built, Cell, Unavailable
from core.env import gpu_handle
from tiers.base import PythonTier
from tiers.exports.onnx import BF16_EXPORT, bound_input, export_onnx, onnx_dir
from tiers.exports.tensorrt import NEEDS_GPU, cache_dir, profile_shapes

NOT_INSTALLED = ("TensorRT Python package not installed (PyPI's `tensorrt` is a stub that downloads from "
                 "pypi.nvidia.com; install it from NVIDIA's index)")

# Compute capabilities TensorRT-RTX supports, from its support matrix ("Supported Hardware", releases 1.0 to 1.5:
# https://docs.nvidia.com/deeplearning/tensorrt-rtx/latest/getting-started/support-matrix.html): 7.5 Turing,
# 8.6 Ampere (RTX 30xx), 8.9 Ada (RTX 40xx), 12.0 Blackwell (RTX 50xx), and 12.1 (GB10) from 1.5 on. The
# datacenter architectures (8.0 A100, 9.0 H100/H200, 10.0 B200) are not on it; TensorRT-RTX refuses them.
RTX_COMPUTE_CAPABILITIES = {(7, 5), (8, 6), (8, 9), (12, 0), (12, 1)}


def is_rtx(trt: Any) -> bool:
    """TensorRT-RTX compiles its kernels just in time when the engine runs, so it has no builder timing cache
    (ITimingCache is a no-op there, deprecated in 1.2: docs.nvidia.com/deeplearning/tensorrt-rtx/latest/
    inference-library/timing-cache-migration.html), and it supports only RTX_COMPUTE_CAPABILITIES."""
    return trt.__name__ == "tensorrt_rtx"


def _import(name: str) -> tuple[Any, str | None]:
    """(module, None); (None, None) when `name` is not installed; (None, why) when it is there but broken."""
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name == name:
            return None, None
        # PyPI's `tensorrt` front end installs without what it wraps when pypi.nvidia.com was not reachable.
        return None, (f"`{name}` is installed but not the bindings it wraps ({e}); PyPI's `tensorrt` gets them "
                      "from pypi.nvidia.com: install TensorRT from NVIDIA's index")
    except (ImportError, OSError) as e:
        return None, f"`{name}` is installed but does not load: {e}"
    if not hasattr(module, "Builder"):
        return None, (f"`{name}` at {getattr(module, '__file__', None) or list(module.__path__)} has no Builder: a "
                      "stub, not TensorRT's bindings; install TensorRT from NVIDIA's index")
    return module, None


@functools.cache
def load_tensorrt() -> tuple[Any, str | None]:
    """(the TensorRT module, None) or (None, the exact reason there is none): `tensorrt`, else `tensorrt_rtx`."""
    for name in ("tensorrt", "tensorrt_rtx"):
        module, reason = _import(name)
        if module is not None or reason is not None:
            return module, reason
    return None, NOT_INSTALLED


def nvml_gpu() -> tuple[str, tuple[int, int]] | None:
    """Name and compute capability of GPU 0 from NVML, which (unlike torch.cuda) creates no CUDA context: the
    parent asks for availability and must stay context-free. None without an NVIDIA driver."""
    nv, handle = gpu_handle()
    if handle is None:
        return None
    return nv.nvmlDeviceGetName(handle), tuple(nv.nvmlDeviceGetCudaComputeCapability(handle))


def onnx_digest(path: Path) -> str:
    """Digest of the ONNX file and its external-data files (the exporter may put the weights beside it)."""
    h = hashlib.sha256()
    for p in sorted(path.parent.glob(path.name + "*")):
        h.update(p.name.removeprefix(path.name).encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def engine_key(model: str, onnx_sha: str, shapes: tuple, dtype: str, trt_version: str,
               gpu: tuple[str, tuple[int, int]]) -> str:
    """Names a cached engine: it is valid only for this graph, profile, precision, TensorRT build and GPU."""
    facts = [model, onnx_sha, [list(s) for s in shapes], dtype, trt_version, gpu[0], list(gpu[1])]
    return hashlib.sha256(json.dumps(facts).encode()).hexdigest()[:20]


def _write_atomic(path: Path, data: bytes) -> None:
    """Another process may be reading the cache: it sees the old file or the whole new one, never a part."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _device_memory_bytes(engine: Any) -> int:
    # device_memory_size_v2 appeared in TensorRT 10.1; TensorRT 11 removed device_memory_size.
    size = getattr(engine, "device_memory_size_v2", None)
    return engine.device_memory_size if size is None else size


def build_plan(trt: Any, logger: Any, onnx_path: Path, cell: Cell, shapes: tuple, timing_file: Path) -> bytes:
    """The serialized engine for the cell."""
    builder = trt.Builder(logger)
    # Strongly typed rather than the FP16/BF16 builder flags: with the flags TensorRT may still choose fp32 for any
    # layer it finds faster, so an "fp16" engine would be a mixture; strongly typed, the exported graph's types are
    # authoritative, which is what the ladder's dtype means and what the onnxruntime rung runs. The flags are also
    # gone from TensorRT 11 and TensorRT-RTX (both point to strong typing; in 11 strong typing is always on and
    # this flag is accepted and ignored).
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):  # from the file, so external weight files beside it resolve
        errors = "; ".join(parser.get_error(i).desc() for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT's ONNX parser rejected {onnx_path.name}: {errors}")
    config = builder.create_builder_config()
    # TF32 is on by default in TensorRT; fp32 means strict fp32, and fp16/bf16 graphs have no fp32 math to use it.
    if cell.dtype == "tf32":
        config.set_flag(trt.BuilderFlag.TF32)
    else:
        config.clear_flag(trt.BuilderFlag.TF32)
    profile = builder.create_optimization_profile()
    profile.set_shape("input", *shapes)
    config.add_optimization_profile(profile)
    timing = None
    if not is_rtx(trt):
        timing = config.create_timing_cache(timing_file.read_bytes() if timing_file.exists() else b"")
        config.set_timing_cache(timing, False)  # False: a cache from another GPU or version is not silently used
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError("TensorRT could not build the engine (its log on stderr says why)")
    if timing is not None:
        _write_atomic(timing_file, bytes(timing.serialize()))
    return bytes(plan)


class TensorRT(PythonTier):
    name = "tensorrt"
    cannot_train = 'TensorRT is an inference engine (no backward pass)'
    options = {"trt-max-batch": None}
    caches = ("onnx", "engines", "timing cache")
    summary = "TensorRT engine from the ONNX export (strongly typed), execute_async_v3 on a torch stream"

    def availability(self, device):
        if device != "cuda":
            return NEEDS_GPU
        trt, reason = load_tensorrt()
        if reason:
            return reason
        gpu = nvml_gpu() if is_rtx(trt) else None
        if gpu and gpu[1] not in RTX_COMPUTE_CAPABILITIES:
            (major, minor), name = gpu[1], gpu[0]
            return f"TensorRT-RTX {trt.__version__} does not support compute capability {major}.{minor} ({name})"
        return None

    half = "fp16"  # its graph comes from the ONNX export, whose bf16 graph is invalid (BF16_EXPORT)

    def supports(self, cell):
        if cell.dtype == "bf16":  # the strongly typed network would be parsed from that invalid graph
            return BF16_EXPORT
        return super().supports(cell)

    def build(self, model, example, cell, store):
        trt, reason = load_tensorrt()
        if reason:
            raise Unavailable(reason)
        workdir, keep = onnx_dir(store)
        path, facts = export_onnx(model, example, cell, workdir)
        shapes = profile_shapes(cell)
        version = f"{trt.__name__} {trt.__version__}"
        gpu = (torch.cuda.get_device_name(), torch.cuda.get_device_capability())
        root = cache_dir(store)
        root.mkdir(parents=True, exist_ok=True)
        key = engine_key(cell.model, onnx_digest(path), shapes, cell.dtype, version, gpu)
        engine_file = root / f"{cell.model}-{cell.dtype}-{key}.engine"
        timing_file = root / f"timing-{hashlib.sha256(repr((version, gpu)).encode()).hexdigest()[:16]}.cache"
        logger = trt.Logger(trt.Logger.WARNING)
        stats = {**facts, "tensorrt_version": version, "engine_file": str(engine_file),
                 "profile_shapes": [list(s) for s in shapes]}
        if engine_file.exists():
            plan = engine_file.read_bytes()
            stats.update(engine_cache="hit", engine_build_s=0.0)
        else:
            t = time.perf_counter()
            plan = build_plan(trt, logger, path, cell, shapes, timing_file)
            stats.update(engine_cache="miss", engine_build_s=time.perf_counter() - t)
            _write_atomic(engine_file, plan)

        runtime = trt.Runtime(logger)
        engine = runtime.deserialize_cuda_engine(plan)
        if engine is None:
            raise RuntimeError(f"TensorRT could not load {engine_file} (its log on stderr says why)")
        context = engine.create_execution_context()  # allocates its activation memory now, not per call
        x = bound_input(example, cell)
        if not x.is_contiguous():
            raise ValueError("TensorRT reads the input as a dense buffer; the bound input is not contiguous")
        context.set_input_shape("input", tuple(x.shape))
        torch_dtype = {trt.DataType.FLOAT: torch.float32, trt.DataType.HALF: torch.float16,
                       trt.DataType.BF16: torch.bfloat16}[engine.get_tensor_dtype("logits")]
        out = torch.empty(tuple(context.get_tensor_shape("logits")), dtype=torch_dtype, device="cuda")
        context.set_tensor_address("input", x.data_ptr())
        context.set_tensor_address("logits", out.data_ptr())
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())  # the input was written on the current stream
        handle = stream.cuda_stream

        def forward(_x):
            if not context.execute_async_v3(handle):
                raise RuntimeError("TensorRT execute_async_v3 failed (its log on stderr says why)")
            return out

        forward.keepalive = (keep, logger, runtime, engine, context)
        memory = {"engine_device_memory_bytes": _device_memory_bytes(engine), "engine_bytes": len(plan)}
        return Built(forward=forward, stream=stream, uses_torch_allocator=False,
                     stream_description="torch side stream handed to TensorRT's execute_async_v3",
                     stats={**stats, **memory, "memory": memory})


TIER = TensorRT()
