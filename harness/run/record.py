"""The record of one cell: built here from the child's result file and the parent's observations, and defined here
(DEFINITIONS, shipped inside every JSON document so it reads on its own). The report renders records; it makes none."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from core import model as model_io
from core import train
from core.cell import Cell
from core.env import source_revision, utc_now
from core.flops import flops_per_group, flops_per_image
from core.layers import convolutions, elements_per_group
from core.parity import NEARER_THAN_ANOTHER_INPUT, judges_stages, verdict
from core.placement import torch_dtype
from core.stats import summarize
from harness.child.contract import SUSTAIN_WINDOW_S
from harness.run import census
from harness.run.contention import describe
from harness.run.context import Context
from harness.run.rundir import cell_dir
from harness.run.status import DEFINITION, Status
from tiers import get_tier

SCHEMA_VERSION = 1

HOST_BOUND = 0.8  # host time / latency from which a cell counts as host-bound (measured cells sit near 1 or <= 0.6)

# What every figure of a record means; shipped inside every JSON file so it reads on its own.
DEFINITIONS = {
    "speedups": "derived when the document is written (harness/results/derive.py): vs_eager = eager's median over this "
                "cell's (eager at the same task, batch, res, layout and dtype, bf16 for fp8; `eager` its key); "
                "vs_best_framework = the same over the fastest cell of a framework rung (not hand-written) at the "
                "same task, batch, res and dtype in any layout, mode or option (`best_framework` its key)",
    "census": "the kernel census of the cell's census pass (python -m harness micro --tiers; after every timed "
              "phase): unit (GPU kernels; on the CPU operators by self time), steps profiled, wall_ms (a step's "
              "wall time, synchronised), busy_ms (time at least one kernel ran), kernel_ms (the kernels' summed "
              "time per step), host_gaps_ms (wall - busy: the host's cost), kernels_per_step, attribution (share of "
              "kernel time per basis: harness/run/census.py), groups and layers (ms, kernels and TFLOP/s per step; a "
              "group's floor_gbs: its convolutions' inputs, outputs, shortcuts and weights through memory once, per "
              "second of its time: the least it moves), "
              "kernels (launches per step, total_ms per step, median_us, share), trace (the Chrome trace)",
    "status": DEFINITION,
    "where": "what measured the cell: host (its name), gpu (NVML name and UUID of the GPU its child ran on, and "
             "where the run spread over several GPUs, locally or on Ray, its measured matmul_tflops per dtype), "
             "cpu_affinity (the child's CPUs, a cpulist: its GPU's NUMA node where the host says, else every CPU), "
             "omp_num_threads (the OMP_NUM_THREADS the child inherited: null, unset, lets torch use every core)",
    "ray": "--executor ray: the cost of the Ray task that measured the cell's unit (one rung's cells), the same in "
           "each of its records: dispatch_s (from its submission, with a GPU free, to its body starting in a fresh "
           "worker), return_s (from the body's end to its records back at the driver), unit_cells; across hosts both "
           "carry the offset between the two hosts' clocks",
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
    "repeatable": "whether one more call after the timed phases, on the same input, gave the first call's logits "
                  "bit for bit (false: the rung's output varies from call to call: a race, an atomic sum, a read of "
                  "memory it does not own); null for a training step, whose state moves on, and in runs before it",
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
              "reference top-1 margin exceeds twice the tolerance); ok = within the dtype's tolerance. Below fp32 "
              "also: eager_rel_err (eager at the same dtype, bf16 for fp8) and ratio_to_eager = rel_err / it; "
              "recipe (where the rung names one, core/recipes.py): the rung's roundings written in PyTorch at the "
              "dtype, norm_rel_err = ||out - recipe|| / ||recipe||, ok = within core.parity.RECIPE_TOLERANCES (None: "
              "recorded, not judged); ok then requires both. A training cell: each step's loss, the update over "
              "all parameters, each parameter tensor's gain (<u, u_eager> / <u_eager, u_eager>, worst_group) and "
              "the running statistics against eager fp32 (core/train.py)",
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
              "not polled while timing), CUDA context included (nvml_source says how it was read); rss_peak_bytes: "
              "the child process's own peak resident host memory (VmHWM; null without /proc); rungs with "
              "their own memory plan report workspace_bytes / activation_bytes / weights_bytes; training steps "
              "report weights_bytes, gradient_bytes, optimizer_state_bytes and activations_and_workspace_bytes = "
              "allocator peak minus those and the input (an estimate: at the peak some gradients are not yet "
              "allocated)",
    "utilisation": "NVML GPU utilisation, SM and memory clocks and board power sampled every 20 ms during the util "
                   "pass (back-to-back calls, --util-s, after the timed phases); energy_j = the board energy counter "
                   "over energy_window_s, energy_update_s = how often the counter moved, energy_rel_err = one "
                   "update over the window; img_per_joule = images per second over average_power_w, or null with "
                   "energy_withheld saying why (a window under 1 s, or an average above the board's power limit)",
    "clocks": "NVML's SM and memory clocks and board power read every 0.1 s during the timed phases (warmup, "
              "latency, pipelined, e2e; clocks and power only), median and min (power: max), with the GPU's maximum "
              "clocks and power limit; slow = the SM clock's median below 95% of its maximum; held_by = the share "
              "of readings in which each of NVML's reasons held the clock (power cap, thermal, ...)",
    "sustained": "a GPU cell at --sustain-batch or more under --sustain S: its util pass lasts S + 2 s and these "
                 "figures are its last 2 s (window_s, starting after_s into the pass): throughput_img_s from the "
                 "child's own marks, NVML's clocks, power and energy over the same seconds, img_per_joule",
    "task": "'infer': each timed call is one forward; 'train': one training step (forward with BatchNorm in "
            "training mode, cross-entropy against fixed labels, backward, SGD with momentum 0.9 and weight decay "
            "1e-4; bf16/fp16 = autocast over fp32 master weights, fp16 with a gradient scaler; core/train.py). "
            "A training cell's latency, img/s, host time and memory are per step, its parity compares the loss "
            "of 3 steps, the updated weights and the running statistics with eager fp32's, and its first result "
            "is the first step",
    "tflops": "achieved = FLOPs of one forward (a training step counts as 3 forwards) (2 per multiply-accumulate "
              "in convolutions and matmuls, torch "
              "FlopCounterMode) / median latency; share of the measured cuBLAS matmul rate and of the datasheet "
              "dense peak for the cell's dtype",
    "bound": "'host' when the CPU time to issue one forward (host_overhead_us median) is at least "
             f"{HOST_BOUND:.0%} of its latency median: the GPU waited on the host, so the latency measures the "
             "host's speed and moves with it between processes; 'gpu' otherwise; null on the CPU or without a "
             "result",
    "measured_at": "UTC time the cell's measurement began (before its process was started)",
    "source": "digest of the project's source files that measured the cell (environment.source: the same digest, "
              "with the git commit where the run had one; core.env.source_revision)",
    "interpreted": "true where the rung's kernels ran in an interpreter (Triton's, TRITON_INTERPRET=1 on the CPU): "
                   "its parity is real, its timings are the interpreter's and are never ranked, plotted or "
                   "compared as a speed",
    "build_stats": "rung-specific facts (e.g. compile: graphs, graph breaks, guards, recompiles on a batch change, "
                   "guard-check cost; onnxruntime: providers in use; C++ rungs: algorithms chosen)",
}


def ranked(r: dict) -> bool:
    """Whether the record's timings are a speed to compare and rank: measured ok, and not in an interpreter."""
    return r["status"] == Status.OK and not r.get("interpreted")


