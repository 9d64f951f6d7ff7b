"""Reports from the records: the JSON document (the source of truth), markdown, CSV and the rich table."""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from harness.env import utc_now
from tiers.base import Cell

SCHEMA_VERSION = 1

HOST_BOUND = 0.8  # host time / latency from which a cell counts as host-bound (measured cells sit near 1 or <= 0.6)

# What every figure of a record means; shipped inside every JSON file so it reads on its own.
DEFINITIONS = {
    "status": "'ok', or the failure: 'parity-fail' (output differs from the eager fp32 reference; timings "
              "withheld), 'crashed' (killed by a signal or a non-zero exit), 'oom' (an allocator refused, or the "
              "kernel's OOM killer), 'timeout' (no result within --timeout), 'error' (an exception, a failed build "
              "of our own code, or a failed eager reference), 'interrupted' (Ctrl-C, SIGTERM or SIGHUP while it "
              "ran), 'contended' (measured beside another busy process under --isolation-check error; timings "
              "withheld), 'unavailable' (rung cannot run here), 'skipped' (rung does not implement this "
              "configuration); 'reason' says why. A rerun keeps ok, parity-fail and skipped and tries the rest again",
    "isolation": "'rung': one process per rung measured its cells in turn, caches kept between processes; 'cell': "
                 "a fresh process with fresh caches per cell",
    "start": "what the cell's first result had: 'cold' (fresh process, empty caches), 'warm-start' (fresh process, "
             "caches kept: Inductor/Triton caches, tuning tables, a built C++ binary), 'hot' (a process that had "
             "already measured other cells of the rung); process_position counts those cells. cold holds the "
             "times of that start; prepared holds the prepare stage's start of the same cell where it had one "
             "(a build-only process, its first cell cold and the next hot, beside concurrent_jobs other jobs)",
    "hot_start": "first call at batch + 1 in the process of the rung's first measured cell (a new shape: the "
                 "recompile of compiling rungs), synchronised, wall clock; inference cells only",
    "cache_bytes": "size on disk of the rung's kept caches after the cell",
    "phase_s": "wall seconds of the cell per protocol phase, from the parent's clock ('start': the process's start "
               "and imports for a process's first cell); they add up to wall_s",
    "contention": "other processes during the cell's timed phases: other_cpus_busy = CPU time of processes outside "
                  "the ladder's process tree / wall time; gpu_other_pids = processes outside it holding the GPU "
                  "(NVML; null where its PIDs cannot be matched); flagged when more than half a CPU or any GPU "
                  "process",
    "latency_stopped": "why the latency pass ended: 'precision' (the median's 95% confidence interval within "
                       "+-protocol.precision), 'time' (protocol.max_time_s), 'iters' (protocol.max_iters)",
    "dtype": "fp32 = strict fp32 (TF32 off); tf32 = fp32 tensors, TF32 tensor-core math allowed; fp16/bf16 = "
             "weights and activations in that type",
    "parity": "output of the first forward vs eager fp32 (TF32 off) on the same input and weights: max_abs_err, "
              "rel_err = max_abs_err / max|ref|, cosine similarity, top-1 agreement (required on rows whose "
              "reference top-1 margin exceeds twice the tolerance); ok = within the dtype's tolerance",
    "latency_ms": "warm per-iteration time of one forward (device-resident input, output left on device), CUDA "
                  "events recorded on the stream the rung issues its work on, one sync per iteration; statistics "
                  "over latency_samples_ms (raw). On the CPU: host wall clock",
    "throughput_img_s": "batch / median latency: synchronous, one batch at a time",
    "pipelined": "forwards issued back to back with no sync, one event pair around all: ms_per_iter and "
                 "throughput_img_s when host and GPU overlap",
    "host_overhead_us": "CPU time of the calling thread inside the forward call (issuing work; excludes the sync)",
    "e2e_ms": "wall time of input copy H2D + forward + output copy D2H, synchronised: 'pageable' and 'pinned' "
              "host input; 'device' = input already on the GPU (forward + D2H only)",
    "cold": "load_s: weights from disk; build_s: everything before the first forward (device transfer, tracing, "
            "export, engine or algorithm selection, autotuning); first_result_s: first forward incl. lazy JIT, "
            "synchronised; all wall clock in a fresh process; jit_cache says whether JIT caches were fresh",
    "memory": "allocator_peak_bytes: torch caching-allocator peak allocated over 3 steady-state forwards after a "
              "peak reset (weights and persistent buffers included); allocator_reserved_peak_bytes: same, "
              "reserved; allocator_lifetime_peak_bytes: allocator peak since process start (build included); "
              "nvml_process_peak_bytes: NVML's figure for the child process, peak over its untimed phases (NVML is "
              "not polled while timing), CUDA context included (nvml_source says how it was read); rss_peak_bytes: peak resident host memory; rungs with "
              "their own memory plan report workspace_bytes / activation_bytes / weights_bytes; training steps "
              "report weights_bytes, gradient_bytes, optimizer_state_bytes and activations_and_workspace_bytes = "
              "allocator peak minus those and the input (an estimate: at the peak some gradients are not yet "
              "allocated)",
    "utilisation": "NVML GPU utilisation and SM clock sampled every 20 ms during a separate pass of back-to-back "
                   "forwards; energy_j = NVML board energy counter over that pass, img_per_joule = images per joule "
                   "of board energy",
    "task": "'infer': each timed call is one forward; 'train': one training step (forward with BatchNorm in "
            "training mode, cross-entropy against fixed labels, backward, SGD with momentum 0.9 and weight decay "
            "1e-4; bf16/fp16 = autocast over fp32 master weights, fp16 with a gradient scaler; harness/train.py). "
            "A training cell's latency, img/s, host time and memory are per step, its parity compares the loss "
            "of 3 steps, the updated weights and the running statistics with eager fp32's, and its first result "
            "is the first step",
    "tflops": "achieved = FLOPs of one forward (a training step counts as 3 forwards) (2 per multiply-accumulate in convolutions and matmuls, torch "
              "FlopCounterMode) / median latency; share of the measured cuBLAS matmul rate and of the datasheet "
              "dense peak for the cell's dtype",
    "bound": "'host' when the CPU time to issue one forward (host_overhead_us median) is at least "
             f"{HOST_BOUND:.0%} of its latency median: the GPU waited on the host, so the latency measures the "
             "host's speed and moves with it between processes; 'gpu' otherwise; null on the CPU or without a "
             "result",
    "measured_at": "UTC time the cell's measurement began (before its process was started)",
    "source": "digest of the project's source files that measured the cell (environment.source: the same digest, "
              "with the git commit where the run had one; harness.env.source_revision)",
    "build_stats": "rung-specific facts (e.g. compile: graphs, graph breaks, guards, recompiles on a batch change, "
                   "guard-check cost; onnxruntime: providers in use; C++ rungs: algorithms chosen)",
}


