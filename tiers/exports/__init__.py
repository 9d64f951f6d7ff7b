"""Exports that several rungs share (ONNX, TorchScript, AOTInductor), and the process an export for a C++ rung runs
in: the parent calls `run_export` (it must keep no CUDA context while a child is measured), the export's module
reads `command_line` and prints its facts as JSON on its last line."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from core import proc as procs
from core.cell import Cell
from core.model import load_model
from core.paths import REPO


def run_export(module: str, what: str, args: list[str]) -> dict[str, Any]:
    """Runs `python -m module args` in a process of its own; returns the JSON facts of its last line."""
    proc = procs.run([sys.executable, "-m", module, *args], cwd=REPO, env=procs.child_env(), capture_output=True,
                     text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed: " + " | ".join(proc.stderr.strip().splitlines()[-3:]))
    return json.loads(proc.stdout.strip().splitlines()[-1])


def command_line(description: str, target: str) -> tuple[Cell, Any, Path]:
    """An export process's arguments `--cell JSON --weights W --TARGET PATH`: the cell, the model with the run's
    weights (fp32, on the CPU) and the target path."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--cell", required=True, help="the cell as JSON (Cell.to_dict)")
    p.add_argument("--weights", type=Path, required=True)
    p.add_argument(f"--{target}", type=Path, required=True)
    a = p.parse_args()
    cell = Cell.from_dict(json.loads(a.cell))
    return cell, load_model(cell.model, a.weights), getattr(a, target)
