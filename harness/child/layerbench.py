"""The per-layer microbenchmark's child: each distinct layer of the model alone (core.layers.distinct_layers: one
convolution with its BatchNorm and epilogue, the residual it adds read from memory) built by one Python rung as
that rung builds the whole network, checked against eager fp32 on the same input, and timed: warm-up calls, then
--reps calls each between CUDA events (perf_counter on the CPU), their median. One process per rung, the layers in
turn; a layer that fails is a row with its error and the next one runs.

    python -m harness.child.layerbench --tier T --model M --batch B --res R --dtype D --layout nhwc --device cuda
        --weights W --out ROWS.json [--reps 50]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from statistics import median

import torch

from core.cell import Cell, Store
from core.files import write_text_atomic
from core.layers import Layer, distinct_layers, layer_net
from core.model import load_model
from core.parity import compare
from core.placement import set_math_mode
from harness.child.timing import Clock, prepare_input, sync_of
from tiers import get_tier

WARMUP = 10


def bench_layer(tier, model: torch.nn.Module, layer: Layer, cell: Cell, reps: int) -> dict:
    """One layer on one rung: parity against eager fp32 on the same input, then the median of `reps` timed calls."""
    net = layer_net(model, layer, cell.batch)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(cell.batch, layer.weight[1], *layer.size, generator=g)
    set_math_mode("fp32")
    with torch.inference_mode():
        ref = net.to(cell.device)(x.to(cell.device)).float().cpu()
    set_math_mode(cell.dtype)
    example = prepare_input(x, cell)
    built = tier.build(net, example, cell, Store())
    stream = (built.stream or torch.cuda.current_stream()) if cell.device == "cuda" else None
    with torch.inference_mode():
        out = built.forward(example)
        sync_of(built, cell)()  # a rung on a stream of its own (ONNX Runtime's) may still be writing `out`
        parity = compare(out.detach().float().cpu().reshape(cell.batch, -1), ref.reshape(cell.batch, -1), cell.dtype)
        clock = Clock(stream)
        samples = []
        for i in range(WARMUP + reps):
            clock.start()
            built.forward(example)
            clock.stop()
            if i >= WARMUP:
                samples.append(clock.elapsed_ms())
    return {"parity": {k: parity.get(k) for k in ("ok", "reason", "rel_err", "cosine")}, "samples_ms": samples,
            "median_ms": median(samples)}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.child.layerbench")
    for flag in ("--tier", "--model", "--dtype", "--layout", "--device", "--weights", "--out"):
        p.add_argument(flag, required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--res", type=int, required=True)
    p.add_argument("--reps", type=int, default=50)
    a = p.parse_args(argv)
    tier = get_tier(a.tier)
    model = load_model(a.model, Path(a.weights))
    rows = []
    for layer in distinct_layers(a.model, a.res):
        cell = Cell(tier=a.tier, model=a.model, batch=a.batch, res=layer.size[0], dtype=a.dtype,
                    channels_last=a.layout == "nhwc", device=a.device)
        row = {"layer": layer.path, "shape": layer.shape, "count": layer.count}
        t = time.perf_counter()
        reason = tier.supports(cell)
        if reason:
            row["error"] = f"skipped: {reason}"
        else:
            try:
                row.update(bench_layer(tier, model, layer, cell, a.reps))
            except Exception as e:  # one layer's failure is its row; the next layer runs
                row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        row["build_and_run_s"] = time.perf_counter() - t
        rows.append(row)
        print(f"{layer.path}: {row.get('median_ms', row.get('error'))}", flush=True)
    write_text_atomic(Path(a.out), json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