def bound(r: dict) -> str | None:
    """'host' or 'gpu': what a cell's latency measures (DEFINITIONS['bound'])."""
    if r["status"] != "ok" or r["device"] != "cuda" or not r.get("host_overhead_us"):
        return None
    host_ms = r["host_overhead_us"]["median"] / 1e3
    return "host" if host_ms >= HOST_BOUND * r["latency_ms"]["median"] else "gpu"


def document(records: list[dict], environment: dict, protocol: dict, extra: dict | None = None) -> dict:
    records = [{**r, "bound": bound(r)} for r in records]
    return {
        "schema_version": SCHEMA_VERSION,
        "generated": utc_now(),
        "environment": environment,
        "protocol": protocol,
        **(extra or {}),
        "definitions": DEFINITIONS,
        "results": records,
    }


def eager_baseline(records: list[dict], r: dict) -> dict | None:
    for e in records:
        if (e["tier"] == "eager" and not e["cuda_graph"] and e["status"] == "ok"
                and e.get("task", "infer") == r.get("task", "infer")
                and all(e[k] == r[k] for k in ("model", "batch", "res", "dtype", "channels_last", "device"))):
            return e
    return None


def speedup(base: dict | None, r: dict) -> float | None:
    """r's speed-up over its eager baseline (eager_baseline)."""
    if base is None or r["status"] != "ok":
        return None
    return base["latency_ms"]["median"] / r["latency_ms"]["median"]


CROSS_RUN = "†"  # marks a speed-up whose two figures are two draws of the host's speed (mixes_host_draws)


