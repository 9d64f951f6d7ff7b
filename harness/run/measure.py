"""The cells of a ladder, rung by rung: each screened (unavailable, skipped, no reference), then measured in one
child process per rung (`--isolation rung`) or per cell (`--isolation cell`); after a crash or timeout the
remaining cells go on in a new process."""
from __future__ import annotations

from typing import Callable, Iterable

from core.cell import Cell
from harness.run.context import Context
from harness.run.record import base_record, recipe_references
from harness.run.rundir import ReferenceFailed
from harness.run.status import Status
from harness.run.watch import ChildRun
from tiers import all_tiers


def ordered(cells: Iterable[Cell]) -> dict[str, list[Cell]]:
    """The cells by rung, in the order given."""
    groups: dict[str, list[Cell]] = {}
    for c in cells:
        groups.setdefault(c.tier, []).append(c)
    return groups


def screen(ctx: Context, cell: Cell) -> dict | None:
    """The record of a cell that needs no process (unavailable, skipped, reference failed), else None."""
    tier = all_tiers()[cell.tier]
    record = base_record(cell)
    reason = tier.availability(cell.device)
    if reason:
        return {**record, "status": Status.UNAVAILABLE, "reason": reason}
    reason = tier.supports(cell)
    if reason:
        return {**record, "status": Status.SKIPPED, "reason": reason}
    try:
        ctx.run.reference(cell.batch, cell.res, cell.task)
        for key in recipe_references(cell).values():
            ctx.run.reference(cell.batch, cell.res, recipe=key)
    except ReferenceFailed as e:
        return {**record, "status": e.status, "reason": e.reason}
    return None


def measure_cells(ctx: Context, cells: list[Cell], on_record: Callable[[dict], None]) -> None:
    """Measures `cells` (of one rung); calls `on_record` as each cell ends; raises KeyboardInterrupt after
    recording the cell in flight."""
    pending = []
    for cell in cells:
        rec = screen(ctx, cell)
        if rec is not None:
            on_record(rec)
        else:
            pending.append(cell)
    shared = ctx.isolation == "rung"
    while pending:
        done = ChildRun(ctx, pending if shared else pending[:1], on_record).run()
        pending = pending[done:]
