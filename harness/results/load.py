"""Records from results files: results.jsonl (with its run.json) or earlier ladder.json documents, merged."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from core.cell import Cell
from harness.run.rundir import read_jsonl
from tiers import identity

class BadInput(Exception):
    """A report input that is not ladder results (one line says which and why)."""


def load_records(paths: list[Path]) -> tuple[list[dict], dict]:
    """Records from results.jsonl files (with their run.json) or earlier JSON documents; later files win on the
    same cell (`Cell.identity`). Each record gets `run`, an index into meta['runs'] (source and environment of its
    run), so a report merged from several machines says which machine measured what. Raises BadInput."""
    by_key: dict[str, dict] = {}
    meta: dict[str, Any] = {"runs": []}
    for p in paths:
        if p.is_dir():
            raise BadInput(f"{p}: is a directory; give its results.jsonl or ladder.json")
        if not p.is_file():
            raise BadInput(f"{p}: no such file")
        if p.stat().st_size == 0:
            raise BadInput(f"{p}: empty file")
        if p.suffix == ".jsonl":
            recs = read_jsonl(p)
            run_json = p.with_name("run.json")
            run_meta = json.loads(run_json.read_text()) if run_json.exists() else {}
        else:
            try:
                d = json.loads(p.read_text(errors="replace"))
            except json.JSONDecodeError as e:
                raise BadInput(f"{p}: not JSON ({e.msg} at line {e.lineno})") from None
            if not isinstance(d, dict) or not isinstance(d.get("results"), list):
                raise BadInput(f"{p}: not a ladder JSON document (no 'results' list); give a ladder.json or a "
                               "results.jsonl")
            recs = d["results"]
            run_meta = {k: v for k, v in d.items()
                        if k not in ("results", "definitions", "schema_version", "generated")}
        bad = [i for i, r in enumerate(recs) if not isinstance(r, dict) or not {"tier", "status", "batch"} <= set(r)]
        if bad:
            raise BadInput(f"{p}: record {bad[0]} is not a ladder record")
        meta.update({k: v for k, v in run_meta.items() if k != "runs"})
        run = len(meta["runs"])
        meta["runs"].append({"source": str(p), "environment": run_meta.get("environment"),
                             "peak_tflops": run_meta.get("peak_tflops")})
        for r in recs:
            by_key[identity(Cell.of_record(r))] = {**r, "run": run}
    return list(by_key.values()), meta
