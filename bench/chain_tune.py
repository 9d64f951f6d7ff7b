"""Tunes the triton rung's convolution configurations for one batch inside the network, under a CUDA graph.

The autotuner times each convolution alone (kernels/triton/tuning.py). At batch 1 that ranks configurations
differently from the chain of 53 dependent launches they run in: a kernel alone starts cold and nothing overlaps
it (docs/notes/handwritten-toward-the-limit.md). Here every candidate is timed where it runs:
1. Variant i replays the network with candidate i of every convolution's key (the autotuner's list for that shape,
   plus each small tile with 8 warps and with 3 stages), captured in a CUDA graph and profiled (CUPTI). Keys that
   another dtype's cell shares (fp8's bf16 stem and classifier) keep their table entries (`own_keys`).
2. Each kernel's own time in the chain (its end minus the end of the kernel before it) scores its key's candidate;
   each changed key is printed with its time under the table's entry and under the chosen one (`changes`).
3. The best candidate of every key, together, is timed against the table as it stands: graph replays back to
   back, alternating the two, `--rounds` times. Only a whole faster by more than `--threshold`, with its bootstrap
   interval excluding no change (`compare`'s rule), is written (`--out`, and merged into `--merge-into`, e.g. the
   shipped table).

    python3 bench/chain_tune.py --batch 1 --dtype bf16 --out runs/chain-b1.json \
        --merge-into kernels/tunings/nvidia-h100-80gb-hbm3/triton.json
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from core.cell import Cell, Store  # noqa: E402
from core.env import device_slug  # noqa: E402
from core.files import write_text_atomic  # noqa: E402
from core.stats import median  # noqa: E402
from core.model import build_model  # noqa: E402
from core.placement import place_model, torch_dtype  # noqa: E402
from harness.run import census  # noqa: E402
from harness.results.compare import ratio_ci, verdict  # noqa: E402
from harness.run.context import shipped_tunings  # noqa: E402
from kernels.triton import tuning  # noqa: E402
from kernels.triton import conv, pair  # noqa: E402
from tiers.triton import TIER, triton_version  # noqa: E402

SMALL_TILE = 64 * 64  # tiles of at most this many outputs also run as 8-warp and 3-stage candidates


def candidates(key: str) -> list[dict]:
    """The autotuner's configurations for a convolution key (kernel|M,H,W,CIN,COUT,...|x's dtype,...), as table
    entries; for conv2d_nhwc_kernel also each small tile with 8 warps and with 3 stages."""
    kernel, sizes, dtypes = key.split("|")
    x = torch.empty(0, dtype=getattr(torch, dtypes.split(",")[0]))  # the pruners read its element size
    if kernel == pair.conv_pair_kernel.fn.__name__:  # M, H, W, CIN, COUT, COUT2, KH, KW, STRIDE, ..., C3
        values = sizes.split(",")
        m, _, _, _, cout, cout2 = (int(v) for v in values[:6])
        return [{"kwargs": dict(c.kwargs), "num_warps": c.num_warps, "num_stages": c.num_stages}
                for c in pair._prune(pair.CONFIGS, dict(x_ptr=x, M=m, COUT=cout, COUT2=cout2, C3=int(values[12])))]
    m, _, _, cin, cout, kh, kw = (int(v) for v in sizes.split(",")[:7])
    pruned = conv._prune(conv.CONFIGS, dict(x_ptr=x, KW=kw, CIN=cin, M=m, COUT=cout, KH=kh,
                                            SC_CIN=int(sizes.split(",")[9])))
    listed = [{"kwargs": dict(c.kwargs), "num_warps": c.num_warps, "num_stages": c.num_stages} for c in pruned]
    small = [c for c in listed if c["kwargs"]["BLOCK_M"] * c["kwargs"]["BLOCK_N"] <= SMALL_TILE]
    return listed + [{**c, "num_warps": 8} for c in small] + [{**c, "num_stages": 3} for c in small]


def own_keys(keys: list[str], dtype: str) -> list[str]:
    """The keys only this dtype's cell runs, by their weights' type (a key's second tensor): in fp8 the e4m3
    convolutions. fp8's stem and classifier run bf16 on the bf16 cell's keys, which that cell's tuning chooses."""
    weights = "float8_e4m3fn" if dtype == "fp8" else str(torch_dtype(dtype)).removeprefix("torch.")
    return [k for k in keys if k.split("|")[2].split(",")[1] == weights]


def same_launch(entry: dict, other: dict | None) -> bool:
    """Two table entries launch the same kernel: one without SPLIT_K (older tables) means the kernel's default, 1."""
    def full(c: dict) -> dict:
        return {**c, "kwargs": {"SPLIT_K": 1, **c["kwargs"]}}
    return other is not None and full(entry) == full(other)


class Chain:
    """The rung's network on one input, re-recorded under any tuning table and replayed in a CUDA graph; `options`:
    the rung's options, as a cell holds them."""

    def __init__(self, model: str, batch: int, res: int, dtype: str, options: tuple = ()) -> None:
        cell = Cell(tier="triton", model=model, batch=batch, res=res, dtype=dtype, device="cuda", channels_last=True,
                    options=options)
        net = place_model(build_model(model).eval(), cell)
        self.x = torch.randn(batch, 3, res, res, device="cuda", dtype=torch_dtype(dtype)).contiguous(
            memory_format=torch.channels_last)
        self.gpu = torch.cuda.get_device_name()
        self.shipped_path = shipped_tunings(device_slug({"gpu": {"name": self.gpu}}), "triton")
        self.net = TIER.build(net, self.x, cell, Store(tunings=self.shipped_path)).forward
        self.shipped = dict(tuning.TABLE)
        self.keys: list[str | None] = []  # the convolutions' table keys, in launch order (None for the other kernels)

    def record(self, table: dict) -> list[str | None]:
        """Re-records the forward with `table`; returns each launch's key (None where it is not a convolution)."""
        seen: list[str] = []
        original = tuning.table_key

        def noting(kernel, args):
            seen.append(key := original(kernel, args))
            return key
        tuning.TABLE.clear()
        tuning.TABLE.update(table)
        tuning.table_key, self.net.plans = noting, {}
        try:
            with torch.no_grad():
                self.net(self.x)
        finally:
            tuning.table_key = original
        return [k if k.startswith(("conv2d", "conv_pair")) else None for k in seen]

    def graph(self, table: dict) -> torch.cuda.CUDAGraph:
        """The forward recorded with `table`, captured; the graph keeps the plan (whose buffers it replays into)
        alive as long as itself."""
        keys = self.record(table)
        self.keys = self.keys or keys
        with torch.no_grad():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.net(self.x)  # a replay of the plan outside capture first: its lazy state is set up
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                self.net(self.x)
        g.plans = self.net.plans
        g.replay()
        torch.cuda.synchronize()
        return g


def owned_us(g: torch.cuda.CUDAGraph, launches: int) -> list[float]:
    """Each kernel's own time in the last of five profiled replays: its end minus the end of the kernel before."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            g.replay()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = [e for e in census.load(f.name) if e.get("cat") == "kernel"]
    last = sorted(events, key=lambda e: e["ts"])[-launches:]
    ends = [e["ts"] + e["dur"] for e in last]
    return [last[0]["dur"]] + [b - a for a, b in zip(ends, ends[1:])]


def pipelined_us(g: torch.cuda.CUDAGraph, replays: int) -> float:
    """Microseconds per replay, replays back to back (the ladder's pipelined figure)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(10):
        g.replay()
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays * 1e3


def changes(chosen: dict[str, dict], scores: dict[str, dict[str, list[float]]],
            table_us: dict[str, list[float]]) -> list[str]:
    """A line per changed key: its kernels' own time in the chain (median over the layers that share the key) with
    the table's entry and with the chosen one, and the chosen configuration. Printed whether or not the whole is
    written: which candidate won where is the finding even when the whole is no faster."""
    lines = []
    for key, entry in sorted(chosen.items()):
        mine = median(scores[key][json.dumps(entry, sort_keys=True)])
        was = f"{median(table_us[key]):.1f}" if table_us.get(key) else "?"
        config = " ".join(f"{k}={v}" for k, v in sorted(entry["kwargs"].items()))
        lines.append(f"{key}: {was} -> {mine:.1f} us ({config} warps={entry['num_warps']} "
                     f"stages={entry['num_stages']})")
    return lines


def faster_beyond_noise(table_us: list[float], chosen_us: list[float], threshold: float) -> tuple[bool, str]:
    """Whether the chosen whole beats the table by the ladder's own rule for a change (harness/results/compare.py: more
    than `threshold`, its bootstrap interval excluding none), and the comparison in words. On the H100 a tf32
    chain came out 0.3% faster by its medians with its rounds overlapping: no reason to ship new configurations."""
    ratio, low, high = ratio_ci([table_us], [chosen_us])
    summary = (f"per replay: table {median(table_us):.1f} us, chosen {median(chosen_us):.1f} us "
               f"(x{ratio:.3f}, 95% CI {low:.3f}-{high:.3f})")
    return verdict(ratio, low, high, threshold) == "improvement", summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--res", type=int, default=224)
    ap.add_argument("--dtype", default="bf16", choices=("fp32", "tf32", "bf16", "fp8"))
    ap.add_argument("--rounds", type=int, default=7, help="alternations of the final comparison")
    ap.add_argument("--replays", type=int, default=400, help="graph replays per timing")
    ap.add_argument("--threshold", type=float, default=0.01, help="the least gain written, as in `compare`")
    ap.add_argument("--out", type=Path, required=True, help="the winners and the comparison, as a tuning table")
    ap.add_argument("--merge-into", type=Path, help="a tuning table to merge the winners into, if faster")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("chain_tune needs a CUDA GPU")

    chain = Chain(args.model, args.batch, args.res, args.dtype)
    shipped_graph = chain.graph(chain.shipped)
    convs = own_keys(sorted({k for k in chain.keys if k}), args.dtype)
    table_us: dict[str, list[float]] = {}
    for key, us in zip(chain.keys, owned_us(shipped_graph, len(chain.keys))):
        if key in convs:
            table_us.setdefault(key, []).append(us)
    options = {k: candidates(k) for k in convs}
    scores: dict[str, dict[str, list[float]]] = {k: {} for k in convs}
    for i in range(max(len(c) for c in options.values())):
        table = {**chain.shipped, **{k: c[i % len(c)] for k, c in options.items()}}
        own = owned_us(chain.graph(table), len(chain.keys))
        for key, us in zip(chain.keys, own):
            if key in scores:
                scores[key].setdefault(json.dumps(table[key], sort_keys=True), []).append(us)
        print(f"variant {i + 1}: {sum(own):.1f} us of kernels", flush=True)
    best = {k: json.loads(min(s, key=lambda c: median(s[c]))) for k, s in scores.items()}
    chosen = {k: c for k, c in best.items() if not same_launch(c, chain.shipped.get(k))}
    graphs = {"table": shipped_graph, "chosen": chain.graph({**chain.shipped, **chosen})}
    times: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(args.rounds):
        for name, g in graphs.items():
            times[name].append(pipelined_us(g, args.replays))
    faster, summary = faster_beyond_noise(times["table"], times["chosen"], args.threshold)
    print(f"{len(chosen)} of {len(convs)} keys changed; {summary}")
    changed = changes(chosen, scores, table_us)
    print("\n".join(changed))
    if not faster:
        print(f"the chosen configurations are not faster by more than {args.threshold:.0%} beyond noise: "
              "nothing written")
        return 1
    about = {"gpu": chain.gpu, "triton": triton_version(),
             "chain_tune": {"model": args.model, "batch": args.batch, "res": args.res, "dtype": args.dtype,
                            "table_us": times["table"], "chosen_us": times["chosen"], "changes": changed}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out, json.dumps({**about, "configs": chosen}, indent=1, sort_keys=True))
    if args.merge_into:
        merged = json.loads(args.merge_into.read_text())
        merged["configs"].update(chosen)
        write_text_atomic(args.merge_into, json.dumps(merged, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
