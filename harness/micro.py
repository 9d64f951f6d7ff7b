"""`python -m harness micro`: a hand-written rung's per-layer microbenchmark, as a terminal table of its timings and,
with every column, as JSON and markdown."""
from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from core.env import default_device, environment
from core.files import write_text_atomic
from harness.refusal import Refusal
from harness.report import columns, markdown_table
from tiers import get_tier


def run(tier_name: str, batch: int, res: int, dtype: str, channels_last: bool, task: str, json_path: Path | None,
        md_path: Path | None) -> None:
    tier = get_tier(tier_name)
    if task == "train" and tier.cannot_train:
        raise Refusal(f"{tier_name} does not train: {tier.cannot_train}")
    if default_device() != "cuda":
        raise Refusal(f"{tier_name}'s microbenchmark times GPU kernels; no NVIDIA GPU here (NVML found none)")
    reason = tier.availability("cuda")
    if reason:
        raise Refusal(f"{tier_name} cannot run on this GPU: {reason}")
    rows = tier.micro(batch, res, dtype, channels_last, task)
    what = "per-layer" if task == "infer" else "training step, per layer and pass,"
    title = f"{tier_name}: {what} microbenchmark, batch {batch}, res {res}, {dtype}"
    shown = shown_columns(rows)
    table = Table(title=title, caption="every column: --json")
    for c in shown:
        table.add_column(c, overflow="fold")
    for r in rows:
        table.add_row(*[f"{r[c]:.3f}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in shown])
    Console().print(table)
    if json_path:
        write_text_atomic(json_path, json.dumps({"environment": environment("cuda"), "tier": tier_name, "task": task,
                                                 "batch": batch, "res": res, "dtype": dtype, "rows": rows}, indent=1))
    if md_path:
        write_text_atomic(md_path, markdown(title, rows))


def shown_columns(rows: list[dict]) -> list[str]:
    """What the terminal and the markdown show, which reads at 100 columns: each layer's name (and pass), its engine
    and its timings. The JSON keeps every column."""
    cols = columns(rows)
    return cols[:1] + [c for c in cols if c in ("pass", "engine", "fused") or c.endswith(("_ms", "tflops"))]


def markdown(title: str, rows: list[dict]) -> str:
    shown = shown_columns(rows)
    return "\n".join([f"# {title}", "", *markdown_table([{c: r.get(c, "") for c in shown} for r in rows]), "",
                      f"Every column ({', '.join(columns(rows))}): the JSON (--json).", ""])
