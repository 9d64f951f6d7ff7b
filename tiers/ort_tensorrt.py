"""Rung `ort-tensorrt`: the `onnxruntime` rung with TensorRT as ONNX Runtime's execution provider: the same ONNX
file, IO binding and stream, but ORT hands the graph to TensorRT and runs the engine it builds. Nodes TensorRT
rejects fall back to the CUDA EP on the same stream. No precision flags are set: the graph is exported in the
cell's dtype, and without trt_fp16/bf16_enable ORT builds a strongly typed network, as the `tensorrt` rung does.
The profile is the `tensorrt` rung's; ORT keeps its engines and timing cache in the rung's cache directory."""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
from pathlib import Path

import torch

from tiers.onnxruntime import OnnxRuntime
from tiers.exports.tensorrt import NEEDS_GPU, cache_dir, profile_shapes


def preload_tensorrt() -> None:
    """A pip-installed TensorRT keeps libnvinfer inside site-packages, off the loader's search path; importing
    `tensorrt` loads it into the process, where ORT's provider library then finds it by its soname."""
    with contextlib.suppress(ImportError, OSError):
        import tensorrt  # noqa: F401  (optional: loads libnvinfer where installed)


class OrtTensorRT(OnnxRuntime):
    name = "ort-tensorrt"
    cannot_train = 'TensorRT is an inference engine (no backward pass)'
    options = {**OnnxRuntime.options, "trt-max-batch": None}  # the CUDA EP's option for nodes TensorRT rejects
    caches = ("onnx", "engines", "timing cache")  # the graph, and TensorRT's, built by ORT in the rung's cache
    warm_in_prepare = False  # building an engine times kernels: never beside other jobs
    summary = "ONNX Runtime, TensorRT execution provider (IO binding on a torch stream)"
    provider = "TensorrtExecutionProvider"
    cuda_graph = False  # TensorRT's own graph option (trt_cuda_graph_enable) is not wired: no TensorRT here to test it
    saves_its_graph = False  # its engines are compiled nodes, which ORT cannot save

    def availability(self, device):
        if device != "cuda":
            return NEEDS_GPU
        reason = super().availability(device)
        if reason:
            return reason
        import onnxruntime as ort  # optional: availability() says why it is missing

        # onnxruntime-gpu lists the provider whether or not TensorRT is installed; loading its library as ORT does
        # (the shared provider bridge first, globally) gives the loader's own words for what is missing, such as
        # "libnvinfer.so.10: cannot open shared object file".
        capi = Path(ort.__file__).parent / "capi"
        preload_tensorrt()
        try:
            ctypes.CDLL(str(capi / "libonnxruntime_providers_shared.so"), mode=ctypes.RTLD_GLOBAL)
            ctypes.CDLL(str(capi / "libonnxruntime_providers_tensorrt.so"))
        except OSError as e:
            return f"onnxruntime {ort.__version__} lists {self.provider} but it does not load: {e}"
        return None

    def supports(self, cell):
        if cell.dtype == "fp32":
            # TensorRT allows TF32 unless told not to, and ORT's TensorRT EP has no option that says so.
            return "ORT's TensorRT EP cannot turn TensorRT's TF32 off, so it runs tf32, not strict fp32"
        return super().supports(cell)

    def provider_options(self, cell, stream, store) -> dict:
        import onnxruntime as ort  # optional: availability() says why it is missing

        gpu = (torch.cuda.get_device_name(), torch.cuda.get_device_capability())
        # ORT names its engine files by graph and profile; the directory adds what it leaves out.
        cache = cache_dir(store) / "ort" / hashlib.sha256(repr((ort.__version__, gpu)).encode()).hexdigest()[:16]
        cache.mkdir(parents=True, exist_ok=True)
        low, opt, high = ("input:" + "x".join(map(str, s)) for s in profile_shapes(cell))
        return {"device_id": str(torch.cuda.current_device()), "user_compute_stream": str(stream.cuda_stream),
                "trt_profile_min_shapes": low, "trt_profile_opt_shapes": opt, "trt_profile_max_shapes": high,
                "trt_engine_cache_enable": "True", "trt_engine_cache_path": str(cache),
                "trt_timing_cache_enable": "True", "trt_timing_cache_path": str(cache)}

    def providers(self, cell, stream, store) -> list:
        cuda = (OnnxRuntime.provider, super().provider_options(cell, stream, store))
        return [(self.provider, self.provider_options(cell, stream, store)), cuda, "CPUExecutionProvider"]

    def build(self, model, example, cell, store):
        preload_tensorrt()
        return super().build(model, example, cell, store)


TIER = OrtTensorRT()
