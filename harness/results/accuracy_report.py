"""train-to-accuracy's results (harness/accuracy.py runs it): each rung's agreement with eager's curve, read against
the band of eager's twins, and accuracy.json, accuracy.md and the plot, with the --infer section."""
from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from core.files import write_text_atomic
from harness.results.plots import accuracy_curves
from harness.results.tables import markdown_table

AGREEMENT_POINTS = 1.5  # issue 28: a rung's curve within this many points of eager's at every epoch
TWIN = "eager"  # the rung trained again as its twins (harness/accuracy.py `twins`)


def plural(n: float, word: str) -> str:
    return f"{n:.3g} {word}{'' if n == 1 else 's'}"


def agreement(results: list[dict], reference: str) -> dict:
    """Per rung, its distance from `reference`'s curve in points at each epoch, the epochs beyond
    AGREEMENT_POINTS, and of those the ones beyond the band at that epoch: the farthest distance of the
    reference's twins (what rounding alone moved the curve by there); {} without the reference's curve."""
    ref = next((r for r in results if r["rung"] == reference), None)
    if ref is None:
        return {}
    twins = [r for r in results if r["tier"] == reference and r is not ref]

    def distance(r: dict) -> list[float]:
        return [round(100 * abs(a["test_accuracy"] - b["test_accuracy"]), 2) for a, b in zip(r["curve"], ref["curve"])]

    band = [max(epoch) for epoch in zip(*map(distance, twins))] if twins else None
    out = {}
    for r in results:
        if r is ref:
            continue
        points = distance(r)
        beyond = [e for e, d in enumerate(points, start=1) if d > AGREEMENT_POINTS]
        out[r["rung"]] = {
            "twin": r in twins, "points": points, "max_points": max(points, default=0.0), "epochs": len(points),
            "epochs_beyond": beyond,
            "epochs_beyond_twin": None if band is None or r in twins else
            [e for e in beyond if points[e - 1] > band[e - 1]],
        }
    return out


def agreement_columns(a: dict | None) -> dict[str, str]:
    """The summary table's columns for one rung's agreement with eager (empty for eager itself)."""
    if a is None:
        return {"max pts": "", f"> {AGREEMENT_POINTS} pts": "", "> twin": ""}

    def epochs(es: list[int] | None) -> str:  # how many, and the first six of them
        if not es:
            return "-" if es is None else "0"
        return f"{len(es)} ({', '.join(map(str, es[:6]))}{', ...' if len(es) > 6 else ''})"

    return {"max pts": f"{a['max_points']:.1f}", f"> {AGREEMENT_POINTS} pts": epochs(a["epochs_beyond"]),
            "> twin": epochs(a["epochs_beyond_twin"])}


def inference_lines(inference: dict | None) -> list[str]:
    """accuracy.md's --infer section: each inference cell's top-1 on the test set and its agreement with the
    reference's."""
    if not inference:
        return []
    if "skipped_all" in inference:
        return ["", f"--infer: nothing evaluated: {inference['skipped_all']}"]
    table = [{"rung": c["rung"], "dtype": c["dtype"], "test top-1 %": f"{100 * c['test_accuracy']:.1f}",
              f"top-1 as {inference['reference']} %": "" if c["agreement"] is None else f"{100 * c['agreement']:.1f}",
              "build s": f"{c['build_s']:.1f}"} for c in inference["cells"]]
    return ["", f"## The trained network in inference ({inference['network']} weights)", "",
            f"Every test image through each inference cell at batch {inference['batch']} (fp8 calibrated on "
            f"{inference['calibration']}; untuned where no tuning table has a shape): top-1 accuracy, and the share "
            f"of images whose top-1 is {inference['reference']}'s.", "", *markdown_table(table), "",
            *(f"- {name}: skipped: {reason}" for name, reason in inference["skipped"].items()),
            *(f"- {name}: failed: {reason}" for name, reason in inference["failed"].items())]


def write(doc: dict, out: Path, console: Console) -> None:
    """accuracy.json, accuracy.md (test accuracy per epoch, a row per epoch and a column per rung, then each rung's
    agreement with eager) and the plot; one line per rung."""
    results, data = doc["rungs"], doc["data"]
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "accuracy.json", json.dumps(doc, indent=1))
    plot = accuracy_curves(doc, out / "plots" / "accuracy.png") if results else None
    table = [{"epoch": str(e + 1), **{r["rung"]: f"{100 * r['curve'][e]['test_accuracy']:.1f}"
                                      for r in results if e < len(r["curve"])}}
             for e in range(max((len(r["curve"]) for r in results), default=0))]
    lines = [f"# Train to accuracy: {doc['model']} on {data['dataset']}", "",
             f"{data['train_images']} training and {data['test_images']} test images, {data['classes']} classes; "
             f"{doc['epochs']} epochs at batch {doc['batch']}, res {doc['res']}, {doc['dtype']}, on {doc['device']}, "
             f"seed {doc['seed']}. Recipe: {doc['recipe']}. Test accuracy (top-1, %) after each epoch:", "",
             *markdown_table(table), ""]
    summary = [{"rung": r["rung"], "final %": f"{100 * r['final_test_accuracy']:.1f}",
                **agreement_columns(doc["agreement"].get(r["rung"])),
                "train s": f"{sum(c['epoch_s'] for c in r['curve']):.1f}", "build s": f"{r['build_s']:.1f}"}
               for r in results]
    if summary:
        lines += [f"Each rung against {TWIN}: the largest distance in points, the epochs farther than "
                  f"{AGREEMENT_POINTS} points, and of those the ones farther than the farthest of {TWIN}'s twins was "
                  f"at that epoch (the same step rounded differently: {TWIN} in the other layout, and on the GPU "
                  f"with cuDNN's benchmark mode off; '-': no twin).", "",
                  *markdown_table(summary), ""]
    lines += [f"- {name}: skipped: {reason}" for name, reason in doc["skipped"].items()]
    lines += [f"- {name}: failed: {reason}" for name, reason in doc.get("failed", {}).items()]
    lines += inference_lines(doc.get("inference"))
    if plot:
        lines += ["", "![test accuracy per epoch](plots/accuracy.png)", ""]
    write_text_atomic(out / "accuracy.md", "\n".join(lines))
    for r in results:
        console.print(f"{r['rung']}: {100 * r['final_test_accuracy']:.1f}% test accuracy after "
                      f"{plural(doc['epochs'], 'epoch')}", markup=False)
    console.print(f"JSON: {out / 'accuracy.json'}  markdown: {out / 'accuracy.md'}", markup=False)
