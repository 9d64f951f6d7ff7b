"""`python -m harness micro --layers --tiers A,B,...`: each distinct layer of the network alone on each rung that
runs a sub-network, against its roofline."""
from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

from rich.console import Console

from core import proc as procs
from core.cell import Cell, layout_name
from core.env import environment
from core.files import write_text_atomic
from core.layers import Layer, distinct_layers
from core.model import build_model, write_weights
from core.paths import REPO
from core.placement import torch_dtype
from harness.results.micro_tables import side_by_side_markdown, side_by_side_tables
from harness.run.refusal import Refusal
from tiers import get_tier
from tiers.base import PythonTier

def run(tiers: list[str], model: str, batch: int, res: int, dtype: str, channels_last: bool, device: str,
               out: Path, reps: int, json_path: Path | None, md_path: Path | None) -> int:
    """Each distinct layer (core.layers.distinct_layers) on each rung: a Python rung builds it as it builds the
    network, in a process of its own per rung (harness/child/layerbench.py), parity against eager fp32; a hand-written
    rung gives its own per-layer microbenchmark. Against each layer's roofline: its FLOPs at the measured matmul
    rate, its bytes (input, weights, output, residual once) at the measured copy bandwidth."""
    out.mkdir(parents=True, exist_ok=True)
    weights = out / "weights.safetensors"
    write_weights(build_model(model), weights)
    peaks = measure_peaks(out) if device == "cuda" else {}
    layers = distinct_layers(model, res)
    per_rung: dict[str, dict[str, dict]] = {}
    missing: list[str] = []
    console = Console()
    for name in tiers:
        tier = get_tier(name)
        cell = Cell(tier=name, model=model, batch=batch, res=res, device=device, dtype=dtype,
                    channels_last=channels_last)
        reason = tier.availability(device)
        if reason:
            missing.append(f"{name}: unavailable here: {reason}")
        elif refusal := tier.supports(cell):  # bf16 on ONNX Runtime, say: the rung refuses the network too
            missing.append(f"{name}: {refusal}")
        elif tier.has_micro:
            if device != "cuda":
                missing.append(f"{name}: its per-layer microbenchmark times GPU kernels")
            else:
                with console.status(f"{name}: its per-layer microbenchmark"):
                    own = tier.micro(batch, res, dtype, channels_last, baselines=False)  # its kernels alone
                    per_rung[name] = hand_written_rows(name, own, layers)
        elif not isinstance(tier, PythonTier):
            missing.append(f"{name}: a program of the whole network; it builds no sub-network")
        else:
            rows_file = out / f"layers-{name}.json"
            argv = [sys.executable, "-m", "harness.child.layerbench", "--tier", name, "--model", model,
                    "--batch", str(batch), "--res", str(res), "--dtype", dtype, "--layout", layout_name(channels_last),
                    "--device", device, "--weights", str(weights), "--out", str(rows_file), "--reps", str(reps)]
            with console.status(f"{name}: {len(layers)} layers, each built and timed alone"):
                proc = procs.run(argv, cwd=REPO, env=procs.child_env(), capture_output=True, text=True)
            if proc.returncode != 0:
                missing.append(f"{name}: failed: {' '.join(proc.stderr.split())[-300:]}")
                continue
            per_rung[name] = {r["layer"]: r for r in json.loads(rows_file.read_text())}
    rows = layer_rows(layers, per_rung, peaks, batch, dtype)
    title = f"{model}: each layer alone, batch {batch}, res {res}, {dtype}, {layout_name(channels_last)}"
    display = layer_display(rows, list(per_rung))
    console.print(*side_by_side_tables(title, "ms per call (median); floor: the layer's roofline; fastest: its lead "
                                       "over the next; parity and raw samples: --json", display, console.width))
    for line in missing:
        console.print(line, markup=False, style="yellow", overflow="ellipsis", no_wrap=True)
    doc = {"environment": environment(device), "model": model, "batch": batch, "res": res, "dtype": dtype,
           "layout": layout_name(channels_last), "peaks": peaks, "layers": rows, "missing": missing}
    json_path, md_path = json_path or out / "layers.json", md_path or out / "layers.md"
    write_text_atomic(json_path, json.dumps(doc, indent=1))
    write_text_atomic(md_path, "\n".join([
        f"# {title}", "", *textwrap.wrap(
            "Each distinct convolution of the network with its BatchNorm and epilogue (relu; add+relu adds the "
            "block's shortcut, read from memory; none: the downsample), run alone. Each rung's column: median ms "
            "per call and, in brackets, the share of the layer's roofline floor it reaches (the larger of its FLOPs "
            "at the measured matmul rate and its bytes at the measured copy bandwidth; e4m3 bytes for fp8), or the "
            "engine's algorithm where it multiplies less than the direct convolution the floor counts (winograd, "
            "fft). FAIL: parity against eager fp32 failed. A hand-written rung's time comes from its own per-layer "
            "microbenchmark (triton: its kernel with the layer's epilogue, checked there against the layer in "
            "fp32); *: one that does not check parity there (cudnn; its whole network's is checked in the "
            "ladder).", 100), "",
        *side_by_side_markdown(display, "layer"), *(f"- {line}" for line in missing), ""]))
    console.print(f"JSON: {json_path}  markdown: {md_path}", markup=False)
    return 1 if any(not (r.get("parity") or {}).get("ok", True) for d in per_rung.values() for r in d.values()) else 0


