"""Independent check of the ladder's eager and compile figures: a plain CUDA-event loop in one process, sharing
no measurement code with the harness. Run it right after the ladder on the same machine and compare:

    python3 bench/plain_loop.py --batch 1,32,256 --dtype fp32,tf32,bf16 --channels-last \
        --compare runs/resnet50-cuda/ladder.json --json out.json

`--tiers eager` (or compile) checks one rung, e.g. right after the ladder's cell for it.
On a host whose speed moves between processes, host-bound cells cannot agree that way (results/*/README.md).
`--interleave-s S` then asks the narrower question, free of the host: in this one process it alternates blocks of
S seconds of this loop and of the ladder's own code for the cell (the rung's build, the worker's timed forward
and latency pass), plain-ladder-ladder-plain, so both see the same host; --min-time-s is the time of each side.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from core.env import source_revision, utc_now  # noqa: E402
from core.model import build_model  # noqa: E402  (the same seeded network; the timing below is independent)
from core.cell import Cell, Store  # noqa: E402
from core.placement import set_math_mode, torch_dtype  # noqa: E402
from core.stats import median  # noqa: E402
from harness.child.timing import Clock, latency_pass, prepare_input, timed_forward  # noqa: E402
from tiers import get_tier  # noqa: E402

AGREE = 0.05
STARTED = utc_now()


@contextlib.contextmanager
def collector_off():
    """As timeit does (and the ladder's worker): no garbage-collector pauses inside a timed loop."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def time_forward(fn, x, iters: int, min_time_s: float, warmup: int = 50) -> list[float]:
    """ms per forward: at least `iters` forwards and `min_time_s` seconds, after `warmup` forwards."""
    for _ in range(warmup):
        fn(x)
    torch.cuda.synchronize()
    times: list[float] = []
    with collector_off():
        t0 = time.perf_counter()
        while len(times) < iters or time.perf_counter() - t0 < min_time_s:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn(x)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
    return times


def interleaved(tier: str, plain_fn, x: torch.Tensor, dtype: str, args) -> dict:
    """This loop and the ladder's code for the same cell, in alternating blocks of args.interleave_s seconds."""
    cell = Cell(tier=tier, model=args.model, batch=x.shape[0], res=args.res, dtype=dtype,
                channels_last=args.channels_last)
    set_math_mode(dtype)
    example = prepare_input(torch.randn(x.shape), cell)
    built = get_tier(tier).build(build_model(args.model).eval(), example, cell, Store())
    ladder_call = timed_forward(built.forward, example, Clock(built.stream or torch.cuda.current_stream()))
    time_forward(plain_fn, x, iters=1, min_time_s=0)  # both warmed up (and compiled) before the first block
    latency_pass(ladder_call, 50, 0, math.inf, 50, 0.0)  # exactly 50 calls
    blocks: dict[str, list[list[float]]] = {"plain": [], "ladder": []}
    for r in range(math.ceil(args.min_time_s / args.interleave_s / 2) * 2):
        for side in ("plain", "ladder") if r % 2 == 0 else ("ladder", "plain"):
            if side == "plain":
                blocks[side].append(time_forward(plain_fn, x, iters=1, min_time_s=args.interleave_s, warmup=0))
            else:
                with collector_off():
                    blocks[side].append(latency_pass(ladder_call, 1, args.interleave_s, args.interleave_s, 10**9, 0.0)[0])
    plain, ladder = sum(blocks["plain"], []), sum(blocks["ladder"], [])
    plain_median, ladder_median = median(plain), median(ladder)
    # The method's own floor: the plain loop against itself, its odd blocks against its even ones.
    even, odd = (median(sum(blocks["plain"][i::2], [])) for i in (0, 1))
    return {"median_ms": plain_median, "samples_ms": plain, "ladder_code_median_ms": ladder_median,
            "ladder_code_samples_ms": ladder, "block_lengths": {k: [len(b) for b in v] for k, v in blocks.items()},
            "diff_interleaved": ladder_median / plain_median - 1, "diff_plain_halves": odd / even - 1}


def ladder_record(ladder: list[dict], row: dict, args) -> dict | None:
    for x in ladder:
        if (x["tier"] == row["tier"] and x["batch"] == row["batch"] and x["dtype"] == row["dtype"]
                and not x["cuda_graph"] and x["status"] == "ok" and x["channels_last"] == args.channels_last
                and x["res"] == args.res and x.get("options", {}).get("compile-mode", "default") == "default"):
            return x
    return None


def compare(rows: list[dict], ladder: list[dict], args) -> None:
    print(f"\n{'tier':8s} {'batch':>5s} {'dtype':5s} {'bound':5s} {'plain ms':>9s} {'ladder ms':>9s} {'diff':>7s}"
          f"{'  interleaved  plain/plain' if args.interleave_s else ''}")
    for r in rows:
        rec = ladder_record(ladder, r, args)
        if rec is None:
            continue
        r["ladder_median_ms"], r["ladder_bound"] = rec["latency_ms"]["median"], rec.get("bound")
        r["diff"] = r["ladder_median_ms"] / r["median_ms"] - 1
        print(f"{r['tier']:8s} {r['batch']:5d} {r['dtype']:5s} {str(r['ladder_bound']):5s} {r['median_ms']:9.3f} "
              f"{r['ladder_median_ms']:9.3f} {pct(r['diff'])}"
              + (f"  {pct(r['diff_interleaved']):>11s}  {pct(r['diff_plain_halves']):>11s}" if args.interleave_s else ""))
    print(f"diff = ladder / plain - 1; ! = more than {AGREE:.0%} apart; bound = the ladder's label for the cell"
          + ("; interleaved = the ladder's code against this loop in one process; plain/plain = this loop's odd "
             "blocks against its even ones" if args.interleave_s else ""))


def pct(diff: float) -> str:
    return f"{diff * 100:+6.1f}%{'!' if abs(diff) > AGREE else ''}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet50")
    p.add_argument("--tiers", default="eager,compile", help="eager, compile or both")
    p.add_argument("--batch", default="1,32,256")
    p.add_argument("--res", type=int, default=224)
    p.add_argument("--dtype", default="fp32,tf32,bf16")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--iters", type=int, default=200, help="at least this many timed forwards")
    p.add_argument("--min-time-s", type=float, default=0.0, help="and at least this long")
    p.add_argument("--interleave-s", type=float, default=0,
                   help="alternate blocks of this many seconds with the ladder's own code in this process")
    p.add_argument("--compare", type=Path, help="ladder JSON to compare with")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    tiers = args.tiers.split(",")
    if set(tiers) - {"eager", "compile"}:
        p.error(f"--tiers {args.tiers}: valid tiers are eager, compile")
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    rows = []
    for dtype in args.dtype.split(","):
        set_math_mode(dtype)
        model = build_model(args.model).to("cuda", torch_dtype(dtype)).to(memory_format=fmt)
        for batch in map(int, args.batch.split(",")):
            x = torch.randn(batch, 3, args.res, args.res, device="cuda", dtype=torch_dtype(dtype)).to(memory_format=fmt)
            torch._dynamo.reset()  # one static compile per batch, as each ladder cell compiles in its own process
            compiled = torch.compile(model)
            with torch.inference_mode():
                for tier, fn in (("eager", model), ("compile", compiled)):
                    if tier not in tiers:
                        continue
                    if args.interleave_s:
                        row = interleaved(tier, fn, x, dtype, args)
                    else:
                        samples = time_forward(fn, x, args.iters, args.min_time_s)
                        row = {"median_ms": median(samples), "samples_ms": samples}
                    rows.append({"tier": tier, "batch": batch, "dtype": dtype, "iters": len(row["samples_ms"]), **row})
                    print({k: v for k, v in rows[-1].items() if k not in ("samples_ms", "ladder_code_samples_ms",
                                                                          "block_lengths")}, flush=True)
                    save(rows, args)
    if args.compare:
        compare(rows, json.loads(args.compare.read_text())["results"], args)
        save(rows, args)


def save(rows: list[dict], args) -> None:
    """Written after every row, so a loop cut short by a time limit keeps what it measured."""
    if args.json:
        what = (f"plain CUDA-event loop after 50 warm-up forwards, garbage collector off while timing: median of >= "
                f"{args.iters} forwards and >= {args.min_time_s} s (raw samples in samples_ms); ladder_median_ms "
                "and ladder_bound: the ladder's figure and label for the same cell; diff = ladder / plain - 1")
        if args.interleave_s:
            what += (f"; interleaved: blocks of {args.interleave_s} s of this loop and of the ladder's own code "
                     "(rung build, worker timed forward and latency pass) alternating in one process, "
                     "ladder_code_median_ms / median_ms - 1 = diff_interleaved; block_lengths: samples per block, "
                     "in order; diff_plain_halves: this loop's odd blocks against its even ones (the method's floor)")
        args.json.write_text(json.dumps({"what": what, "started_utc": STARTED, "source": source_revision(),
                                         "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
