"""A forward's launches recorded once and replayed (`--option triton:launch=plan`).

Triton's own launch, `kernel[grid](*args)`, binds and specialises the arguments, looks the compiled kernel up,
resolves the grid and allocates nothing less than a dict per call: some tens of microseconds of Python. At batch 1,
ResNet-50's 56 launches then cost several times the GPU's 0.34 ms of work. A plan keeps, for each launch of one
recorded forward, what Triton found then (the compiled kernel, its grid, its bound arguments) and calls the compiled
kernel's launcher directly, as Triton itself does once it has found the kernel. Its activations are the recorded
forward's buffers: a replay writes the same tensors, and returns the same output tensor each call, as a CUDA
graph's replay does. Only the input changes: it is substituted where the recorded forward read it. A launch whose
grid leaves room on each SM runs a copy of its kernel that prefers L1 to shared memory (kernels/triton/carveout.py).

Compiled kernels exist only on the GPU: the interpreter (TRITON_INTERPRET=1) runs no plan."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
from triton import knobs
from triton.runtime import driver

from kernels.triton import carveout

RECORDING: list[Launch] | None = None  # the launches of the forward being recorded (kernels.triton.tuning.launch)


@dataclass
class Launch:
    kernel: Any  # triton's CompiledKernel
    grid: tuple[int, int, int]
    args: tuple  # every parameter of the kernel in signature order, constexprs too, as Triton's binder gives them
    function: int  # the loaded function to launch: the kernel's own, or a copy with a carveout fitted to the grid


def note(compiled, fn, grid, args: tuple, kwargs: dict) -> None:
    """Called by `launch` after it launched `fn` (a JITFunction) on `args` with `kwargs` (meta-parameters, and
    options such as num_warps that are no parameters): keeps the compiled kernel, the grid and the bound arguments."""
    signature = inspect.signature(fn.fn)
    bound = signature.bind(*args, **{k: v for k, v in kwargs.items() if k in signature.parameters})
    bound.apply_defaults()
    g = grid(bound.arguments) if callable(grid) else grid
    g = (g[0], g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1)
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    RECORDING.append(Launch(compiled, g, tuple(bound.arguments.values()),
                            carveout.function_for(compiled, g[0] * g[1] * g[2], device)))


class Plan:
    """One recorded forward: its launches, where they read the input, and its output."""

    def __init__(self, launches: list[Launch], x: torch.Tensor, output: torch.Tensor) -> None:
        self.launches, self.output = launches, output
        self.reads_input = {i: tuple(j for j, a in enumerate(launch.args) if a is x)
                            for i, launch in enumerate(launches) if any(a is x for a in launch.args)}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        stream = driver.active.get_current_stream(driver.active.get_current_device())
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        for i, launch in enumerate(self.launches):
            args = launch.args
            if i in self.reads_input:
                args = tuple(x if j in self.reads_input[i] else a for j, a in enumerate(args))
            k = launch.kernel
            k.run(*launch.grid, stream, launch.function, k.packed_metadata,
                  k.launch_metadata(launch.grid, stream, *args), enter, leave, *args)
        return self.output


def record(forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Plan:
    """Runs `forward(x)` once, through Triton's own launch path, and returns its plan (whose output is this
    forward's)."""
    global RECORDING
    RECORDING = []
    try:
        out = forward(x)
        return Plan(RECORDING, x, out)
    finally:
        RECORDING = None
