"""`python -m harness micro`: where each rung's time goes.
- `--tier NAME` (here): a hand-written rung's per-layer microbenchmark against cuDNN and Inductor, layer by layer;
- `--tiers A,B,...`: each rung's kernel census side by side (harness/census_report.py);
- `--layers --tiers A,B,...`: each layer alone on each rung (harness/layers_report.py).
Its tables, and the side-by-sides the other two share: harness/results/micro_tables.py."""
from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from core.cell import Cell
from core.env import default_device, environment
from core.files import write_text_atomic
from harness.results.micro_tables import markdown, micro_table, pass_totals_table
from harness.run.refusal import Refusal
from tiers import get_tier


def run(tier_name: str, batch: int, res: int, dtype: str, channels_last: bool, task: str, json_path: Path | None,
        md_path: Path | None) -> None:
    tier = get_tier(tier_name)
    if dtype not in tier.dtypes:
        raise Refusal(f"{tier_name}'s per-layer microbenchmark times {', '.join(tier.dtypes)} kernels, not {dtype}")
    if task == "train" and tier.cannot_train:
        raise Refusal(f"{tier_name} does not train: {tier.cannot_train}")
    if task == "train" and not tier.has_micro_train:
        raise Refusal(f"{tier_name}'s microbenchmark times its inference layers only (--task infer)")
    if task == "train" and (reason := tier.supports(Cell(tier=tier_name, batch=batch, res=res, dtype=dtype,
                                                         channels_last=channels_last, device="cuda", task=task))):
        raise Refusal(f"{tier_name}'s training step: {reason}")
    if default_device() != "cuda":
        raise Refusal(f"{tier_name}'s microbenchmark times GPU kernels; no NVIDIA GPU here (NVML found none)")
    reason = tier.availability("cuda")
    if reason:
        raise Refusal(f"{tier_name} cannot run on this GPU: {reason}")
    rows = tier.micro(batch, res, dtype, channels_last, task)
    what = "per-layer" if task == "infer" else "training step, per layer and pass,"
    title = f"{tier_name}: {what} microbenchmark, batch {batch}, res {res}, {dtype}"
    console = Console()
    console.print(micro_table(title, rows))
    if totals := pass_totals_table(rows):
        console.print(totals)
    if json_path:
        write_text_atomic(json_path, json.dumps({"environment": environment("cuda"), "tier": tier_name, "task": task,
                                                 "batch": batch, "res": res, "dtype": dtype, "rows": rows}, indent=1))
    if md_path:
        write_text_atomic(md_path, markdown(title, rows))
