"""Rows of dicts as tables: their columns, markdown lines, and the rows without columns empty in every row."""
from __future__ import annotations

from typing import Any

def columns(table: list[dict[str, Any]]) -> list[str]:
    """Every key of the rows, in the order of first appearance (a row may lack some)."""
    return list(dict.fromkeys(k for row in table for k in row))


def markdown_table(table: list[dict[str, Any]]) -> list[str]:
    """Rows of dicts as markdown lines (a key a row lacks: empty); floats with three decimals."""
    if not table:
        return []
    cols = columns(table)

    def cell(v: Any) -> str:
        return (f"{v:.3f}" if isinstance(v, float) else str(v)).replace("|", "/")

    return (["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            + ["| " + " | ".join(cell(row.get(c, "")) for c in cols) + " |" for row in table])


def drop_empty_columns(table: list[dict[str, str]]) -> list[dict[str, str]]:
    """The rows without the columns that are empty in every row (a CPU run's GPU columns, say)."""
    keep = [c for c in columns(table) if any(row.get(c) for row in table)]
    return [{c: row.get(c, "") for c in keep} for row in table]