def mixes_host_draws(base: dict | None, r: dict) -> bool:
    """Whether r's speed-up over eager divides figures of two runs (a merged report) of which one is host-bound:
    each then measured its own run's host, so the ratio moves with both hosts, not with the rungs alone."""
    return base is not None and base.get("run") != r.get("run") and "host" in (bound(base), bound(r))


def _fmt(v: float | None, spec: str) -> str:
    return "" if v is None else format(v, spec)


def rows(records: list[dict]) -> list[dict[str, str]]:
    """One flat row per record: what the tables show."""
    out = []
    for r in records:
        ok = r["status"] == "ok"
        lat = r.get("latency_ms") or {}
        mem = r.get("memory") or {}
        nv = mem.get("nvml_process_peak_bytes")
        alloc = mem.get("allocator_peak_bytes")
        par = r.get("parity") or {}
        base = eager_baseline(records, r)
        vs_eager = speedup(base, r)
        out.append({
            "rung": r["label"],
            "task": r.get("task", "infer"),
            "batch": str(r["batch"]),
            "res": str(r["res"]),
            "dtype": r["dtype"],
            "layout": "nhwc" if r["channels_last"] else "nchw",
            "start": r.get("start") or "",
            "status": "ok" if ok else f"{r['status'].upper()}: {r.get('reason') or ''}"[:90],
            "median ms": _fmt(lat.get("median"), ".3f") if ok else "",
            "p99 ms": _fmt(lat.get("p99"), ".3f") if ok else "",
            "CV %": _fmt(lat.get("cv", 0) * 100, ".1f") if ok else "",
            "img/s": _fmt(r.get("throughput_img_s"), ",.0f") if ok else "",
            "pipelined img/s": _fmt((r.get("pipelined") or {}).get("throughput_img_s"), ",.0f") if ok else "",
            "vs eager": (_fmt(vs_eager, ".2f") + "x" + (CROSS_RUN if mixes_host_draws(base, r) else "")
                         if vs_eager else ""),
            "host us/call": _fmt((r.get("host_overhead_us") or {}).get("median"), ".0f") if ok else "",
            "bound": bound(r) or "",
            "TFLOP/s": _fmt((r.get("tflops") or {}).get("achieved"), ".1f") if ok else "",
            "first result s": _fmt((r.get("cold") or {}).get("time_to_first_result_s"), ".1f"),
            "img/J": _fmt((r.get("utilisation") or {}).get("img_per_joule"), ".1f") if ok else "",
            "GPU MiB (NVML)": _fmt(nv / 2**20, ".0f") if nv else "",
            "alloc MiB": _fmt(alloc / 2**20, ".0f") if alloc else "",
            "parity": ("" if par.get("ok") is None else
                       f"{'ok' if par['ok'] else 'FAIL'} {par.get('rel_err', 0):.1e}" if "rel_err" in par else "FAIL"),
        })
    return out


def columns(table: list[dict[str, Any]]) -> list[str]:
    """Every key of the rows, in the order of first appearance (a row may lack some)."""
    return list(dict.fromkeys(k for row in table for k in row))


