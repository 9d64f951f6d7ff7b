"""The columns of every results table and of the CSV, each declared once: its header in the tables, its name and
raw value in the CSV, its text in the tables and what it means (the markdown's key). A new column is one entry of
COLUMNS; the terminal table, the markdown, the CSV and the key all read them from here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from core.cell import layout_name
from harness.results.derive import (CROSS_GPU, CROSS_RUN, SLOW_MARK, best_framework, eager_baseline, fmt, mixed,
                                    mixes_gpus, mixes_host_draws, speedup)
from harness.run.record import CONTENDED_MARK, bound, contended, ranked
from harness.run.status import Status


@dataclass(frozen=True)
class View:
    """What a record's row derives from the records shown with it, computed once per record."""
    ok: bool  # measured
    speed: bool  # its timings rank as speed (not an interpreted cell's)
    base: dict | None  # its eager baseline
    framework: dict | None  # the best framework cell of its configuration
    vs_eager: float | None
    vs_framework: float | None


def view(records: list[dict], r: dict) -> View:
    base, framework = eager_baseline(records, r), best_framework(records, r)
    return View(ok=r["status"] == Status.OK, speed=ranked(r), base=base, framework=framework,
                vs_eager=speedup(base, r), vs_framework=speedup(framework, r))


def at(path: str) -> Callable[[dict, View], Any]:
    """The raw value at a dotted path of the record (None where any part is absent)."""
    def get(r: dict, _: View) -> Any:
        for part in path.split("."):
            r = r.get(part) if isinstance(r, dict) else None
        return r
    return get


@dataclass(frozen=True)
class Column:
    header: str | None  # the tables' header; None: in the CSV only
    csv: str | None  # the CSV's name; None: in the tables only
    raw: Callable[[dict, View], Any] | None = None  # the CSV's value: a number in its unit or a plain word
    text: Callable[[dict, View], str] | None = None  # the tables' text
    meaning: str = ""  # the markdown's key to the column ("header = what it measures"); "": none
    gpu_only: bool = False  # a GPU figure: on the CPU the key says it is left out


def _when(flag: str, show: Callable[[dict, View], str]) -> Callable[[dict, View], str]:
    """The text of `show` where the view's `flag` (ok, speed) holds, else empty."""
    return lambda r, v: show(r, v) if getattr(v, flag) else ""


def _number(path: str, spec: str, flag: str | None = None) -> Callable[[dict, View], str]:
    get = at(path)

    def show(r: dict, v: View) -> str:
        return fmt(get(r, v), spec)
    return _when(flag, show) if flag else show


def _rung(r: dict, v: View) -> str:
    return (r["label"] + (" (interpreted)" if v.ok and not v.speed else "")
            + (CONTENDED_MARK if v.ok and contended(r) else ""))


def _vs_eager(r: dict, v: View) -> str:
    if not v.vs_eager:
        return ""
    return (fmt(v.vs_eager, ".2f") + "x" + mixed(r) + (CROSS_RUN if mixes_host_draws(v.base, r) else "")
            + (CROSS_GPU if mixes_gpus(v.base, r) else ""))


def _parity(r: dict, _: View) -> str:
    par = r.get("parity") or {}
    if par.get("ok") is None:
        return ""
    varies = " varies" if r.get("repeatable") is False else ""  # not the same output on the same input twice
    return (f"{'ok' if par['ok'] else 'FAIL'} {par.get('rel_err', 0):.1e}" if "rel_err" in par else "FAIL") + varies


def _sm_clock(r: dict, v: View) -> str:
    clk = (r.get("clocks") or {}) if v.ok else {}
    return fmt(clk.get("sm_clock_mhz_median"), ".0f") + (SLOW_MARK if clk.get("slow") else "")


def _mib(path: str) -> Callable[[dict, View], str]:
    get = at(path)

    def show(r: dict, v: View) -> str:
        x = get(r, v)
        return fmt(x / 2**20, ".0f") if x else ""
    return show


def _stage_err(r: dict, _: View) -> float | None:
    """The worst stage's figure; a record from before the code share (2026-12-02) has its norm only."""
    stages = (r.get("parity") or {}).get("stages") or {}
    return stages.get("value", stages.get("norm_rel_err"))


def _stage(r: dict, v: View) -> str:
    stages = (r.get("parity") or {}).get("stages")
    if not stages:
        return ""
    codes = " (codes)" if stages.get("measure") == "codes" else ""
    return f"{fmt(_stage_err(r, v), '.1e')} {stages['worst']}{codes}"


TIMING_GPU = "median/p99 = warm per-forward GPU time (CUDA events on the rung's stream, one sync per forward)"
TIMING_CPU = "median/p99 = warm per-forward wall time on the host (the CPU computes the forward)"

