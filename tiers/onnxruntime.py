"""Rung `onnxruntime`: the exported ONNX model in ONNX Runtime. On the GPU: the CUDA execution provider, run on
the worker's CUDA stream (`user_compute_stream`) with IO binding to torch's device buffers and no sync at the end
of Run, so the protocol's CUDA events time exactly ORT's work; NHWC kernels for a channels-last cell, the
provider's own CUDA graph for a cuda_graph cell, and fp16 as its 16-bit type (it has no bf16 pooling kernels).
On the CPU: the CPU execution provider."""
from __future__ import annotations

import json
import tempfile
from importlib import metadata
from pathlib import Path

import numpy as np
import torch

from core.cell import Built
from core.layers import BASIS, LAYER
from tiers.base import PythonTier
from tiers.exports.onnx import BF16_EXPORT, batch_dim, bound_input, export_onnx, node_layers, onnx_dir


def installed(distribution: str) -> bool:
    try:
        metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True


def ort_element_type(dtype: torch.dtype):
    return {torch.float32: np.float32, torch.float16: np.float16}.get(dtype)


class OnnxRuntime(PythonTier):
    name = "onnxruntime"
    cannot_train = "ONNX Runtime's training API (onnxruntime-training) is deprecated; this rung runs InferenceSession"
    summary = "ONNX Runtime (CUDA EP with IO binding on GPU; CPU EP on CPU)"
    provider = "CUDAExecutionProvider"
    half = "fp16"  # the CUDA EP has no bf16 MaxPool or GlobalAveragePool (docs/OperatorKernels.md): deployed in fp16
    cuda_graph = True  # the CUDA EP's own graph (enable_cuda_graph), on the bound buffers
    # ORT saves the graph it runs (the census places renamed nodes by it) only where no EP compiles nodes into an
    # engine of its own, as TensorRT's does (onnxruntime issue #12804)
    saves_its_graph = True
    # conv-algo-search: how the CUDA EP picks each convolution's cuDNN algorithm: timing them all (ORT's default),
    # cuDNN's heuristic, or always implicit-precomp GEMM; the choice moves both speed and fp32 rounding.
    # fp16-graph: how the fp16 graph is made (tiers/exports/onnx.py export_onnx): the converter's is 2-2.5x closer
    # to eager fp32 on ResNet-50 (docs/notes/ort-fp16.md).
    # fuse-conv-bias: the CUDA EP's fuse_conv_bias (off by default): each convolution's bias (BatchNorm folded by
    # the exporter) in the convolution's own cuDNN graph; off, the fp16 census on the H100 shows a separate
    # bias-add pass after every convolution (10.8 of 26.2 ms).
    options = {"conv-algo-search": ("EXHAUSTIVE", "HEURISTIC", "DEFAULT"), "fp16-graph": ("converter", "export"),
               "fuse-conv-bias": ("0", "1")}
    caches = ("onnx",)  # the exported graphs (tiers/exports/onnx.py onnx_dir): one per graph serves the rung's cells
    warm_in_prepare = True  # the prepare stage exports them beside its other jobs

    def availability(self, device):
        try:
            import onnxruntime as ort  # optional: availability() says why it is missing
        except ImportError as e:
            return f"onnxruntime not installed ({e})"
        if device == "cuda" and self.provider not in ort.get_available_providers():
            return (f"onnxruntime {ort.__version__} lists no {self.provider} (providers: "
                    f"{', '.join(ort.get_available_providers())}); "
                    + ("onnxruntime-gpu is installed, but so is onnxruntime, and they share one module: `pip "
                       "uninstall -y onnxruntime onnxruntime-gpu && pip install onnxruntime-gpu`"
                       if installed("onnxruntime-gpu") else "install onnxruntime-gpu"))
        return None

    def supports(self, cell):
        if cell.dtype == "bf16":
            return BF16_EXPORT
        return super().supports(cell)

    def provider_options(self, cell, stream, store) -> dict:
        return {"device_id": str(torch.cuda.current_device()), "user_compute_stream": str(stream.cuda_stream),
                **self.tuning(cell)}

    def tuning(self, cell) -> dict[str, str]:
        """The CUDA EP's options that shape its speed, as the record shows them: TF32, the convolution algorithm
        search, NHWC kernels where the cell is channels-last, and its own CUDA graph for a cuda_graph cell."""
        return {"use_tf32": "1" if cell.dtype == "tf32" else "0",
                "cudnn_conv_algo_search": self.setting(cell, "conv-algo-search"),
                "prefer_nhwc": "1" if cell.channels_last else "0",
                "fuse_conv_bias": self.setting(cell, "fuse-conv-bias"),
                "enable_cuda_graph": "1" if cell.cuda_graph else "0"}

    def providers(self, cell, stream, store) -> list:
        """The execution providers in ORT's order of preference (a variant rung may put another first)."""
        return [(self.provider, self.provider_options(cell, stream, store)), "CPUExecutionProvider"]

    def build(self, model, example, cell, store):
        import onnxruntime as ort  # optional: availability() says why it is missing

        workdir, keep = onnx_dir(store)
        path, facts = export_onnx(model, example, cell, workdir, self.setting(cell, "fp16-graph"))
        x = bound_input(example, cell)
        if cell.device == "cuda":
            ort.preload_dlls()  # the CUDA and cuDNN libraries torch's own nvidia packages bring: no other CUDA
            stream = torch.cuda.Stream()
            providers = self.providers(cell, stream, store)
        else:
            providers = ["CPUExecutionProvider"]

        out = None  # the bound output, shaped by the first session's graph (its batch axis: the cell's batch)

        def session_of(profile_dir: Path | None = None):
            """A session of the model and its forward: on the GPU bound to the example and `out` (IO binding). With
            `profile_dir`, ORT's profiler on, writing there, and the graph ORT runs kept there (where it can)."""
            nonlocal out
            so = session_options(path, cell)
            if profile_dir:
                so.enable_profiling = True
                so.profile_file_prefix = str(profile_dir / "ort-census")
                if self.saves_its_graph:
                    so.optimized_model_filepath = str(profile_dir / "optimized.onnx")
            session = ort.InferenceSession(str(path), so, providers=providers)
            if cell.device == "cpu":
                feed = {"input": x.numpy()}  # shares memory with the example tensor
                return session, lambda _x: torch.from_numpy(session.run(None, feed)[0])
            elem = ort_element_type(example.dtype)
            if elem is None:
                raise ValueError(f"no IO-binding element type for {example.dtype} in onnxruntime's Python API")
            if out is None:
                shape = [d if isinstance(d, int) else cell.batch for d in session.get_outputs()[0].shape]
                out = torch.empty(shape, device="cuda", dtype=example.dtype)
            binding = session.io_binding()
            binding.bind_input("input", "cuda", torch.cuda.current_device(), elem, list(x.shape), x.data_ptr())
            binding.bind_output("logits", "cuda", torch.cuda.current_device(), elem, list(out.shape),
                                out.data_ptr())
            run_options = ort.RunOptions()
            run_options.add_run_config_entry("disable_synchronize_execution_providers", "1")

            def forward(_x):
                session.run_with_iobinding(binding, run_options)
                return out

            return session, forward

        def profiled():
            """The census's twin: a session of its own with ORT's profiler on (on from its creation, so never the
            measured one), and its nodes' ranges named by the exporter's module scopes, through the graph ORT ran
            (its layout pass gives the nodes it rewrites new names; their outputs keep the exporter's)."""
            profiles = tempfile.TemporaryDirectory(prefix="ladder-ort-profile-")
            twin, forward = session_of(Path(profiles.name))
            layers = node_layers(path)
            if self.saves_its_graph:
                layers = {**renamed_layers(Path(profiles.name) / "optimized.onnx", layers), **layers}

            def events() -> list[dict]:
                with profiles:  # the profile ORT writes there, read, then the folder removed
                    return node_events(twin, layers, cell.device == "cpu")

            return forward, events

        session, forward = session_of()
        forward.keepalive = keep  # the exported graph's directory (the closure holds session and binding)
        stats = {**facts, "providers": session.get_providers(), "ort_version": ort.__version__,
                 "fixed_batch": cell.batch if cell.cuda_graph else None}
        if cell.device == "cpu":
            stats["intra_op_threads"] = torch.get_num_threads()
            return Built(forward=forward, stats=stats, stream_description="host (CPU execution provider)",
                         uses_torch_allocator=False, profiled=profiled)
        return Built(forward=forward, stream=stream, uses_torch_allocator=False, captured=cell.cuda_graph,
                     stream_description="torch side stream handed to ORT as user_compute_stream"
                                        + (" (the CUDA EP's graph replay)" if cell.cuda_graph else ""),
                     stats={**stats, "provider_options": {p: o for p, o in session.get_provider_options().items()
                                                          if p == self.provider or p == OnnxRuntime.provider}},
                     profiled=profiled)


