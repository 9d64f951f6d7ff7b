"""`python -m harness tiers`: every rung, available here or the exact reason it is not."""
from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from core.env import default_device
from tiers import all_tiers


def show() -> int:
    """A table of rung, cuda, cpu that fits 80 columns, then one line per rung: what it is, and why not where it
    cannot run (a reason every rung shares, such as no GPU, is said once)."""
    gpu = default_device() == "cuda"
    console = Console()
    table = Table(title="Rungs of the ladder", box=box.SIMPLE_HEAD, pad_edge=False)
    for c in ("rung", "cuda", "cpu", "what"):
        table.add_column(c, no_wrap=c != "what")
    reasons = []
    for name, tier in all_tiers().items():
        cells = []
        for device in ("cuda", "cpu"):
            reason = tier.availability(device)
            if device == "cuda" and not gpu:  # the rung's own reason too: what else a GPU machine would need
                reason = "; ".join(filter(None, ["no NVIDIA GPU here (NVML found none)", reason]))
            cells.append(Text("yes", style="green") if reason is None else Text("no", style="red"))
            if reason:
                reasons.append((name, device, reason))
        table.add_row(name, *cells, Text(tier.summary))
    console.print(table)
    console.print("Why not:", markup=False)
    for name, device, reason in reasons:
        console.print(f"  {name} on {device}: {reason}", markup=False)
    return 0
