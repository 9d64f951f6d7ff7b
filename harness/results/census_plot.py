"""The census's plot (`micro --tiers`): each rung's kernel time by layer group, side by side."""
from __future__ import annotations

import textwrap
from pathlib import Path

from harness.results.plots import describe_run, pyplot, save
from harness.run.census import comparable


def census_groups(doc: dict, path: Path) -> Path | None:
    """`micro --tiers`: one stacked bar per rung, its kernels' time per call by layer group, with the call's measured
    latency beside it (what the kernels leave unexplained is the host's); the same bars as shares of each rung's
    kernel time, where rungs of very different speed still compare; and, rung by rung in the order given, the time
    each group gains over the rung before it (eager -> compile -> cudnn: where compile gains over eager, and cudnn
    over compile)."""
    rungs = doc["census"]
    if not rungs:
        return None
    plt = pyplot()
    groups = list(dict.fromkeys(g["group"] for r in rungs for g in r["groups"]))
    cmap = plt.get_cmap("tab10" if len(groups) <= 10 else "tab20")
    fig, (ms_ax, share_ax, gain_ax) = plt.subplots(1, 3, figsize=(max(13.0, 3.2 * len(rungs) + 4), 4.8))
    call = "step" if doc["task"] == "train" else "forward"
    named: set[str] = set()  # each group once in the legend
    for x, r in enumerate(rungs):
        bottom = share = 0.0
        for g in r["groups"]:
            colour = cmap(groups.index(g["group"]) % cmap.N)
            ms_ax.bar(x, g["ms"], bottom=bottom, width=0.6, color=colour,
                      label=None if g["group"] in named else g["group"])
            part = 100 * g["ms"] / r["kernel_ms"] if r["kernel_ms"] else 0.0
            share_ax.bar(x, part, bottom=share, width=0.6, color=colour)
            named.add(g["group"])
            bottom += g["ms"]
            share += part
        if r.get("measured_ms"):
            ms_ax.plot([x - 0.4, x + 0.4], [r["measured_ms"]] * 2, "k--", lw=1.2,
                       label=f"measured latency per {call} (median)" if x == 0 else None)
    for ax in (ms_ax, share_ax):
        ax.set_xticks(range(len(rungs)), [r["label"] for r in rungs], rotation=20 if len(rungs) > 3 else 0)
        ax.grid(True, axis="y", alpha=0.3)
    width = 0.8 / max(len(groups), 1)
    for x, (before, after) in enumerate(zip(rungs, rungs[1:])):
        if not (comparable(before) and comparable(after)):  # a group holding part of a rung's time gains nothing
            gain_ax.text(x, 0, "not compared:\npart of a rung's\ntime in no layer", ha="center", va="bottom",
                         fontsize=7)
            continue
        was = {g["group"]: g["ms"] for g in before["groups"]}
        now = {g["group"]: g["ms"] for g in after["groups"]}
        for k, group in enumerate(groups):
            if group in was and group in now:
                gain_ax.bar(x - 0.4 + (k + 0.5) * width, was[group] - now[group], width,
                            color=cmap(k % cmap.N))
    gain_ax.axhline(0, color="black", lw=0.8)
    gain_ax.set_xticks(range(len(rungs) - 1), [f"{a['label']}\n-> {b['label']}" for a, b in zip(rungs, rungs[1:])],
                       fontsize=8)
    gain_ax.set_ylabel("ms gained per group (below 0: lost)")
    gain_ax.set_title("each rung against the one before it", fontsize=10)
    gain_ax.grid(True, axis="y", alpha=0.3)
    unit = "kernels" if rungs[0]["unit"].startswith("GPU") else "CPU operators"
    ms_ax.set_ylabel(f"ms per {call}: {unit}' time by layer group")
    ms_ax.set_title("time", fontsize=10)
    share_ax.set_ylabel(f"% of the rung's {unit}' time")
    share_ax.set_title("share", fontsize=10)
    fig.suptitle(textwrap.fill(f"{describe_run(doc)}, batch {doc['batch']}, {doc['dtype']}: where each rung's time goes",
                               90), fontsize=10)
    return save(fig, path)