COLUMNS: tuple[Column, ...] = (
    Column("rung", "rung", at("label"), _rung),
    Column(None, "tier", at("tier")),
    Column("task", "task", lambda r, _: r.get("task", "infer"), lambda r, _: r.get("task", "infer")),
    Column(None, "model", at("model")),
    Column("batch", "batch", at("batch"), lambda r, _: str(r["batch"])),
    Column("res", "res", at("res"), lambda r, _: str(r["res"])),
    Column("dtype", "dtype", at("dtype"), lambda r, _: r["dtype"]),
    Column("layout", "layout", lambda r, _: r.get("layout") or layout_name(r["channels_last"]),
           lambda r, _: layout_name(r["channels_last"])),
    Column(None, "cuda_graph", at("cuda_graph")),
    Column(None, "device", at("device")),
    Column("start", "start", at("start"), lambda r, _: r.get("start") or ""),
    Column("status", "status", at("status"),
           lambda r, v: Status.OK if v.ok else f"{r['status'].upper()}: {r.get('reason') or ''}"[:90]),
    Column(None, "reason", at("reason")),
    Column("median ms", "latency_median_ms", at("latency_ms.median"), _number("latency_ms.median", ".3f", "ok"),
           TIMING_GPU),
    Column(None, "latency_p90_ms", at("latency_ms.p90")),
    Column("p99 ms", "latency_p99_ms", at("latency_ms.p99"), _number("latency_ms.p99", ".3f", "ok")),
    Column(None, "latency_ci95_low_ms", at("latency_ms.ci95_low")),
    Column(None, "latency_ci95_high_ms", at("latency_ms.ci95_high")),
    Column("CV %", "latency_cv", at("latency_ms.cv"),
           _when("ok", lambda r, _: fmt((r.get("latency_ms") or {}).get("cv", 0) * 100, ".1f"))),
    Column(None, "latency_n", at("latency_ms.n")),
    Column("img/s", "throughput_img_s", at("throughput_img_s"), _number("throughput_img_s", ",.0f", "speed"),
           "img/s = batch / median"),
    Column("pipelined img/s", "pipelined_img_s", at("pipelined.throughput_img_s"),
           _number("pipelined.throughput_img_s", ",.0f", "speed"), "pipelined = no sync between forwards"),
    Column("vs eager", "speedup_vs_eager", lambda r, v: fmt(v.vs_eager, ".6g"), _vs_eager,
           "vs eager = eager's median over this cell's (eager at the same task, batch, res, layout and dtype; bf16 "
           "for fp8)"),
    Column(None, "speedup_cross_run", lambda r, v: mixes_host_draws(v.base, r)),
    Column(None, "speedup_cross_gpu", lambda r, v: mixes_gpus(v.base, r)),
    Column("vs fw", "speedup_vs_best_framework", lambda r, v: fmt(v.vs_framework, ".6g"),
           lambda r, v: fmt(v.vs_framework, ".2f") + "x" + mixed(r) if v.vs_framework else "",
           "vs fw = speed-up over the fastest framework (not hand-written) cell of the same task, batch, res and "
           "dtype, in any layout, mode or option"),
    Column(None, "best_framework", lambda r, v: v.framework["label"] if v.framework else ""),
    Column("host us/call", "host_overhead_us", at("host_overhead_us.median"),
           _number("host_overhead_us.median", ".0f", "ok"), "host us/call = CPU time inside one forward call"),
    Column("bound", "bound", lambda r, _: bound(r), lambda r, _: bound(r) or "",
           "bound = host where the CPU time to issue a forward is most of its latency (the figure then measures the "
           "host and varies between processes), gpu otherwise", gpu_only=True),
    Column(None, "e2e_pageable_ms", at("e2e_ms.pageable.median")),
    Column(None, "e2e_pinned_ms", at("e2e_ms.pinned.median")),
    Column(None, "e2e_device_ms", at("e2e_ms.device.median")),
    Column("TFLOP/s", "tflops", at("tflops.achieved"),
           lambda r, v: fmt((r.get("tflops") or {}).get("achieved"), ".1f") if v.speed and r["device"] == "cuda"
           else "", gpu_only=True),
    Column(None, "share_of_measured_peak", at("tflops.share_of_measured_peak")),
    Column(None, "load_s", at("cold.load_s")),
    Column(None, "build_s", at("cold.build_s")),
    Column(None, "first_result_s", at("cold.first_result_s")),
    Column("first result s", "time_to_first_result_s", at("cold.time_to_first_result_s"),
           _number("cold.time_to_first_result_s", ".1f"),
           "first result = load + build + first forward in a fresh process (fresh JIT caches)"),
    Column("img/J", "img_per_joule", at("utilisation.img_per_joule"),
           _number("utilisation.img_per_joule", ".1f", "speed"),
           "img/J = over the util pass's seconds of back-to-back calls", gpu_only=True),
    Column("SM MHz", "sm_clock_mhz", at("clocks.sm_clock_mhz_median"), _sm_clock,
           "SM MHz and W = NVML's SM clock and board power while the cell was timed (median; * = below 95% of the "
           "maximum clock)", gpu_only=True),
    Column("W", "power_w", at("clocks.power_w_median"),
           lambda r, v: fmt(((r.get("clocks") or {}) if v.ok else {}).get("power_w_median"), ".0f"), gpu_only=True),
    Column("sustained img/s", "sustained_img_s", at("sustained.throughput_img_s"),
           _number("sustained.throughput_img_s", ",.0f", "speed"),
           "sustained = the last 2 s after --sustain seconds of load", gpu_only=True),
    Column("sustained img/J", "sustained_img_per_joule", at("sustained.img_per_joule"),
           _number("sustained.img_per_joule", ".1f", "speed"), gpu_only=True),
    Column("GPU MiB (NVML)", "nvml_process_peak_bytes", at("memory.nvml_process_peak_bytes"),
           _mib("memory.nvml_process_peak_bytes"), "GPU MiB = NVML per-process peak (CUDA context included)",
           gpu_only=True),
    Column("alloc MiB", "allocator_peak_bytes", at("memory.allocator_peak_bytes"), _mib("memory.allocator_peak_bytes"),
           "alloc MiB = torch allocator peak in steady state", gpu_only=True),
    Column(None, "rss_peak_bytes", at("memory.rss_peak_bytes")),
    Column("parity", "parity_ok", at("parity.ok"), _parity,
           "parity rel err = max|out-ref|/max|ref| against eager fp32; 'varies': one more call on the same input "
           "did not repeat the first call's logits bit for bit"),
    Column(None, "repeatable", at("repeatable")),
    Column(None, "parity_rel_err", at("parity.rel_err")),
    Column("err/eager", "parity_ratio_to_eager", at("parity.ratio_to_eager"), _number("parity.ratio_to_eager", ".2f"),
           "err/eager = that error over eager's at the same dtype (bf16 for fp8)"),
    Column("recipe err", "parity_recipe_rel_err", at("parity.recipe.norm_rel_err"),
           _number("parity.recipe.norm_rel_err", ".1e"),
           "recipe err = ||out-recipe||/||recipe|| against the rung's own recipe at its dtype"),
    Column("stage err", "parity_stage_err", _stage_err, _stage,
           "stage err = the same per stage, each stage of the rung fed the recipe's input for it (first images), "
           "its worst stage; (codes): a stage stored in e4m3, judged by the share of its e4m3 codes that differ "
           "from the recipe's (docs/notes/parity.md)"),
    Column(None, "parity_worst_stage", at("parity.stages.worst")),
    Column(None, "contended", at("contention.flagged")),
    Column(None, "other_cpus_busy", at("contention.other_cpus_busy")),
    Column(None, "host", at("where.host")),
    Column(None, "gpu", at("where.gpu.name")),
    Column(None, "gpu_uuid", at("where.gpu.uuid")),
)
TABLE = tuple(c for c in COLUMNS if c.header)
CSV = tuple(c for c in COLUMNS if c.csv)


def rows(records: list[dict]) -> list[dict[str, str]]:
    """One flat row per record: the text every table shows, by header."""
    return [{c.header: c.text(r, v) for c in TABLE} for r, v in ((r, view(records, r)) for r in records)]


def csv_rows(records: list[dict]) -> list[list]:
    """The CSV's header and one row per record: raw values, empty where absent."""
    out: list[list] = [[c.csv for c in CSV]]
    for r in records:
        v = view(records, r)
        out.append([("" if x is None else x) for x in (c.raw(r, v) for c in CSV)])
    return out


def how_to_read(gpu: bool) -> str:
    """The markdown's key to its columns, for the device its cells ran on."""
    meanings = [TIMING_CPU if c.meaning == TIMING_GPU and not gpu else c.meaning
                for c in TABLE if c.meaning and (gpu or not c.gpu_only)]
    if not gpu:
        left_out = [c.header for c in TABLE if c.gpu_only and c.meaning]
        meanings.append(f"{', '.join(left_out[:-1])} and {left_out[-1]} are GPU figures, left out on the CPU")
    return f"How to read it: {'; '.join(meanings)}. Full definitions and raw samples are in the JSON."
