"""compute-sanitizer memcheck over the `cudnn` rung's whole child contract (load, build, engine timing, CUDA-graph
capture, every timed pass), on a small cell with a minimal protocol: memcheck slows each kernel by orders of
magnitude. The child's command line is the runner's own (harness.child.contract.contract_argv). Exits 1 on any error.

    python3 bench/sanitize_cudnn.py [--batch 2 --res 64 --dtype bf16 --task infer|train]
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from core.model import build_model, make_input, write_input, write_weights  # noqa: E402
from harness.child.contract import Protocol, contract_argv  # noqa: E402
from core.cell import Cell  # noqa: E402
from tiers.cudnn import TIER  # noqa: E402

MINIMAL = Protocol(warmup_min=1, warmup_max=2, iters=2, min_time_s=0, max_iters=2, pipelined_iters=2, e2e_iters=1,
                   util_s=0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--res", type=int, default=64)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--task", choices=("infer", "train"), default="infer")
    a = ap.parse_args()
    sanitizer = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not Path(sanitizer).exists():
        print("compute-sanitizer: not found", flush=True)
        return 1
    cell = Cell(tier="cudnn", batch=a.batch, res=a.res, dtype=a.dtype, channels_last=True, cuda_graph=True,
                options=(("autotune", "1"),), task=a.task)
    with tempfile.TemporaryDirectory() as tmp:
        files = {k: Path(tmp) / f"{k}.{'json' if k == 'result' else 'safetensors'}"
                 for k in ("weights", "input", "output", "result")}
        write_weights(build_model(cell.model), files["weights"])
        write_input(make_input(cell.batch, cell.res), files["input"])
        argv = [sanitizer, "--tool", "memcheck", *contract_argv(TIER.command(cell), cell, files, MINIMAL)]
        proc = subprocess.run(argv, capture_output=True, text=True)
    text = proc.stdout + proc.stderr
    summary = [line for line in text.splitlines() if "ERROR SUMMARY" in line]
    print(f"{cell.key}: exit code {proc.returncode}", flush=True)
    print("\n".join(summary) or text[-3000:], flush=True)
    return 0 if proc.returncode == 0 and summary and " 0 errors" in summary[-1] else 1


if __name__ == "__main__":
    sys.exit(main())
