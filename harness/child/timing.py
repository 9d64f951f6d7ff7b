"""The timing primitives every timed call of the ladder shares: the child process of a Python rung
(harness/child/worker.py), layerbench's per-layer timings and bench/'s independent loops. A call's device input, its
stream and its clock; one timed call; the warm-up and latency passes that decide how many calls a figure rests on."""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

from core.cell import Built, Cell
from core.placement import memory_format, torch_dtype
from core.stats import median, median_ci_rel


def prepare_input(x: torch.Tensor, cell: Cell) -> torch.Tensor:
    """The cell's device input: its dtype and layout (training keeps fp32 input: bf16 and fp16 mean autocast)."""
    x = x.to(cell.device, torch.float32 if cell.task == "train" else torch_dtype(cell.dtype))
    return x.contiguous(memory_format=memory_format(cell.channels_last))


def stream_of(built: Built, cell: Cell) -> Any:
    return (built.stream or torch.cuda.current_stream()) if cell.device == "cuda" else None


def sync_of(built: Built, cell: Cell) -> Callable[[], None]:
    stream = stream_of(built, cell)
    return stream.synchronize if stream is not None else (lambda: None)


def warmup_pass(timed_call: Callable[..., float], kv: dict[str, str]) -> dict[str, Any]:
    """Calls until the medians of the two halves agree within 2% (and at least --warmup-min calls), or until
    --warmup-s / --warmup-max."""
    warm: list[float] = []
    t = time.perf_counter()
    wmin, wmax, ws = int(kv["warmup-min"]), int(kv["warmup-max"]), float(kv["warmup-s"])
    while len(warm) < wmax and (time.perf_counter() - t < ws or len(warm) < wmin):
        warm.append(timed_call())
        if len(warm) >= max(wmin, 6):  # the medians of two halves of 3 or more
            half = len(warm) // 2
            last, prev = median(warm[half:]), median(warm[:half])
            if abs(last - prev) <= 0.02 * prev:
                return {"iters": len(warm), "stable": True}
    return {"iters": len(warm), "stable": False}


class Clock:
    """Times a region on the rung's stream: CUDA events on the GPU, perf_counter on the CPU."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        if stream is not None:
            self.a = torch.cuda.Event(enable_timing=True)
            self.b = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self.stream is None:
            self.t0 = time.perf_counter()
        else:
            self.a.record(self.stream)

    def stop(self) -> None:
        if self.stream is None:
            self.t1 = time.perf_counter()
        else:
            self.b.record(self.stream)

    def elapsed_ms(self) -> float:
        if self.stream is None:
            return (self.t1 - self.t0) * 1e3
        self.b.synchronize()
        return self.a.elapsed_time(self.b)


def timed_forward(forward: Callable[[Any], Any], example: Any, clock: Clock) -> Callable[..., float]:
    """One call of the latency pass: the forward between the clock's marks on the rung's stream; with a list, the
    calling thread's CPU time inside forward() (issue only, the sync excluded) is appended to it in µs."""
    def timed_call(host_us: list[float] | None = None) -> float:
        clock.start()
        c0 = time.thread_time_ns()
        forward(example)
        c1 = time.thread_time_ns()
        clock.stop()
        if host_us is not None:
            host_us.append((c1 - c0) / 1e3)
        return clock.elapsed_ms()

    return timed_call


def latency_pass(timed_call: Callable[..., float], iters: int, min_time_s: float, max_time_s: float,
                 max_iters: int, precision: float) -> tuple[list[float], list[float], str]:
    """Calls until the median is known well enough: at least `iters` calls and `min_time_s` seconds, then stop
    once the median's 95% confidence interval is within +-`precision` of it, or at `max_time_s` / `max_iters`.
    Returns (ms, host µs) per call and why it stopped ('precision', 'time' or 'iters')."""
    lat: list[float] = []
    host: list[float] = []
    t = time.perf_counter()
    while True:
        lat.append(timed_call(host))
        elapsed = time.perf_counter() - t
        if len(lat) >= max_iters:
            return lat, host, "iters"
        if len(lat) >= iters and elapsed >= min_time_s:
            if median_ci_rel(lat) <= precision:
                return lat, host, "precision"
            if elapsed >= max_time_s:
                return lat, host, "time"