def markdown_table(table: list[dict[str, Any]]) -> list[str]:
    """Rows of dicts as markdown lines (a key a row lacks: empty); floats with three decimals."""
    if not table:
        return []
    cols = columns(table)

    def cell(v: Any) -> str:
        return (f"{v:.3f}" if isinstance(v, float) else str(v)).replace("|", "/")

    return (["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            + ["| " + " | ".join(cell(row.get(c, "")) for c in cols) + " |" for row in table])


def host_cpu_line(host: dict) -> str:
    return (f"Host CPU at the start of the run: a fixed pure-Python chunk took {host['p10_ms']:.2f} ms (p10) to "
            f"{host['p90_ms']:.2f} ms (p90) on {len(host['cpus'])} CPUs, p90/p10 = {host['p90_over_p10']:.2f} "
            f"(1 = steady); host-bound cells move with the host.")


def markdown(doc: dict, plots: list[tuple[str, str]] = ()) -> str:
    """`plots`: (caption, path relative to the markdown file), embedded after the table."""
    env = doc["environment"]
    gpu = env.get("gpu") or {}
    lines = [f"# Tier ladder: {', '.join(sorted({r['model'] for r in doc['results']}))}", "",
             f"Generated {doc['generated']}"
             + (f" from a run started {env['started_utc']}" if env.get("started_utc") else "")
             + f" on **{gpu.get('name', 'CPU: ' + str(env.get('cpu')))}**"
             + (f" (driver {gpu.get('driver')}, CUDA driver {gpu.get('cuda_driver')})" if gpu else "") + ".",
             f"torch {env.get('torch')} (CUDA {env.get('torch_cuda')}, cuDNN {env.get('cudnn')}), "
             f"torchvision {env.get('torchvision')}, Triton {env.get('triton')}, ONNX Runtime "
             f"{env.get('onnxruntime')}, TensorRT {env.get('tensorrt') or 'not installed'}.", ""]
    if doc.get("command"):
        took = (f" ({doc['wall_s']:.0f} s, one process per {doc.get('isolation') or 'rung'})"
                if doc.get("wall_s") else "")
        lines += [f"Command: `{doc['command']}`{took}", ""]
    runs = doc.get("runs") or []
    if len(runs) > 1:
        lines += [f"Merged from {len(runs)} runs (the `run` field of each JSON record says which):"]
        for i, run in enumerate(runs):
            labels = sorted({r["label"] for r in doc["results"] if r.get("run") == i})
            e = run.get("environment") or {}
            host = (e.get("host_cpu") or {}).get("p90_over_p10")
            lines += [f"- run {i} ({(e.get('gpu') or {}).get('name', e.get('cpu'))}, torch {e.get('torch')}, ONNX "
                      f"Runtime {e.get('onnxruntime')}{f', host CPU p90/p10 {host:.2f}' if host else ''}; "
                      f"{run['source']}): {', '.join(labels) or 'superseded'}"]
        lines += [""]
    elif env.get("host_cpu"):
        lines += [host_cpu_line(env["host_cpu"]), ""]
    peaks = (doc.get("peak_tflops") or {}).get("measured")
    if peaks:
        lines += ["Measured cuBLAS matmul rate (TFLOP/s): " + ", ".join(f"{k} {v:.0f}" for k, v in peaks.items()), ""]
    table = rows(doc["results"])
    lines += markdown_table(table)
    if any(row["vs eager"].endswith(CROSS_RUN) for row in table):
        lines += ["", f"{CROSS_RUN} this rung and eager come from different runs and one of the two is host-bound: "
                  "the speed-up divides two draws of the host's speed. Compare such cells within one run."]
    lines += ["", "How to read it: median/p99 = warm per-forward GPU time (CUDA events on the rung's stream, one "
              "sync per forward); img/s = batch / median; pipelined = no sync between forwards; host us/call = "
              "CPU time to issue one forward; bound = host where that is most of the latency (the figure then "
              "measures the host and varies between processes), gpu otherwise; first result = load + build + first "
              "forward in a fresh process (fresh JIT caches); GPU MiB = NVML per-process peak (CUDA context "
              "included); alloc MiB = torch allocator peak in steady state; parity rel err = max|out-ref|/max|ref| "
              "against eager fp32. Full definitions and raw samples are in the JSON.", ""]
    for caption, rel in plots:
        lines += [f"## {caption}", "", f"![{caption}]({rel})", ""]
    return "\n".join(lines)


def _get(r: dict, path: str):
    for part in path.split("."):
        r = r.get(part) if isinstance(r, dict) else None
    return r


CSV_FIELDS = {  # column: dotted path into the record; numbers in their unit, plain words, empty where absent
    "rung": "label", "tier": "tier", "task": "task", "model": "model", "batch": "batch", "res": "res",
    "dtype": "dtype", "layout": "layout", "cuda_graph": "cuda_graph", "device": "device", "status": "status",
    "reason": "reason",
    "start": "start", "latency_median_ms": "latency_ms.median", "latency_p90_ms": "latency_ms.p90",
    "latency_p99_ms": "latency_ms.p99", "latency_ci95_low_ms": "latency_ms.ci95_low",
    "latency_ci95_high_ms": "latency_ms.ci95_high", "latency_cv": "latency_ms.cv", "latency_n": "latency_ms.n",
    "throughput_img_s": "throughput_img_s", "pipelined_img_s": "pipelined.throughput_img_s",
    "host_overhead_us": "host_overhead_us.median", "bound": "bound", "e2e_pageable_ms": "e2e_ms.pageable.median",
    "e2e_pinned_ms": "e2e_ms.pinned.median", "e2e_device_ms": "e2e_ms.device.median",
    "tflops": "tflops.achieved", "share_of_measured_peak": "tflops.share_of_measured_peak",
    "load_s": "cold.load_s", "build_s": "cold.build_s", "first_result_s": "cold.first_result_s",
    "time_to_first_result_s": "cold.time_to_first_result_s", "allocator_peak_bytes": "memory.allocator_peak_bytes",
    "nvml_process_peak_bytes": "memory.nvml_process_peak_bytes", "rss_peak_bytes": "memory.rss_peak_bytes",
    "img_per_joule": "utilisation.img_per_joule", "parity_ok": "parity.ok", "parity_rel_err": "parity.rel_err",
}


def to_csv(doc: dict) -> str:
    """Machine-readable: one row per record, numbers unformatted, plus the speed-up over eager and whether it
    divides two runs' host-bound draws (mixes_host_draws)."""
    records = doc["results"]
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow([*CSV_FIELDS, "speedup_vs_eager", "speedup_cross_run"])
    for r in records:
        r = {**r, "layout": r.get("layout") or ("nhwc" if r["channels_last"] else "nchw"), "bound": bound(r),
             "task": r.get("task", "infer")}
        base = eager_baseline(records, r)
        w.writerow([("" if v is None else v) for v in (_get(r, path) for path in CSV_FIELDS.values())]
                   + [_fmt(speedup(base, r), ".6g"), mixes_host_draws(base, r)])
    return buf.getvalue()


COMPACT = ["rung", "batch", "dtype", "layout", "median ms", "img/s", "vs eager", "bound", "parity"]


SHORT_STATUS = {"parity-fail": "FAIL", "interrupted": "stopped"}  # fits the compact table's 9-wide column


def rich_table(records: list[dict], title: str = "Tier ladder", wide: bool = False):
    """The terminal table. Compact (default): the COMPACT columns, one space apart, which fit 80 columns; a
    failure shows its status in red (its reason is a line of `failure_lines`), and rungs that are unavailable
    here or skip a cell are left to those lines. `wide`: every column and every record. Every cell is plain
    text, never rich markup (reasons quote paths in brackets)."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title, header_style="bold", box=box.SIMPLE_HEAD, padding=(0, 0), show_edge=False)
    shown = records if wide else [r for r in records if r["status"] not in ("unavailable", "skipped")]
    all_rows = rows(records)
    by_id = {id(r): row for r, row in zip(records, all_rows)}
    mixed = len({row["task"] for row in all_rows}) > 1  # a merged report of inference and training
    cols = [c for c in (list(all_rows[0]) if wide and all_rows else COMPACT) if c != "status"
            and (c != "task" or wide or mixed)]
    if mixed and not wide:
        cols.insert(1, "task")
    for c in cols:  # only the rung's name may wrap (at '(' of its options); a number or a word never breaks
        table.add_column(c, justify="left" if c in ("rung", "dtype", "layout", "parity", "bound", "start") else "right",
                         no_wrap=c != "rung")
    for r in shown:
        row = by_id[id(r)]
        if r["status"] == "ok":  # compact: the parity verdict alone (its error is in the wide table and the JSON)
            table.add_row(*[Text(row[c].split()[0] if c == "parity" and not wide and row[c] else row[c])
                            for c in cols])
        else:
            status = SHORT_STATUS.get(r["status"], r["status"]) if not wide else r["status"]
            table.add_row(*[Text(status if c == "median ms" else row[c] if c in ("rung", "batch", "dtype", "layout")
                                 else "", style="red") for c in cols])
    return table


def failure_lines(records: list[dict]) -> list[str]:
    """One line per rung and reason: which cells failed, and why (a rung unavailable here is one line, not one per
    cell)."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if r["status"] != "ok":
            groups.setdefault((r["label"], r["status"], " ".join(str(r.get("reason") or "").split())), []).append(r)
    lines = []
    for (label, status, reason), rs in groups.items():
        one = rs[0]
        cells = (f"b{one['batch']} {one['dtype']} {one.get('layout') or ('nhwc' if one['channels_last'] else 'nchw')}"
                 if len(rs) == 1 else f"{len(rs)} cells")
        lines.append(f"{label} {cells}: {status}: {reason}")
    return lines


def fastest_lines(records: list[dict]) -> list[str]:
    """One line per (batch, dtype, layout, res): the fastest rung and its lead over eager."""
    ok = [r for r in records if r["status"] == "ok"]
    out = []
    def config(r: dict) -> tuple:
        return r.get("task", "infer"), r["batch"], r["dtype"], r["channels_last"], r["res"]

    for key in sorted({config(r) for r in ok}):
        best = min((r for r in ok if config(r) == key), key=lambda r: r["latency_ms"]["median"])
        lead = speedup(eager_baseline(records, best), best)
        out.append(f"{'training, ' if key[0] == 'train' else ''}batch {key[1]} {key[2]} "
                   f"{'nhwc' if key[3] else 'nchw'} res {key[4]}: fastest {best['label']} "
                   f"{best['latency_ms']['median']:.2f} ms" + (f", {lead:.2f}x eager" if lead else ""))
    return out


def write(doc: dict, json_path: Path | None, md_path: Path | None, csv_path: Path | None) -> list[Path]:
    """The files asked for; the markdown report gets its plots in plots/ beside it. Returns the plots written."""
    from harness.plots import write_plots

    plots: list = []

    def md() -> str:
        plots.extend(write_plots(doc, md_path.parent / "plots"))
        return markdown(doc, [(c, str(p.relative_to(md_path.parent))) for c, p in plots])

    texts = ((json_path, lambda: json.dumps(doc, indent=1)), (csv_path, lambda: to_csv(doc)), (md_path, md))
    for path, text in texts:  # the JSON first: it is the source of truth
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text())
    return [p for _, p in plots]


class BadInput(Exception):
    """A report input that is not ladder results (one line says which and why)."""


def load_records(paths: list[Path]) -> tuple[list[dict], dict]:
    """Records from results.jsonl files (with their run.json) or earlier JSON documents; later files win on the
    same cell (`Cell.identity`). Each record gets `run`, an index into meta['runs'] (source and environment of its
    run), so a report merged from several machines says which machine measured what. Raises BadInput."""
    from harness.runner import read_jsonl

    by_key: dict[str, dict] = {}
    meta: dict[str, Any] = {"runs": []}
    for p in paths:
        if p.is_dir():
            raise BadInput(f"{p}: is a directory; give its results.jsonl or ladder.json")
        if not p.is_file():
            raise BadInput(f"{p}: no such file")
        if p.stat().st_size == 0:
            raise BadInput(f"{p}: empty file")
        if p.suffix == ".jsonl":
            recs = read_jsonl(p)
            run_json = p.with_name("run.json")
            run_meta = json.loads(run_json.read_text()) if run_json.exists() else {}
        else:
            try:
                d = json.loads(p.read_text(errors="replace"))
            except json.JSONDecodeError as e:
                raise BadInput(f"{p}: not JSON ({e.msg} at line {e.lineno})") from None
            if not isinstance(d, dict) or not isinstance(d.get("results"), list):
                raise BadInput(f"{p}: not a ladder JSON document (no 'results' list); give a ladder.json or a "
                               "results.jsonl")
            recs = d["results"]
            run_meta = {k: v for k, v in d.items() if k not in ("results", "definitions", "schema_version", "generated")}
        bad = [i for i, r in enumerate(recs) if not isinstance(r, dict) or not {"tier", "status", "batch"} <= set(r)]
        if bad:
            raise BadInput(f"{p}: record {bad[0]} is not a ladder record")
        meta.update({k: v for k, v in run_meta.items() if k != "runs"})
        run = len(meta["runs"])
        meta["runs"].append({"source": str(p), "environment": run_meta.get("environment"),
                             "peak_tflops": run_meta.get("peak_tflops")})
        for r in recs:
            by_key[Cell.of_record(r).identity] = {**r, "run": run}
    return list(by_key.values()), meta
