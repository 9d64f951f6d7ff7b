"""GPU check of the `cudnn` rung: parity against eager fp32, a compute-sanitizer pass, per-layer and whole-network
speed. Runs the rung's binary through the child contract exactly as the runner does (a short protocol).

    python3 bench/check_cudnn.py [--parity] [--sanitize] [--micro] [--time] [--autotune K]

Sections run in this order: parity, time, micro, sanitize.
--parity:   batch 1, 7, 32 x res 64, 224 in fp32 and bf16 (NHWC; CUDA graph at res 224), plus fp32 NCHW, tf32 and
            fp16 at batch 7, against eager fp32 with TF32 off: max abs error / max |ref|, cosine, top-1 agreement.
            Engines are tuned over --autotune candidates (default 2: parity, not speed).
--sanitize: compute-sanitizer memcheck over the whole contract at batch 2, res 64, bf16, CUDA graph on.
--micro:    each distinct convolution alone at batch 32, res 224, bf16 (tiers/cudnn.py's micro()).
--time:     bf16 res 224 latency (median of the latency phase) at batch 1 (eager and CUDA graph), 32 and 256 (graph),
            engines tuned over the rung's default candidates.
--quick:    instead of --parity, five cells: fp32 NHWC b1 r64, fp32 b32 r224 NHWC (CUDA graph) and NCHW, bf16 and
            tf32 b7 r224 in a CUDA graph.
No flag: all four. Rows print as they finish; whatever would start after --budget-s seconds is skipped.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from harness.model import build_model, make_input, read_tensor, write_input, write_weights  # noqa: E402
from tiers.base import Cell  # noqa: E402
from tiers.cudnn import TIER  # noqa: E402

SHORT = {"warmup-min": 5, "warmup-max": 30, "warmup-s": 0.5, "iters": 30, "min-time-s": 0.3, "max-iters": 300,
         "pipelined-iters": 20, "e2e-iters": 3, "util-s": 0}
TINY = {**SHORT, "warmup-min": 1, "warmup-max": 2, "iters": 2, "min-time-s": 0, "max-iters": 2, "pipelined-iters": 2,
        "e2e-iters": 1}


class Runner:
    def __init__(self, tmp: Path, deadline: float):
        self.tmp, self.deadline = tmp, deadline
        self.model = build_model("resnet50")
        self.weights = tmp / "weights.safetensors"
        write_weights(self.model, self.weights)
        self.binary = TIER.command(Cell(tier="cudnn"))[0]
        self.gpu_model = self.model.cuda()

    def reference(self, batch: int, res: int) -> tuple[Path, torch.Tensor]:
        path = self.tmp / f"input-{batch}-{res}.safetensors"
        x = make_input(batch, res)
        write_input(x, path)
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
        with torch.no_grad():
            return path, self.gpu_model(x.cuda()).double().cpu()

    def run(self, batch, res, dtype, channels_last, graph, protocol, options=(), prefix=()):
        inputs, ref = self.reference(batch, res)
        out, result = self.tmp / "output.safetensors", self.tmp / "result.json"
        argv = [*prefix, self.binary, "--tier", "cudnn", "--model", "resnet50", "--weights", str(self.weights),
                "--input", str(inputs), "--output", str(out), "--result", str(result), "--batch", str(batch),
                "--res", str(res), "--dtype", dtype, "--channels-last", str(int(channels_last)), "--cuda-graph",
                str(int(graph)), "--device", "cuda", *(a for k, v in protocol.items() for a in (f"--{k}", str(v))),
                *(a for o in options for a in ("--option", o))]
        label = f"b{batch:<3} r{res:<3} {dtype:4} {'nhwc' if channels_last else 'nchw'} graph{int(graph)}"
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=max(20.0, self.deadline - t0))
        except subprocess.TimeoutExpired as e:
            print(f"{label} | TIMEOUT {str(e.stdout or '')[-300:]}", flush=True)
            return None, None
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            error = [line for line in proc.stdout.splitlines() if line.startswith("@@error")]
            print(f"{label} | FAILED rc={proc.returncode} {error[:1]} {proc.stderr.strip()[-800:]}", flush=True)
            return None, proc
        r = json.loads(result.read_text())
        o = read_tensor(out, "output").double()
        rel = ((o - ref).abs().max() / ref.abs().max()).item()
        cos = torch.nn.functional.cosine_similarity(o.flatten(), ref.flatten(), dim=0).item()
        top1 = (o.argmax(1) == ref.argmax(1)).double().mean().item()
        s = r["build_stats"]
        lat = statistics.median(r["latency"]["samples_ms"])
        host = statistics.median(r["host"]["samples_us"])
        print(f"{label} | rel_err {rel:.2e} cos {cos:.6f} top1 {top1:.3f} | fused {s['convs_fused']}/"
              f"{s['convs_total']} (+add {s['convs_fused_with_residual']}) | build {r['cold']['build_s']:.1f}s "
              f"(tune {s['autotune_s']:.1f}s) wall {wall:.0f}s | latency {lat:.3f} ms, host {host:.0f} us", flush=True)
        reasons = sorted({c.get("unfused_reason", "")[:300] for c in s["convs"] if not c["fused"]})
        for reason in reasons[:2]:
            print(f"    unfused: {reason}", flush=True)
        return r, proc


def main() -> None:
    ap = argparse.ArgumentParser()
    for flag in ("parity", "sanitize", "micro", "time"):
        ap.add_argument(f"--{flag}", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--autotune", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=270)
    a = ap.parse_args()
    everything = not (a.parity or a.quick or a.sanitize or a.micro or a.time)
    start = time.perf_counter()

    def in_budget(what: str) -> bool:
        if time.perf_counter() - start < a.budget_s:
            return True
        print(f"skipped (budget): {what}", flush=True)
        return False

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        runner = Runner(Path(tmp), start + a.budget_s + 20)
        print(f"built {runner.binary} in {time.perf_counter() - t0:.0f}s", flush=True)
        tune = [f"autotune={a.autotune}"]
        cells = []
        if a.parity or everything:
            cells = [(b, r, d, True, r == 224) for d in ("fp32", "bf16") for r in (64, 224) for b in (1, 7, 32)]
            cells += [(7, 224, "fp32", False, False), (7, 224, "tf32", True, True), (7, 224, "fp16", True, True)]
        elif a.quick:
            cells = [(1, 64, "fp32", True, False), (32, 224, "fp32", True, True), (32, 224, "fp32", False, False),
                     (7, 224, "bf16", True, True), (7, 224, "tf32", True, True)]
        for i, cell in enumerate(cells):
            if in_budget(f"parity {cell}"):
                r, _ = runner.run(*cell, SHORT, tune)
                if r and i == 0:
                    stats = {k: v for k, v in r["build_stats"].items() if k != "convs"}
                    print("    build_stats:", json.dumps(stats)[:1500], "| memory:", json.dumps(r["memory"]),
                          flush=True)
        if a.time or everything:
            for batch, graph in ((1, False), (1, True), (32, True), (256, True)):
                if in_budget(f"time b{batch} graph{int(graph)}"):
                    runner.run(batch, 224, "bf16", True, graph, SHORT)
        if (a.micro or everything) and in_budget("micro"):
            for row in TIER.micro(32, 224, "bf16", True):
                print(f"micro {row['shape']:34} {row['epilogue']:13} x{row['count']:<2} engine {row['engine']:<5} "
                      f"fused {int(row['fused'])} {row['median_ms']:.4f} ms {row['tflops']:.1f} TFLOP/s", flush=True)
        if (a.sanitize or everything) and in_budget("sanitizer"):
            sanitizer = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
            if not Path(sanitizer).exists():
                print("compute-sanitizer: not found", flush=True)
            else:
                _, proc = runner.run(2, 64, "bf16", True, True, TINY, ["autotune=1"],
                                     [sanitizer, "--tool", "memcheck"])
                if proc is not None:
                    text = proc.stdout + proc.stderr
                    summary = [line for line in text.splitlines() if "ERROR SUMMARY" in line]
                    print(f"compute-sanitizer memcheck: {summary or text[-1500:]}", flush=True)


if __name__ == "__main__":
    main()