def session_options(path: Path, cell) -> "ort.SessionOptions":
    """Full graph optimisation; for a CUDA-graph cell, the batch axis fixed to the cell's. The CUDA EP captures a
    graph only if it runs every node, and with the batch free the shape arithmetic before the classifier's Reshape
    (Shape, Gather, Range...) is placed on the CPU; with the batch fixed, it folds into constants. On the CPU, as
    many compute threads as torch's rungs use (OMP_NUM_THREADS where set): ORT's own pool ignores that variable
    and takes every core, so a one-thread run still timed ORT on two, slowed whenever anything took the second."""
    import onnxruntime as ort  # optional: availability() says why it is missing

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if cell.device == "cpu":
        so.intra_op_num_threads = torch.get_num_threads()
    if cell.cuda_graph:
        so.add_free_dimension_override_by_name(batch_dim(path), cell.batch)
    return so


def node_events(session, layers: dict[str, str], cpu: bool) -> list[dict]:
    """The profiled session's node ranges as Chrome trace events (ts: µs since the epoch), each with the module
    path of its node where the export names it: on the CPU as operators (their time is the work), on the GPU as
    annotations around the kernels the node launched."""
    start_us = session.get_profiling_start_time_ns() / 1e3  # ORT's ts are µs after this (system clock)
    events = []
    for e in json.loads(Path(session.end_profiling()).read_text()):
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time"):
            continue
        node = e["name"].removesuffix("_kernel_time")
        layer = layer_of(node, layers)
        events.append({"ph": "X", "cat": "cpu_op" if cpu else "user_annotation", "pid": e["pid"], "tid": e["tid"],
                       "ts": start_us + e["ts"], "dur": e["dur"],
                       "name": f"{e['args'].get('op_name', node)}" if cpu else node,
                       "args": {"node": node, "provider": e["args"].get("provider"),
                                **({LAYER: layer, BASIS: "ONNX node names"} if layer else {})}})
    return events


def renamed_layers(optimized: Path, layers: dict[str, str]) -> dict[str, str]:
    """Each node of ORT's optimised graph whose name the export does not know -> the module path of its first
    output the export names (a node ORT rewrote or fused keeps its outputs' names, not its own)."""
    import onnx  # the exporter's own dependency

    out = {}
    for node in onnx.load(str(optimized), load_external_data=False).graph.node:
        layer = next((layers[o] for o in node.output if o in layers), None)
        if node.name not in layers and layer:
            out[node.name] = layer
    return out


def layer_of(node: str, layers: dict[str, str]) -> str | None:
    """The module path of a profiled node: by its name, or by the name it was fused after (ORT appends words such
    as '_nchwc' to a fused node's output name)."""
    name = node
    while name not in layers and "_" in name and not name.rsplit("_", 1)[1].isdigit():
        name = name.rsplit("_", 1)[0]
    return layers.get(name)


TIER = OnnxRuntime()
