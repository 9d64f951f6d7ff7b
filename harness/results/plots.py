"""Plots of a ladder document (matplotlib, PNG): each reads on its own, with the model, the device, the dtype and
what the figure measures in its title, and units on its axes. A plot with nothing to show is not drawn."""
from __future__ import annotations

import sys
import textwrap
from collections import defaultdict
from pathlib import Path

from core.cell import DTYPES
from harness.run.record import CONTENDED_MARK, contended, ranked
from harness.run.status import Status

MIB = 2**20
TASK_NAMES = {"infer": "inference", "train": "training"}


def pyplot():
    import matplotlib  # matplotlib: a second to import, only when plotting

    matplotlib.use("Agg")  # files only; no display on a GPU host
    import matplotlib.pyplot as plt

    return plt


def _layout(r: dict) -> str:
    return "nhwc" if r["channels_last"] else "nchw"


def describe_run(doc: dict) -> str:
    env = doc.get("environment") or {}
    gpu = (env.get("gpu") or {}).get("name")
    models = doc.get("model") or ", ".join(sorted({r["model"] for r in doc["results"]}))
    return f"{models} on {gpu or 'CPU: ' + str(env.get('cpu') or 'unknown')}"


def _colours(labels) -> dict[str, tuple]:
    """One colour per rung, the same in every plot of a document."""
    plt = pyplot()
    cmap = plt.get_cmap("tab10" if len(labels) <= 10 else "tab20")
    return {label: cmap(i % cmap.N) for i, label in enumerate(sorted(labels))}


def _panels(plt, keys: list, title: str, width: float = 5.2, height: float = 3.8):
    fig, axes = plt.subplots(1, len(keys), figsize=(width * len(keys), height), squeeze=False)
    fig.suptitle("\n".join(textwrap.wrap(title, width=int(13 * width * len(keys)))), fontsize=10)
    return fig, dict(zip(keys, axes[0]))


