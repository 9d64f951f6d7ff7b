"""The census pass of a Python rung's child (docs/protocol.md): a few warm calls under torch.profiler (Kineto; CUPTI
on the GPU), each inside a CENSUS_STEP range and synchronised, written as a Chrome trace that harness/run/census.py
reads. It runs after every timed phase, so the profiler's cost lands in no timed figure."""
from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path
from typing import Any, Callable

from torch.profiler import ProfilerActivity, profile, record_function

from core.cell import Built
from core.files import write_text_atomic
from harness.child.contract import CENSUS_STEP



def record(built: Built, example: Any, sync: Callable[[], None], steps: int, path: Path, gpu: bool,
           scoped: bool = True) -> dict[str, Any]:
    """`steps` calls of the rung's forward profiled into the Chrome trace at `path`. Its layers are named by the
    rung's own ranges (Built.layer_scopes; not `scoped`: a CUDA graph replays without them), TorchScript's module
    hierarchy (with_modules), or the ranges of the rung's own profiler (Built.profiled), merged in."""
    named = scoped and built.layer_scopes is not None
    forward, finish = built.profiled() if built.profiled else (built.forward, None)
    scopes = built.layer_scopes() if named else contextlib.nullcontext()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # with_modules: deprecated with TorchScript, which it serves
        with scopes:
            forward(example)  # the hooks' first call outside the trace
            sync()
            with profile(activities=activities, record_shapes=True, with_modules=True) as prof:
                for _ in range(steps):
                    with record_function(CENSUS_STEP):
                        forward(example)
                        sync()
    prof.export_chrome_trace(str(path))
    source = "torch.profiler (Kineto" + (", CUPTI)" if gpu else ", CPU operators)")
    if finish is not None:
        trace = json.loads(path.read_text())
        ranges = finish()
        if "baseTimeNanoseconds" in trace:  # the trace's ts are µs after this instant
            base_us = trace["baseTimeNanoseconds"] / 1e3
            trace["traceEvents"] += [{**e, "ts": e["ts"] - base_us} for e in ranges]
            write_text_atomic(path, json.dumps(trace))
            source += " with the rung's own profiler"
        else:
            source += "; the rung's own profiler's ranges left out: the trace gives no base time to align them"
    return {"steps": steps, "source": source, "module_scopes": named}
