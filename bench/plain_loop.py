"""Independent check of the ladder's eager and compile figures: a plain CUDA-event loop in one process, sharing
no measurement code with the harness. Run it right after the ladder on the same machine and compare:

    python3 bench/plain_loop.py --batch 1,32,256 --dtype fp32,tf32,bf16 --channels-last \
        --compare runs/resnet50-cuda/ladder.json --json out.json
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness.model import build_model  # noqa: E402  (the same seeded network; the timing below is independent)

DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def time_forward(fn, x, warmup: int = 50, iters: int = 200) -> float:
    for _ in range(warmup):
        fn(x)
    torch.cuda.synchronize()
    times = []
    gc.collect()
    gc.disable()  # as timeit does: no collector pauses inside the timed loop
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(x)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    gc.enable()
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch", default="1,32,256")
    p.add_argument("--res", type=int, default=224)
    p.add_argument("--dtype", default="fp32,tf32,bf16")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--compare", type=Path, help="ladder JSON to compare with")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    rows = []
    for dtype in args.dtype.split(","):
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
        model = build_model(args.model).to("cuda", DTYPES[dtype]).to(memory_format=fmt)
        for batch in map(int, args.batch.split(",")):
            x = torch.randn(batch, 3, args.res, args.res, device="cuda", dtype=DTYPES[dtype]).to(memory_format=fmt)
            torch._dynamo.reset()  # one static compile per batch, as each ladder cell compiles in its own process
            compiled = torch.compile(model)
            with torch.inference_mode():
                for tier, fn in (("eager", model), ("compile", compiled)):
                    rows.append({"tier": tier, "batch": batch, "dtype": dtype, "median_ms": time_forward(fn, x)})
                    print(rows[-1], flush=True)
    if args.compare:
        ladder = json.loads(args.compare.read_text())["results"]
        print(f"\n{'tier':8s} {'batch':>5s} {'dtype':5s} {'plain ms':>9s} {'ladder ms':>9s} {'diff %':>7s}")
        for r in rows:
            match = [x for x in ladder if x["tier"] == r["tier"] and x["batch"] == r["batch"]
                     and x["dtype"] == r["dtype"] and not x["cuda_graph"] and x["status"] == "ok"
                     and x["channels_last"] == args.channels_last and x["res"] == args.res
                     and x.get("options", {}).get("compile-mode", "default") == "default"]
            if match:
                lm = match[0]["latency_ms"]["median"]
                r["ladder_median_ms"] = lm
                r["diff_pct"] = (lm - r["median_ms"]) / r["median_ms"] * 100
                print(f"{r['tier']:8s} {r['batch']:5d} {r['dtype']:5s} {r['median_ms']:9.3f} {lm:9.3f} "
                      f"{r['diff_pct']:+7.1f}")
    if args.json:
        what = "plain CUDA-event loop, median of 200 after 50 warm-up, garbage collector off while timing"
        args.json.write_text(json.dumps({"what": what, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
