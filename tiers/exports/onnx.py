"""The ONNX model shared by the ONNX Runtime and TensorRT rungs: the cell's model in its dtype, exported by
torch's (dynamo) ONNX exporter with a dynamic batch axis. A channels-last cell gets an NHWC input: the
transpose to NCHW is part of the graph, so the runtime binds the NHWC buffer as it is and may fuse it away.

One graph serves every batch size, and fp32 and tf32 alike (TF32 is the runtime's choice, not the graph's): in a
ladder it is exported once into the rung's cache directory and found there by the rung's later cells (on the H100,
each cell exporting its own took 10-14 s, 100 s of the ONNX Runtime rung's 143)."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from core.cell import Cell, Store
from core.files import write_atomic
from core.placement import place_model

# Seen on the H100 (torch 2.11, ORT 1.31.1: "Type 'tensor(bfloat16)' of input parameter ... of operator (Conv) ...
# is invalid") and checked here with onnx.checker at opset 22 ("W has inconsistent type tensor(float)").
BF16_EXPORT = ("torch's ONNX exporter makes an invalid bfloat16 graph of this model: batch-norm is folded into "
               "float32 Conv weights beside bfloat16 activations (and at its default opset 18, Conv has no bfloat16)")


def onnx_dir(store: Store) -> tuple[Path, Any]:
    """Where the exported graphs go, and what keeps that place alive: the rung's cache (`caches` declares it, so
    that --isolation cell starts each cell empty and a kept graph makes a warm start), or outside a ladder a
    temporary directory that lives as long as the returned handle."""
    if store.cache is not None:
        (store.cache / "onnx").mkdir(parents=True, exist_ok=True)
        return store.cache / "onnx", None
    tmp = tempfile.TemporaryDirectory(prefix="ladder-onnx-")
    return Path(tmp.name), tmp


class NHWCInput(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x.permute(0, 3, 1, 2))


def bound_input(example: torch.Tensor, cell: Cell) -> torch.Tensor:
    """The tensor whose memory the runtime reads: NCHW, or for channels-last the same memory viewed as NHWC."""
    return example.permute(0, 2, 3, 1) if cell.channels_last else example


def export_onnx(model: torch.nn.Module, example: torch.Tensor, cell: Cell, workdir: Path,
                fp16_graph: str = "converter") -> tuple[Path, dict]:
    """Exports once per (model, dtype, layout, res) into `workdir`; returns the path and export facts. An fp16 graph
    is exported from the fp16 model ('export'), or exported in fp32 and converted by onnxconverter-common's float16
    pass, as ONNX Runtime's documentation converts models ('converter': inputs and outputs fp16 too)."""
    if cell.dtype == "fp16" and fp16_graph == "converter":
        path, facts = export_onnx(model, example.float(), dataclasses.replace(cell, dtype="fp32"), workdir)
        return to_fp16(path), {**facts, "fp16_graph": "onnxconverter-common float16 of the fp32 export"}
    graph_dtype = "fp32" if cell.dtype == "tf32" else cell.dtype
    fixed_batch = getattr(model, "fixed_batch", None)  # a layer alone with its residual (core.layers.LayerNet)
    digest = hashlib.sha1(repr((cell.model, graph_dtype, cell.channels_last, cell.res, fixed_batch)).encode())
    path = Path(workdir) / f"{cell.model}-{digest.hexdigest()[:10]}.onnx"
    facts: dict[str, Any] = {"onnx_file": "found in the rung's cache" if path.exists() else "exported"}
    if not path.exists():
        placed = place_model(model, cell).cpu() if graph_dtype == "fp32" else place_model(model, cell)
        module = NHWCInput(placed) if cell.channels_last else placed
        x = bound_input(example, cell).to(next(placed.parameters()).device)
        if fixed_batch is None:
            # Two samples, not one: torch.export specialises a size-1 dimension, which for the NHWC input
            # contradicts the dynamic batch axis ("Invalid ranges [2:1]"); the graph still takes any batch from 1 up.
            x, dynamic = x[:1].repeat(2, 1, 1, 1), ({0: torch.export.Dim("batch", min=1, max=4096)},)
        else:
            dynamic = None
        t = time.perf_counter()
        # Exported beside the cache, then moved in, external data first and the graph last: a process beside this
        # one (the prepare stage's) finds the whole graph or none.
        with tempfile.TemporaryDirectory(dir=workdir, prefix=".export-") as tmp:
            with warnings.catch_warnings(), torch.inference_mode(False), torch.no_grad():
                warnings.simplefilter("ignore")
                torch.onnx.export(module, (x,), str(Path(tmp) / path.name), input_names=["input"],
                                  output_names=["logits"], dynamic_shapes=dynamic, dynamo=True)
            for p in sorted(Path(tmp).iterdir(), key=lambda p: p.name == path.name):
                os.replace(p, path.parent / p.name)
        facts["onnx_export_s"] = time.perf_counter() - t
    if cell.dtype == "fp16":
        facts["fp16_graph"] = "the fp16 model exported"
    return path, {**facts, "onnx_bytes": sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))}


def batch_dim(path: Path) -> str:
    """The name of the exported input's batch axis (its symbolic first dimension)."""
    import onnx  # the exporter's own dependency

    return onnx.load(str(path), load_external_data=False).graph.input[0].type.tensor_type.shape.dim[0].dim_param


def to_fp16(path: Path) -> Path:
    """The fp32 graph at `path` with every float tensor, weights and inputs and outputs, in fp16."""
    import onnx  # the exporter's own dependency; loaded only for this conversion
    from onnxconverter_common import float16  # optional: the converter ONNX Runtime documents for fp16

    out = path.with_name(path.stem + "-fp16.onnx")
    if not out.exists():
        converted = float16.convert_float_to_float16(onnx.load(str(path)), keep_io_types=False)
        write_atomic(out, lambda tmp: onnx.save(converted, str(tmp)))
    return out


def node_layers(path: Path) -> dict[str, str]:
    """Each node's name and each of its outputs' names -> the module path it came from ('layer1.0.conv2'), from
    the exporter's name scopes in the nodes' metadata. ONNX Runtime names a node it fused after one of these."""
    import ast

    import onnx  # the exporter's own dependency

    layers: dict[str, str] = {}
    for node in onnx.load(str(path), load_external_data=False).graph.node:
        meta = {p.key: p.value for p in node.metadata_props}
        try:
            scopes = ast.literal_eval(meta.get("pkg.torch.onnx.name_scopes", "[]"))
        except (ValueError, SyntaxError):
            continue
        modules = [s for s in scopes[:-1] if s]  # the last scope is the operator
        if modules:
            layer = modules[-1].removeprefix("model.")  # NHWCInput wraps the model as `model`
            for name in (node.name, *node.output):
                layers.setdefault(name, layer)
    return layers