def measure_peaks(out: Path) -> dict:
    """The GPU's matmul rate per dtype and its copy bandwidth, in a process of its own (harness/child/reference.py)."""
    path = out / "peak.json"
    proc = procs.run([sys.executable, "-m", "harness.child.reference", "peak", str(path)], cwd=REPO,
                     env=procs.child_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise Refusal(f"measuring the GPU's peaks failed: {' '.join(proc.stderr.split())[-300:]}", status=1)
    return json.loads(path.read_text())


def hand_written_rows(name: str, rows: list[dict], layers: tuple[Layer, ...]) -> dict[str, dict]:
    """A hand-written rung's per-layer microbenchmark by layer path: its rows name the layer, or its shape (then
    each layer of that shape takes the row, whatever its epilogue: the row says what it timed)."""
    by_path = {}
    for layer in layers:
        row = next((r for r in rows if r.get("layer") == layer.path), None) or next(
            (r for r in rows if r.get("shape") and layer.shape.startswith(r["shape"] + " ")), None)
        if row is not None:
            by_path[layer.path] = {"median_ms": row.get("median_ms", row.get(f"{name}_ms")),
                                   "timed": "its own per-layer microbenchmark", "row": row,
                                   **({"parity": row["parity"]} if "parity" in row else {})}
    return by_path


def element_bytes(dtype: str) -> int:
    """Bytes per activation and weight element in a layer's floor: fp8's are e4m3, its lower bound (the fp8 cell
    keeps the stem and each block's output in bf16)."""
    return 1 if dtype == "fp8" else torch_dtype(dtype).itemsize


def multiplies_less(result: dict) -> str | None:
    """The algorithm of a rung's layer, where it multiplies less than the direct convolution a floor counts
    (a cuDNN Winograd or FFT engine, by its numerical notes): that floor does not bound it (cuDNN's fp32 FFT 3x3s
    ran at 142-167% of it), so no share of it is claimed."""
    algorithm = (result.get("row") or {}).get("algorithm")
    return algorithm if algorithm in ("winograd", "fft") else None


def layer_rows(layers: tuple[Layer, ...], per_rung: dict[str, dict[str, dict]], peaks: dict, batch: int,
               dtype: str) -> list[dict]:
    """A row per layer: its shape, count, FLOPs and bytes, its roofline floor, each rung's result."""
    rate = (peaks.get("tflops") or {}).get(dtype)
    bandwidth = peaks.get("copy_gbs")
    rows = []
    for layer in layers:
        flops, nbytes = layer.flops(batch), layer.bytes(batch, element_bytes(dtype))
        floor = None
        if rate and bandwidth:
            math_ms, memory_ms = flops / (rate * 1e9), nbytes / (bandwidth * 1e6)
            floor = {"ms": max(math_ms, memory_ms), "bound": "math" if math_ms >= memory_ms else "memory"}
        row = {"layer": layer.path, "shape": layer.shape, "count": layer.count, "flops": flops, "bytes": nbytes,
               "floor": floor, "rungs": {}}
        for name, results in per_rung.items():
            r = results.get(layer.path)
            if r is None:
                continue
            ms = r.get("median_ms")
            row["rungs"][name] = {**r, "tflops": flops / (ms * 1e9) if ms else None,
                                  "share_of_floor": floor["ms"] / ms if floor and ms and not multiplies_less(r) else
                                  None}
        timed = sorted(((v["median_ms"], k) for k, v in row["rungs"].items()
                        if v.get("median_ms") and (v.get("parity") or {}).get("ok", True)))
        if len(timed) > 1:
            row["fastest"], row["lead"] = timed[0][1], timed[1][0] / timed[0][0]
        rows.append(row)
    return rows


def layer_display(rows: list[dict], rungs: list[str]) -> list[dict[str, str]]:
    def cell(r: dict | None) -> str:
        if r is None:
            return ""
        if r.get("error") or not r.get("median_ms"):
            return "error"
        share = r.get("share_of_floor")
        label = f"{share:.0%}" if share else multiplies_less(r)
        text = f"{r['median_ms']:.3g}" + (f" ({label})" if label else "")
        if "parity" not in r:
            return text + "*"
        return text if r["parity"]["ok"] else f"FAIL {text}"

    floors = any(row["floor"] for row in rows)  # none without a GPU's peaks
    return [{"layer": f"{row['layer']} x{row['count']}",
             **({"floor": f"{row['floor']['ms']:.3g} {row['floor']['bound'][:3]}" if row["floor"] else ""}
                if floors else {}),
             **{name: cell(row["rungs"].get(name)) for name in rungs},
             "fastest": f"{row['fastest']} {row['lead']:.2f}x" if row.get("fastest") else ""} for row in rows]
