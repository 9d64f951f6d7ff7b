"""What the reports derive from records, before any rendering: each cell's eager baseline and speed-up (and whether
it divides two runs' host draws or two GPUs), and the fastest cell per configuration (harness/results/columns.py turns
them into the tables' and the CSV's columns)."""
from __future__ import annotations

from core.cell import layout_name
from harness.run.record import CONTENDED_MARK, SLOW_CLOCK_SHARE, bound, contended, ranked
from harness.run.status import Status
from tiers import all_tiers

BASELINE_DTYPE = {"fp8": "bf16"}  # eager has no fp8: an fp8 cell's speed-up is over eager in its activations' type


def eager_baseline(records: list[dict], r: dict) -> dict | None:
    dtype = BASELINE_DTYPE.get(r["dtype"], r["dtype"])
    for e in records:
        if (e["tier"] == "eager" and not e["cuda_graph"] and e["status"] == Status.OK
                and e.get("task", "infer") == r.get("task", "infer") and e["dtype"] == dtype
                and all(e[k] == r[k] for k in ("model", "batch", "res", "channels_last", "device"))):
            return e
    return None


def hand_written(r: dict) -> bool:
    tier = all_tiers().get(r["tier"])
    return bool(tier and tier.hand_written)


def best_framework(records: list[dict], r: dict) -> dict | None:
    """The fastest cell of a framework rung (not hand_written) at r's task, model, batch, res, device and dtype (fp8:
    its activations' type), in any layout, mode or option: the best a user of a framework would run."""
    dtype = BASELINE_DTYPE.get(r["dtype"], r["dtype"])
    same = [e for e in records if ranked(e) and not hand_written(e) and e["dtype"] == dtype
            and e.get("task", "infer") == r.get("task", "infer")
            and all(e[k] == r[k] for k in ("model", "batch", "res", "device"))]
    return min(same, key=lambda e: e["latency_ms"]["median"], default=None)


def speedup(base: dict | None, r: dict) -> float | None:
    """r's speed-up over `base`: its eager baseline (eager_baseline) or the best framework cell."""
    if base is None or not ranked(r):
        return None
    return base["latency_ms"]["median"] / r["latency_ms"]["median"]


def speedups(records: list[dict], r: dict) -> dict:
    """r's speed-ups as the JSON document states them: over its eager baseline and over the best framework cell,
    each with the cell it divides."""
    base, framework = eager_baseline(records, r), best_framework(records, r)
    return {"vs_eager": speedup(base, r), "eager": base and base["key"],
            "vs_best_framework": speedup(framework, r), "best_framework": framework and framework["key"]}


SLOW_MARK = "*"  # an SM clock below SLOW_CLOCK_SHARE of its maximum while timed (harness/run/record.py)


def clock_lines(records: list[dict]) -> list[str]:
    """What held the clocks while cells were timed: the cells whose SM clock sat below SLOW_CLOCK_SHARE of its
    maximum and the reason NVML gave most, and the cells whose energy was withheld and why."""
    ok = [r for r in records if r["status"] == Status.OK]
    slow = [r for r in ok if (r.get("clocks") or {}).get("slow")]
    out = []
    if slow:
        top = (slow[0]["clocks"] or {}).get("sm_clock_max_mhz")
        out.append(f"{SLOW_MARK} {len(slow)} of {len(ok)} cells ran with the SM clock below "
                   f"{SLOW_CLOCK_SHARE:.0%} of its {top:.0f} MHz maximum while timed (median MHz, what held it): "
                   + "; ".join(f"{r['label']} b{r['batch']} {r['dtype']} {r['clocks']['sm_clock_mhz_median']:.0f}"
                               f" ({r['clocks'].get('held_by_most') or 'no reason given'})" for r in slow) + ".")
    withheld = [(r, w) for r in ok for w in ((r.get("utilisation") or {}).get("energy_withheld"),
                                             (r.get("sustained") or {}).get("energy_withheld")) if w]
    if withheld:
        out.append("img/J withheld: " + "; ".join(f"{r['label']} b{r['batch']} {r['dtype']}: {w}"
                                                   for r, w in withheld) + ".")
    return out


MIXED_DTYPE = "§"  # marks a speed-up over a cell of another dtype (BASELINE_DTYPE: fp8 over bf16)


def mixed(r: dict) -> str:
    return MIXED_DTYPE if r["dtype"] in BASELINE_DTYPE else ""


CROSS_RUN = "†"  # marks a speed-up whose two figures are two draws of the host's speed (mixes_host_draws)


def mixes_host_draws(base: dict | None, r: dict) -> bool:
    """Whether r's speed-up over eager divides figures of two runs (a merged report) of which one is host-bound:
    each then measured its own run's host, so the ratio moves with both hosts, not with the rungs alone."""
    return base is not None and base.get("run") != r.get("run") and "host" in (bound(base), bound(r))


CROSS_GPU = "‡"  # marks a speed-up whose two figures come from two GPUs that differ (mixes_gpus)
PEAK_SPREAD = 0.03  # matmul rates further apart than this make two GPUs of one model different machines


def mixes_gpus(base: dict | None, r: dict) -> bool:
    """Whether r's speed-up over eager divides figures of two GPUs of different models, or of one model whose
    measured matmul rates in the cell's dtype differ by more than PEAK_SPREAD."""
    a, b = ((x or {}).get("where", {}).get("gpu") for x in (base, r))
    if not a or not b or a["uuid"] == b["uuid"]:
        return False
    if a["name"] != b["name"]:
        return True
    pa, pb = ((g.get("matmul_tflops") or {}).get(r["dtype"]) for g in (a, b))
    return bool(pa and pb) and abs(pa / pb - 1) > PEAK_SPREAD


def fmt(v: float | None, spec: str) -> str:
    return "" if v is None else format(v, spec)


def fastest_lines(records: list[dict]) -> list[str]:
    """One line per (batch, dtype, layout, res): the fastest rung, its lead over eager and, for a hand-written rung,
    over the best framework cell."""
    ok = [r for r in records if ranked(r)]
    out = []
    def config(r: dict) -> tuple:
        return r.get("task", "infer"), r["batch"], r["dtype"], r["channels_last"], r["res"]

    for key in sorted({config(r) for r in ok}):
        best = min((r for r in ok if config(r) == key), key=lambda r: r["latency_ms"]["median"])
        lead = speedup(eager_baseline(records, best), best)
        framework = best_framework(records, best) if hand_written(best) else None
        over = (f", {speedup(framework, best):.2f}x{mixed(best)} the best framework cell ({framework['label']} "
                f"{framework['dtype']} {layout_name(framework['channels_last'])}, "
                f"{framework['latency_ms']['median']:.2f} ms)" if framework else "")
        out.append(f"{'training, ' if key[0] == 'train' else ''}batch {key[1]} {key[2]} "
                   f"{layout_name(key[3])} res {key[4]}: fastest {best['label']} "
                   f"{best['latency_ms']['median']:.2f} ms" + (f", {lead:.2f}x{mixed(best)} eager" if lead else "")
                   + over
                   + (f"{CONTENDED_MARK}: measured beside other load" if contended(best) else ""))
    return out