def _batch_axis(ax, batches) -> None:
    """Log2 batch axis labelled with the batch sizes measured, as plain numbers."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(batches), [str(b) for b in sorted(batches)])
    ax.minorticks_off()
    ax.set_xlabel("batch size (images)")


def save(fig, path: Path) -> Path:
    """One legend for the whole figure, below the panels (it never hides data), then the file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handles = {}
    for ax in fig.axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    if handles:
        ncol = max(1, min(len(handles), 5, int(fig.get_figwidth() / 2.3)))  # an entry takes about 2.3 inches
        fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=ncol, fontsize=8, frameon=False)
        fig.tight_layout(rect=(0, 0.06 + 0.035 * ((len(handles) - 1) // ncol), 1, 1))
    else:
        fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")  # a long label widens the image rather than being cut
    pyplot().close(fig)
    return path


def _by_panel(ok: list[dict]) -> dict[tuple, list[dict]]:
    """Records per (task, dtype, layout, res): one panel each, so that no axis or line mixes a forward with a
    training step, two resolutions or two layouts."""
    panels = defaultdict(list)
    for r in ok:
        panels[(r.get("task", "infer"), r["dtype"], _layout(r), r["res"])].append(r)
    order = {d: i for i, d in enumerate(DTYPES)}
    return dict(sorted(panels.items(), key=lambda kv: (kv[0][0], order.get(kv[0][1], 9), kv[0][2:])))


def _at_batch(ok: list[dict], pick=min) -> dict[tuple, list[dict]]:
    """Per panel (_by_panel), the records of its smallest (pick=min) or largest batch."""
    out = {}
    for key, records in _by_panel(ok).items():
        batch = pick(r["batch"] for r in records)
        out[key] = [r for r in records if r["batch"] == batch]
    return out


def _by_rung(records: list[dict]) -> list[tuple[str, list[dict]]]:
    """(rung label, its records in batch order), rungs in name order: one line of a plot against batch each."""
    lines = defaultdict(list)
    for r in records:
        lines[r["label"]].append(r)
    return [(label, sorted(rs, key=lambda r: r["batch"])) for label, rs in sorted(lines.items())]


def _panel_name(key: tuple, keys: list[tuple]) -> str:
    """The dtype, plus the task, layout and res where the document has more than one."""
    task, dtype, layout, res = key
    return " ".join(([TASK_NAMES[task]] if len({k[0] for k in keys}) > 1 else []) + [dtype]
                    + ([layout] if len({k[2] for k in keys}) > 1 else [])
                    + ([f"res {res}"] if len({k[3] for k in keys}) > 1 else []))


def _per_call(records: list[dict]) -> str:
    """What one timed call is in these records: a forward, a training step, or either."""
    tasks = {r.get("task", "infer") for r in records}
    return "forward" if tasks == {"infer"} else "training step" if tasks == {"train"} else "call"


def against_batch(doc: dict, path: Path, metric: str) -> Path | None:
    """'throughput' (img/s = batch / median latency, synchronous) or 'latency' (median ms with its 95% CI) against
    batch size: one line per rung, one panel per dtype."""
    ok = [r for r in doc["results"] if ranked(r)]
    if len({r["batch"] for r in ok}) < 2:
        return None
    plt = pyplot()
    panels = _by_panel(ok)
    colours = _colours({r["label"] for r in ok})
    what = ("throughput, img/s (batch / median latency; one batch at a time; bars: 95% CI)"
            if metric == "throughput" else
            f"latency per {_per_call(ok)}, median ms (bars: 95% CI of the median)")
    fig, axes = _panels(plt, list(panels), f"{describe_run(doc)}: {what}")
    for key, records in panels.items():
        ax = axes[key]
        for label, rs in _by_rung(records):
            x = [r["batch"] for r in rs]
            med = [r["latency_ms"]["median"] for r in rs]
            ci = [(r["latency_ms"].get("ci95_low", m), r["latency_ms"].get("ci95_high", m)) for m, r in zip(med, rs)]
            if metric == "throughput":  # img/s = batch / latency: the latency's interval, inverted
                y = [r["throughput_img_s"] for r in rs]
                low = [v - r["batch"] * 1e3 / hi for v, r, (_, hi) in zip(y, rs, ci)]
                high = [r["batch"] * 1e3 / lo - v for v, r, (lo, _) in zip(y, rs, ci)]
            else:
                y = med
                low, high = [m - lo for m, (lo, _) in zip(med, ci)], [hi - m for m, (_, hi) in zip(med, ci)]
            ax.errorbar(x, y, yerr=[low, high], fmt="o-", color=colours[label], label=label, capsize=2)
        _batch_axis(ax, {r["batch"] for r in records})
        ax.set_yscale("log")
        ax.set_ylabel("img/s" if metric == "throughput" else f"ms per {_per_call(records)}")
        ax.set_title(_panel_name(key, list(panels)), fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    return save(fig, path)


def call_costs(r: dict) -> dict[str, float]:
    """Where one synchronous call's time goes, in ms, in an order that adds up to the pageable end-to-end call:
    issue on the host (the guard check, where the rung has one, is part of it), then the GPU's work left after the
    last launch, then the H2D copy of the input from pinned memory, then what pageable memory adds to that copy."""
    lat = r["latency_ms"]["median"]
    host = (r.get("host_overhead_us") or {}).get("median", 0) / 1e3 if r["device"] == "cuda" else 0.0
    guard = min(((r.get("build_stats") or {}).get("guard_check_us") or 0) / 1e3, host)
    e2e = {k: v["median"] for k, v in (r.get("e2e_ms") or {}).items() if v}
    costs = {"guard check (host)": guard, "issue on the host": max(host - guard, 0.0),
             "GPU after the last launch" if r["device"] == "cuda" else "forward (host wall clock)": max(lat - host, 0)}
    if {"device", "pinned", "pageable"} <= set(e2e):
        costs["H2D from pinned memory"] = max(e2e["pinned"] - e2e["device"], 0.0)
        costs["pageable extra over pinned"] = max(e2e["pageable"] - e2e["pinned"], 0.0)
    return costs


def overhead(doc: dict, path: Path) -> Path | None:
    """Per-call costs at the smallest batch: stacked bars per rung, one panel per task and dtype."""
    ok = [r for r in doc["results"] if ranked(r)]
    if not ok:
        return None
    panels = _at_batch(ok, min)
    plt = pyplot()
    gpu = any(r["device"] == "cuda" for r in ok)
    parts_said = "medians; e2e parts from the end-to-end pass" if gpu else "median host wall time"
    fig, axes = _panels(plt, list(panels), f"{describe_run(doc)}: where one {_per_call(ok)}'s time goes at the "
                                           f"smallest batch ({parts_said}; bars: 95% CI of the median)", width=6.4,
                        height=0.45 * max(len(v) for v in panels.values()) + 2.2)
    parts = ["guard check (host)", "issue on the host", "GPU after the last launch", "forward (host wall clock)",
             "H2D from pinned memory", "pageable extra over pinned"]
    colours = dict(zip(parts, ["#d62728", "#ff7f0e", "#1f77b4", "#1f77b4", "#2ca02c", "#98df8a"]))
    for key, records in panels.items():
        ax = axes[key]
        records = sorted(records, key=lambda r: -r["latency_ms"]["median"])  # the fastest on top
        costs = [call_costs(r) for r in records]
        left = [0.0] * len(records)
        for part in parts:
            widths = [c.get(part, 0.0) for c in costs]
            if any(widths):
                ax.barh([r["label"] for r in records], widths, left=left, color=colours[part], label=part)
                left = [a + b for a, b in zip(left, widths)]
        med = [r["latency_ms"]["median"] for r in records]
        ax.errorbar(med, [r["label"] for r in records], fmt="none", color="black", capsize=2,
                    xerr=[[m - r["latency_ms"].get("ci95_low", m) for m, r in zip(med, records)],
                          [r["latency_ms"].get("ci95_high", m) - m for m, r in zip(med, records)]])
        ax.set_xlabel("ms per call")
        ax.set_title(f"{_panel_name(key, list(panels))}, batch {records[0]['batch']}", fontsize=10)
        ax.grid(True, axis="x", alpha=0.3)
    return save(fig, path)


def first_result(doc: dict, path: Path) -> Path | None:
    """Time to the first result of each rung's first cell, split into load / build / first call: the start the
    cell measured (cold, or warm-start from kept caches) and, where the prepare stage had one, its cold start."""
    firsts = {}
    for r in doc["results"]:
        if ranked(r) and r.get("cold") and r.get("process_position", 0) == 0:
            firsts.setdefault((r["label"], r.get("task", "infer")), r)
    if not firsts:
        return None
    tasks = len({task for _, task in firsts}) > 1
    bars = []
    for (label, task), r in sorted(firsts.items(), reverse=True):
        cell = f"{task} " * tasks + f"b{r['batch']} {r['dtype']}"
        bars.append((f"{label} {r.get('start') or 'cold'} ({cell})", r["cold"]))
        prep = r.get("prepared") or {}
        if prep.get("start") == "cold":
            jobs = prep.get("concurrent_jobs", 0)
            bars.append((f"{label} cold, prepare stage ({cell}, {jobs} job{'s' if jobs != 1 else ''} beside)", prep))
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 0.4 * len(bars) + 2.2))
    ax.set_title(f"{describe_run(doc)}:\ntime to the first result in a fresh process (wall clock)", fontsize=11)
    left = [0.0] * len(bars)
    for part, colour, name in (("load_s", "#9467bd", "load weights"), ("build_s", "#ff7f0e", "build"),
                               ("first_result_s", "#1f77b4", "first call (synchronised)")):
        widths = [b[1].get(part) or 0.0 for b in bars]
        ax.barh([b[0] for b in bars], widths, left=left, color=colour, label=name)
        left = [a + w for a, w in zip(left, widths)]
    ax.set_xlabel("seconds")
    ax.tick_params(axis="y", labelsize=9)
    ax.grid(True, axis="x", alpha=0.3)
    return save(fig, path)


def memory(doc: dict, path: Path) -> Path | None:
    """Memory per rung at the largest batch: the allocator's steady-state peak and NVML's process peak (GPU), or
    the peak resident host memory (CPU); one panel per task and dtype."""
    ok = [r for r in doc["results"] if r["status"] == Status.OK and r.get("memory")]
    if not ok:
        return None
    panels = _at_batch(ok, max)
    series = (("allocator_peak_bytes", "torch allocator peak, steady state"),
              ("nvml_process_peak_bytes", "NVML process peak (CUDA context included)"),
              ("rss_peak_bytes", "host RSS peak"))
    plt = pyplot()
    at = "the largest batch" if len({r["batch"] for r in ok}) > 1 else f"batch {ok[0]['batch']}"
    fig, axes = _panels(plt, list(panels), f"{describe_run(doc)}: memory per rung at {at}", width=6.4,
                        height=0.5 * max(len(v) for v in panels.values()) + 2.2)
    for key, records in panels.items():
        ax = axes[key]
        records = sorted(records, key=lambda r: -max(v or 0 for v in r["memory"].values()
                                                     if isinstance(v, (int, float))))  # the smallest on top
        on_cpu = records[0]["device"] == "cpu"
        shown = [(k, name) for k, name in series if any(r["memory"].get(k) for r in records)
                 and (k == "rss_peak_bytes") == on_cpu]
        height = 0.8 / max(len(shown), 1)
        for i, (k, name) in enumerate(shown):
            ax.barh([j + i * height for j in range(len(records))],
                    [(r["memory"].get(k) or 0) / MIB for r in records], height=height, label=name)
        ax.set_yticks([j + height * (len(shown) - 1) / 2 for j in range(len(records))],
                      [r["label"] for r in records])
        ax.set_xlabel("MiB")
        ax.set_title(f"{_panel_name(key, list(panels))}, batch {records[0]['batch']}", fontsize=10)
        ax.grid(True, axis="x", alpha=0.3)
    return save(fig, path)


def tflops_share(doc: dict, path: Path) -> Path | None:
    """Achieved TFLOP/s as a share of the measured cuBLAS matmul rate for the dtype, against batch size."""
    ok = [r for r in doc["results"] if ranked(r)
          and (r.get("tflops") or {}).get("share_of_measured_peak") is not None]
    if not ok:
        return None
    panels = _by_panel(ok)
    colours = _colours({r["label"] for r in ok})
    peaks = ((doc.get("peak_tflops") or {}).get("measured") or {})
    plt = pyplot()
    fig, axes = _panels(plt, list(panels), f"{describe_run(doc)}: achieved TFLOP/s as a share of the measured matmul rate")
    for key, records in panels.items():
        ax = axes[key]
        for label, rs in _by_rung(records):
            ax.plot([r["batch"] for r in rs], [100 * r["tflops"]["share_of_measured_peak"] for r in rs], "o-",
                    color=colours[label], label=label)
        _batch_axis(ax, {r["batch"] for r in records})
        ax.set_ylabel("% of the measured matmul rate")
        peak = peaks.get(key[1])
        ax.set_title(_panel_name(key, list(panels)) + (f" (matmul {peak:.0f} TFLOP/s)" if peak else ""), fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    return save(fig, path)


def accuracy_curves(doc: dict, path: Path) -> Path:
    """train-to-accuracy: test accuracy after each epoch, one line per rung; below, each rung's distance from
    eager's curve in points, against the bar (doc's agreement_points) and the band of eager's own twins (the
    farthest at each epoch: what rounding alone moves the curve by), shaded."""
    plt = pyplot()
    agreement = doc.get("agreement") or {}
    fig, axes = plt.subplots(2 if agreement else 1, 1, figsize=(7, 7 if agreement else 4.2), sharex=True,
                             squeeze=False, gridspec_kw={"height_ratios": [3, 2] if agreement else [1]})
    ax = axes[0][0]
    data = doc["data"]
    device = ((doc.get("environment") or {}).get("gpu") or {}).get("name") or doc["device"]
    ax.set_title(f"{doc['model']} trained on {data['dataset']} ({data['train_images']} train / "
                 f"{data['test_images']} test images), {device}, {doc['dtype']}: test accuracy per epoch",
                 fontsize=9, wrap=True)
    colours = _colours({r["rung"] for r in doc["rungs"]})
    for i, r in enumerate(doc["rungs"]):  # line styles and marker sizes differ: identical curves stay visible
        ax.plot([c["epoch"] for c in r["curve"]], [100 * c["test_accuracy"] for c in r["curve"]],
                ("-", "--", ":", "-.")[i % 4], marker="osD^"[i % 4], markersize=8 - 2 * (i % 3),
                color=colours[r["rung"]], label=r["rung"])
    ax.set_ylabel("test accuracy, % (top-1)")
    ax.grid(True, alpha=0.3)
    if agreement:
        dist = axes[1][0]
        twins = [a["points"] for a in agreement.values() if a["twin"]]
        if twins:
            band = [max(epoch) for epoch in zip(*twins)]
            dist.fill_between(range(1, len(band) + 1), 0, band, color="grey", alpha=0.25,
                              label="eager's twins (rounding alone)")
        for i, r in enumerate(doc["rungs"]):
            a = agreement.get(r["rung"])
            if a and not a["twin"]:
                dist.plot(range(1, len(a["points"]) + 1), a["points"], ("-", "--", ":", "-.")[i % 4],
                          marker="osD^"[i % 4], markersize=5, color=colours[r["rung"]], label=r["rung"])
        bar = doc["agreement_points"]
        dist.axhline(bar, color="black", linewidth=0.8, linestyle="--", label=f"{bar} points")
        dist.set_ylabel("points from eager")
        dist.set_yscale("symlog", linthresh=2)  # the 1.5-point line and a 20-point early gap both readable
        dist.set_ylim(bottom=0)
        dist.grid(True, alpha=0.3)
    axes[-1][0].set_xlabel("epoch")
    return save(fig, path)


PLOTS = {  # file stem: (caption, drawer)
    "throughput": ("Throughput against batch size", lambda d, p: against_batch(d, p, "throughput")),
    "latency": ("Latency against batch size", lambda d, p: against_batch(d, p, "latency")),
    "overhead": ("Where one call's time goes at the smallest batch", overhead),
    "first_result": ("Time to the first result", first_result),
    "memory": ("Memory per rung", memory),
    "tflops": ("Achieved TFLOP/s as a share of the matmul rate", tflops_share),
}


def write_plots(doc: dict, directory: Path) -> list[tuple[str, Path]]:
    """Every plot the document has data for, as PNG files in `directory`: [(caption, path)]."""
    directory.mkdir(parents=True, exist_ok=True)
    # a cell timed beside other load is its own series, named so in every legend and axis
    doc = {**doc, "results": [{**r, "label": r["label"] + CONTENDED_MARK} if contended(r) else r
                              for r in doc["results"]]}
    written = []
    for stem, (caption, draw) in PLOTS.items():
        try:
            path = draw(doc, directory / f"{stem}.png")
        except Exception as e:  # a plot must never cost the run its report
            print(f"plot {stem}: not drawn: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        if path:
            written.append((caption, path))
    return written
