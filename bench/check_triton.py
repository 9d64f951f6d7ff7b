"""GPU check of the `triton` rung: parity against eager fp32, then speed against eager and torch.compile.

    python3 bench/check_triton.py [--parity] [--time] [--compile] [--batches 1,32,256]

--time:    res 224, bf16, channels-last: eager, our rung (autotuned; its parity too) and our rung in a CUDA graph.
--compile: torch.compile at the same batches: mode reduce-overhead at batch 1 (the CUDA-graph latency baseline),
           default above (the throughput baseline).
--parity:  batch 1, 7, 32 x res 64, 224 in fp32 and bf16 (autotune off: one heuristic config, quick to build) against
           eager fp32 with TF32 off: max abs error / max |ref|, cosine similarity, top-1 agreement.
Sections run in that order.
Latency is the median of 50 calls timed with CUDA events after 10 warm-up calls. Rows print as they finish.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

START = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from harness.model import build_model, make_input  # noqa: E402
from tiers.base import Cell  # noqa: E402
from tiers.triton import TIER  # noqa: E402


def parity(out: torch.Tensor, ref: torch.Tensor) -> str:
    out = out.float()
    rel = ((out - ref).abs().max() / ref.abs().max()).item()
    cos = torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0).item()
    top1 = (out.argmax(1) == ref.argmax(1)).float().mean().item()
    return f"rel_err={rel:.2e} cos={cos:.6f} top1={top1:.3f}"


def latency_ms(fn, iters=50, warmup=10) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def graphed(fn, x):
    """fn(x) captured in a CUDA graph, as the worker does for --cuda-graph 1."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(x)
    return lambda: (graph.replay(), out)[1]


def row(name: str, batch: int, ms: float, extra: str = "") -> None:
    print(f"{name:28s} b={batch:<4d} {ms:8.3f} ms {batch / ms * 1e3:9.0f} img/s  {extra}", flush=True)


def reference(model, x):
    with torch.no_grad():
        return model(x).float()


def check_parity(model) -> None:
    print("== parity vs eager fp32 (TF32 off), autotune off", flush=True)
    for dtype in ("fp32", "bf16"):
        for batch in (1, 7, 32):
            for res in (64, 224):
                x = make_input(batch, res).cuda()
                ref = reference(model, x)
                example = x.to(torch.bfloat16) if dtype == "bf16" else x
                cell = Cell(tier="triton", batch=batch, res=res, dtype=dtype, options=(("autotune", "off"),))
                out = TIER.build(model, example, cell).forward(example)
                print(f"{dtype} b={batch:<3d} r={res:<4d} {parity(out, ref)}", flush=True)


def check_speed(model, batches, compiled: bool) -> None:
    print(f"== res 224 bf16 channels-last: {'torch.compile' if compiled else 'eager / triton / triton+graph'}",
          flush=True)
    half = copy.deepcopy(model).to(torch.bfloat16).to(memory_format=torch.channels_last)
    for batch in batches:
        x32 = make_input(batch, 224).cuda()
        x = x32.to(torch.bfloat16).to(memory_format=torch.channels_last)
        with torch.no_grad():
            if compiled:
                torch._dynamo.reset()
                mode = "reduce-overhead" if batch == 1 else "default"
                fn = torch.compile(half, mode=mode)
                start = time.perf_counter()
                fn(x)
                row(f"compile {mode}", batch, latency_ms(lambda: fn(x)), f"compile {time.perf_counter() - start:.0f}s")
                continue
            row("eager", batch, latency_ms(lambda: half(x)))
            cell = Cell(tier="triton", batch=batch, res=224, dtype="bf16", channels_last=True)
            built = TIER.build(model, x, cell)
            stats = built.stats
            row("triton", batch, latency_ms(lambda: built.forward(x)),
                f"{parity(built.forward(x), reference(model, x32))} autotune {stats['autotune_s']}s "
                f"({stats['autotune_cache']}, warm forward {stats['warm_forward_s']}s)")
            row("triton+graph", batch, latency_ms(graphed(built.forward, x)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parity", action="store_true")
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--batches", default="1,32,256")
    args = ap.parse_args()
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference is strict
    torch.backends.cudnn.benchmark = True
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", __import__("triton").__version__,
          flush=True)
    model = build_model("resnet50").cuda()
    batches = [int(b) for b in args.batches.split(",")]
    # Speed first, parity last: on a time-limited device the most expensive-to-repeat figures come out first, and a
    # failing section prints its traceback without hiding the others (the tuned rows carry their own parity).
    sections = [(args.time, lambda: check_speed(model, batches, compiled=False)),
                (args.compile, lambda: check_speed(model, batches, compiled=True)),
                (args.parity, lambda: check_parity(model))]
    for wanted, section in sections:
        if wanted:
            try:
                section()
            except Exception:
                traceback.print_exc()
            print(f"-- {time.perf_counter() - START:.0f}s elapsed", flush=True)


if __name__ == "__main__":
    main()