def contended(r: dict) -> bool:
    """Whether the cell was timed beside another busy process (its figures include that load)."""
    return bool((r.get("contention") or {}).get("flagged"))


CONTENDED_MARK = " (contended)"


def contended_line(records: list[dict]) -> str | None:
    """The run's summary of cells measured beside other load, or None where there are none."""
    busy = [r for r in records if r["status"] == Status.OK and contended(r)]
    if not busy:
        return None
    most = max(r["contention"].get("other_cpus_busy") or 0 for r in busy)
    return (f"{len(busy)} of {sum(r['status'] == 'ok' for r in records)} measured cells ran beside other load "
            f"(marked 'contended'; other processes kept up to {most:.1f} CPUs busy): their figures include that "
            "load, and they are not a speed of the rung alone.")


def bound(r: dict) -> str | None:
    """'host' or 'gpu': what a cell's latency measures (DEFINITIONS['bound'])."""
    if r["status"] != Status.OK or r["device"] != "cuda" or not r.get("host_overhead_us"):
        return None
    host_ms = r["host_overhead_us"]["median"] / 1e3
    return "host" if host_ms >= HOST_BOUND * r["latency_ms"]["median"] else "gpu"


def document(records: list[dict], environment: dict, protocol: dict, extra: dict | None = None) -> dict:
    """The JSON document of a run (or of merged runs): environment, protocol, definitions, and every record."""
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


