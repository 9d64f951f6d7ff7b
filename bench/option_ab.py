"""Times two values of one triton-rung option against each other in one process, under CUDA graphs.

Two ladder runs compare across processes, whose spread on these machines is a few percent. Here both networks
are built in one process on the same input (the shipped tuning tables; what they lack is autotuned), each captured
in a CUDA graph, and timed as graph replays back to back, alternating A and B, `--rounds` times: a difference of
1% stands out. Also written: each kernel's own time in the chain (its end minus the end of the kernel before,
CUPTI), by convolution key, and how far apart the two outputs are.

    python3 bench/option_ab.py --batch 256 --dtype bf16 --option pairs=off,auto --out runs/pairs-ab.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.chain_tune import Chain, owned_us, pipelined_us  # noqa: E402
from core.files import write_text_atomic  # noqa: E402
from core.stats import median  # noqa: E402
from harness.results.compare import ratio_ci, verdict  # noqa: E402
from kernels.triton import tuning  # noqa: E402
from tiers.triton import TIER  # noqa: E402


def parse_option(text: str) -> tuple[str, str, str]:
    """KEY=A,B -> (KEY, A, B), each value one the rung accepts."""
    key, _, values = text.partition("=")
    pair = values.split(",")
    if key not in TIER.options or len(pair) != 2 or not set(pair) <= set(TIER.options[key]):
        choices = "; ".join(f"{k}: {', '.join(v)}" for k, v in TIER.options.items())
        raise SystemExit(f"--option takes KEY=A,B with two of the triton rung's values ({choices}), not {text!r}")
    return key, pair[0], pair[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--res", type=int, default=224)
    ap.add_argument("--dtype", default="bf16", choices=("fp32", "tf32", "bf16", "fp8"))
    ap.add_argument("--option", required=True, help="KEY=A,B: the option and its two values, A the baseline")
    ap.add_argument("--rounds", type=int, default=7, help="alternations")
    ap.add_argument("--replays", type=int, help="graph replays per timing (default: about 12,000 images' worth)")
    ap.add_argument("--threshold", type=float, default=0.01, help="the least change called one, as in `compare`")
    ap.add_argument("--out", type=Path, required=True, help="the timings, verdict and per-kernel times (JSON)")
    args = ap.parse_args(argv)
    key, a, b = parse_option(args.option)
    if not torch.cuda.is_available():
        sys.exit("option_ab needs a CUDA GPU")

    chains = {value: Chain(args.model, args.batch, args.res, args.dtype, options=((key, value),)) for value in (a, b)}
    chains[b].x.copy_(chains[a].x)  # one input for both
    graphs = {value: chain.graph(chain.shipped) for value, chain in chains.items()}
    replays = args.replays or max(20, 12000 // args.batch)
    times: dict[str, list[float]] = {a: [], b: []}
    for _ in range(args.rounds):
        for value, g in graphs.items():
            times[value].append(pipelined_us(g, replays))
    ratio, low, high = ratio_ci([times[a]], [times[b]])
    change = verdict(ratio, low, high, args.threshold)
    summary = (f"per replay: {a} {median(times[a]):.1f} us, {b} {median(times[b]):.1f} us "
               f"(x{ratio:.3f}, 95% CI {low:.3f}-{high:.3f})")
    with torch.no_grad():
        outputs = {value: chain.net(chains[a].x).float().clone() for value, chain in chains.items()}
    apart = ((outputs[a] - outputs[b]).abs().max() / outputs[a].abs().max()).item()
    kernels = {value: [[k, round(us, 2)] for k, us in zip(chain.keys, owned_us(graphs[value], len(chain.keys)))]
               for value, chain in chains.items()}
    print(f"{args.dtype} batch {args.batch}, {key}={a} -> {b}: {summary}: {change}; kernels {len(kernels[a])} -> "
          f"{len(kernels[b])}; outputs apart by {apart:.2e} (relative max)")
    write_text_atomic(args.out, json.dumps({
        "gpu": torch.cuda.get_device_name(), "model": args.model, "batch": args.batch, "res": args.res,
        "dtype": args.dtype, "option": key, "a": a, "b": b, "replays": replays, "per_replay_us": times,
        "summary": summary, "verdict": change, "threshold": args.threshold, "outputs_rel_max_diff": apart,
        "kernel_us": kernels,  # each kernel's own time in the chain, by convolution key (null: not a convolution)
        "autotuned": tuning.TUNED, "autotune_s": round(tuning.STATS["seconds"], 1)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