def base_record(cell: Cell) -> dict[str, Any]:
    d = cell.to_dict()
    return {"key": cell.key, "label": cell.label, **d, "layout": cell.layout,
            "status": None, "reason": None, "parity": {"ok": None}, "measured_at": utc_now(),
            "source": source_revision()["digest"]}


def recipe_references(cell: Cell) -> dict[str, tuple[str, str, str]]:
    """The references an inference cell below fp32 is measured against besides eager fp32, as (recipe, dtype,
    layout) for RunDir.reference: `eager`, eager at the same dtype (bf16 for fp8), whose error the cell's is
    divided by; `recipe`, the rung's own recipe at the cell's dtype, where it names one (Tier.parity_recipe)."""
    if cell.task != "infer" or cell.dtype == "fp32":
        return {}
    refs = {"eager": ("eager", "bf16" if cell.dtype == "fp8" else cell.dtype, cell.layout)}
    recipe = get_tier(cell.tier).parity_recipe(cell)
    if recipe:  # the folded recipes compute the same in any layout
        refs["recipe"] = (recipe, cell.dtype, cell.layout if recipe == "eager" else "any")
    return refs


def stage_reference(ctx: Context, cell: Cell) -> Path | None:
    """The file of the recipe's stages that the cell's child runs the rung's stages against, where its parity
    judges stages (core/parity.py judges_stages)."""
    recipe = recipe_references(cell).get("recipe")
    if recipe is None or not judges_stages(recipe[0], cell.dtype):
        return None
    return ctx.run.reference(cell.batch, cell.res, recipe=recipe)


def check_parity(ctx: Context, cell: Cell, stages: dict[str, dict[str, float]] | None = None) -> dict:
    """The cell's output against the eager fp32 reference: one forward's logits, or a training cell's losses and
    state after the parity steps. Below fp32, also against the rung's recipe at its dtype, and as a ratio to
    eager's error at that dtype (recipe_references); where it judges stages, the child's `stages` errors too."""
    ref = ctx.run.reference(cell.batch, cell.res, cell.task)
    out = cell_dir(ctx.run, cell) / "output.safetensors"
    if cell.task == "train":
        start = load_file(ctx.run.weights_for(cell.task))
        return train.compare(load_file(out), load_file(ref), start, cell.dtype)
    out, ref = model_io.read_tensor(out, "output"), model_io.read_tensor(ref, "output")
    other = (model_io.read_tensor(ctx.run.reference(cell.batch, cell.res, cell.task, seed=1), "output")
             if cell.dtype in NEARER_THAN_ANOTHER_INPUT else None)
    keys = recipe_references(cell)
    refs = {k: model_io.read_tensor(ctx.run.reference(cell.batch, cell.res, recipe=key), "output")
            for k, key in keys.items()}
    return verdict(out, ref, cell.dtype, other, refs.get("eager"),
                   (keys["recipe"][0], refs["recipe"]) if "recipe" in refs else None, stages)


def finish_record(ctx: Context, record: dict, cell: Cell, raw: dict, wall_s: float) -> dict:
    """A cell whose child wrote its result: parity, the cold part, memory and utilisation; then, unless parity
    failed or the cell was contended under --isolation-check error, its timings."""
    record["wall_s"] = wall_s
    record["parity"] = parity = check_parity(ctx, cell, raw.get("stage_errors"))
    record["cold"] = {**raw["cold"], "time_to_first_result_s": sum(raw["cold"].values())}
    record["build_stats"] = raw["build_stats"]
    record["interpreted"] = bool(raw["build_stats"].get("interpreted"))
    record["hot_start"] = raw.get("hot_start")
    record["repeatable"] = raw.get("repeatable")  # absent from a C++ program built before it
    if ctx.protocol.census_steps:
        record["census"] = census_of(ctx, cell, raw.get("census") or {"error": "the child made no census"})
    record["stream"] = raw["stream"]
    nvml = record.pop("nvml")
    record["memory"] = {**raw["memory"], **{k: nvml[k] for k in ("nvml_process_peak_bytes", "nvml_source")
                                            if k in nvml}, "rss_peak_bytes": raw["rss_peak_bytes"]}
    record["utilisation"] = util = nvml.get("utilisation")
    if util and raw["util"]["seconds"] > 0:
        util.update(per_joule(util, raw["util"]["iters"] * cell.batch / raw["util"]["seconds"]))
    record["clocks"] = clocks_while_timed(nvml.get("timed_clocks"))
    if ctx.protocol.sustains(cell):
        record["sustained"] = sustained(nvml.get("sustained"), raw["util"], cell.batch)
    if not parity["ok"]:
        record.update(status=Status.PARITY_FAIL, reason=f"parity failed: {parity.get('reason')}; timings withheld")
        return record
    contention = record.get("contention") or {}
    if contention.get("flagged") and ctx.isolation_check == "error":
        record.update(status=Status.CONTENDED, reason=f"measured beside other busy processes ({describe(contention)}); "
                      "timings withheld (--isolation-check error)")
        return record
    record.update(status=Status.OK, **timings(ctx, cell, raw))
    return record


# A cell whose SM clock's median while timed is below this share of the GPU's maximum is flagged (report.py).
SLOW_CLOCK_SHARE = 0.95
# The shortest energy window whose img/J is recorded: NVML's counter moves every few tens of ms.
MIN_ENERGY_WINDOW_S = 1.0


def per_joule(window: dict, images_per_s: float) -> dict:
    """img/J over an NVML energy `window` (harness/run/sampler.py energy) at `images_per_s`, or why it is withheld: a
    window too short for the counter, or an average power above the board's limit (which a right reading cannot
    give)."""
    if not window.get("energy_j") or not window.get("average_power_w"):
        return {"img_per_joule": None, "energy_withheld": "the energy counter was not read twice in the window"}
    if window["energy_window_s"] < MIN_ENERGY_WINDOW_S:
        return {"img_per_joule": None, "energy_withheld": f"a {window['energy_window_s']:.2f} s window, shorter "
                f"than the {MIN_ENERGY_WINDOW_S:g} s the energy counter needs"}
    limit = window.get("power_limit_w")
    if limit and window["average_power_w"] > limit:
        return {"img_per_joule": None, "energy_withheld": f"average power {window['average_power_w']:.0f} W over "
                f"the window, above the board's {limit:.0f} W limit: the energy counter misread it"}
    return {"img_per_joule": images_per_s / window["average_power_w"]}


def clocks_while_timed(timed: dict | None) -> dict | None:
    """The clocks and power NVML read during the timed phases, with the SM clock's share of the GPU's maximum and
    whether it sat below SLOW_CLOCK_SHARE, and what held it there (NVML's reasons, the commonest first)."""
    if not timed:
        return None
    out = dict(timed)
    if timed.get("sm_clock_max_mhz"):
        share = timed["sm_clock_mhz_median"] / timed["sm_clock_max_mhz"]
        out.update(sm_share_of_max=share, slow=share < SLOW_CLOCK_SHARE)
    held = timed.get("held_by") or {}
    out["held_by_most"] = max(held, key=held.get) if held else None
    return out


def sustained(window: dict | None, util: dict, batch: int) -> dict:
    """A sustained cell's figures: throughput over its util pass's last SUSTAIN_WINDOW_S (from the child's marks),
    with NVML's clocks, power and energy over the same seconds (`window`), and its img/J (per_joule)."""
    marks = util.get("marks") or []
    if len(marks) < 2 or not window:
        return {"error": "no marks from the child or no NVML samples in the window"}
    end_t, end_n = marks[-1]
    start_t, start_n = next((m for m in marks[:-1] if m[0] >= end_t - SUSTAIN_WINDOW_S), marks[-2])
    images_per_s = (end_n - start_n) * batch / (end_t - start_t)
    return {"throughput_img_s": images_per_s, "window_s": end_t - start_t, "after_s": start_t,
            **window, **per_joule(window, images_per_s)}


def census_of(ctx: Context, cell: Cell, raw: dict) -> dict:
    """The census from the trace the child wrote (its path relative to the run directory), or why there is none."""
    if raw.get("error"):
        return raw
    trace = cell_dir(ctx.run, cell) / "census.trace.json"
    try:
        element = torch_dtype(cell.dtype).itemsize  # the activations' type (fp8 cells keep bf16)
        group_bytes = {g: (act * cell.batch + weights) * element
                       for g, (act, weights) in elements_per_group(cell.model, cell.res).items()}
        summary = census.summarise(census.load(trace), convolutions(cell.model), flops_per_group(cell.model, cell.res),
                                   cell.batch, cell.task == "train", group_bytes)
    except (OSError, ValueError, KeyError) as e:
        return {**raw, "error": f"{type(e).__name__}: {e}"}
    return {**raw, **summary, "trace": str(trace.relative_to(ctx.run.path))}


def timings(ctx: Context, cell: Cell, raw: dict) -> dict[str, Any]:
    """The timed figures of a cell's result, summarised from its raw samples."""
    lat = summarize(raw["latency"]["samples_ms"])
    pipe = raw["pipelined"]
    # A training step is counted as 3 forwards (the backward computes gradients of activations and of weights).
    flops = flops_per_image(cell.model, cell.res) * cell.batch * (3 if cell.task == "train" else 1)
    achieved = flops / (lat["median"] * 1e-3) / 1e12
    peaks = ctx.peak_tflops or {}
    return {
        "latency_ms": lat,
        "latency_samples_ms": raw["latency"]["samples_ms"],
        "latency_stopped": raw["latency"].get("stopped"),
        "throughput_img_s": cell.batch / lat["median"] * 1e3,
        "pipelined": {"iters": pipe["iters"], "ms_per_iter": pipe["total_ms"] / pipe["iters"],
                      "throughput_img_s": cell.batch * pipe["iters"] / pipe["total_ms"] * 1e3},
        "host_overhead_us": summarize(raw["host"]["samples_us"]),
        "e2e_ms": {k.removesuffix("_ms"): summarize(v) for k, v in raw["e2e"].items()},
        "warmup": raw["warmup"],
        "tflops": {
            "flops_per_step" if cell.task == "train" else "flops_per_forward": flops,
            "achieved": achieved,
            "measured_peak": (peaks.get("measured") or {}).get(cell.dtype),
            "share_of_measured_peak": achieved / peaks["measured"][cell.dtype] if (peaks.get("measured") or {}).get(cell.dtype) else None,
            "datasheet_peak": (peaks.get("datasheet") or {}).get(cell.dtype),
            "share_of_datasheet_peak": achieved / peaks["datasheet"][cell.dtype] if (peaks.get("datasheet") or {}).get(cell.dtype) else None,
        },
    }
