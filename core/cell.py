"""What one measurement is (`Cell`), what a Python rung's build returns (`Built`), where a rung keeps what outlives
its process (`Store`), and how a rung says it cannot run (`Unavailable`). No torch here: the parent imports it."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

# fp8: e4m3 convolutions with calibrated scales and bf16 activations, a hand-written rung's own (no framework rung of
# this ladder runs FP8 convolutions).
DTYPES = ("fp32", "tf32", "fp16", "bf16", "fp8")
FRAMEWORK_DTYPES = DTYPES[:4]
TASKS = ("infer", "train")


class Unavailable(Exception):
    """Raised by a rung that cannot run here; the message is the exact reason shown to the user."""


def layout_name(channels_last: bool) -> str:
    """The activation layout's name in keys, records and tables."""
    return "nhwc" if channels_last else "nchw"


@dataclass(frozen=True)
class Cell:
    """One measurement: a rung on one configuration. Its key identifies it in results and for resume (two keys
    that differ only by an option at its rung's default are one measurement: tiers.identity)."""

    tier: str
    model: str = "resnet50"
    batch: int = 1
    res: int = 224
    dtype: str = "fp32"
    channels_last: bool = False
    cuda_graph: bool = False
    device: str = "cuda"
    options: tuple[tuple[str, str], ...] = ()  # rung-specific, e.g. (("compile-mode", "max-autotune"),)
    task: str = "infer"  # 'infer': one forward; 'train': one training step (core/train.py)

    def option(self, key: str, default: str | None = None) -> str | None:
        return dict(self.options).get(key, default)

    @property
    def layout(self) -> str:
        return layout_name(self.channels_last)

    @property
    def key(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options)
        return (f"{'train:' if self.task == 'train' else ''}{self.tier}{'+graph' if self.cuda_graph else ''}[{opts}]/"
                f"{self.model}/b{self.batch}/r{self.res}/{self.dtype}/{self.layout}/{self.device}")

    @classmethod
    def of_record(cls, record: dict[str, Any]) -> Cell:
        fields = ("tier", "model", "batch", "res", "dtype", "channels_last", "cuda_graph", "device")
        return cls(**{f: record[f] for f in fields}, options=tuple(sorted((record.get("options") or {}).items())),
                   task=record.get("task", "infer"))

    @property
    def label(self) -> str:
        """Short rung label for tables: tier, its options and the CUDA-graph flag."""
        opts = ",".join(f"{k}={v}" if v in ("on", "off") else v for k, v in self.options)  # eager(cudnn-benchmark=off)
        return self.tier + (f"({opts})" if opts else "") + ("+graph" if self.cuda_graph else "")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["options"] = dict(self.options)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Cell:
        return cls(**{**d, "options": tuple(d["options"].items())})


@dataclass(frozen=True)
class Store:
    """Where a rung keeps what outlives its process, given to every rung the same way (a Python rung's build, a
    C++ rung's `--cache-dir` and `--tunings`): `cache`, the rung's directory under the run's cache (a fresh, empty
    one per cell under --isolation cell; None outside a ladder); `tunings`, the tuning file shipped for this GPU
    model (None under --retune or where none ships); `calibration`, a file of images (safetensors, `x`) an fp8
    build calibrates its scales on (train-to-accuracy hands its training images; None: core/recipes.py's input)."""

    cache: Path | None = None
    tunings: Path | None = None
    calibration: Path | None = None

    def library_env(self) -> dict[str, str]:
        """The variables by which Inductor and Triton find their caches: under the rung's cache directory, so that
        a cold start is cold whatever earlier runs left on the machine."""
        if self.cache is None:
            return {}
        return {"TORCHINDUCTOR_CACHE_DIR": str(self.cache / "inductor"), "TRITON_CACHE_DIR": str(self.cache / "triton")}


@dataclass
class Built:
    """What a Python rung's build returns. `forward(x)` takes the device input prepared by the worker (rung dtype
    and layout) and returns the logits; it may return before the GPU finishes (the worker times on `stream`)."""

    forward: Callable[[Any], Any]
    stream: Any = None  # torch.cuda.Stream the work is issued on; None = the current stream
    stream_description: str = "torch current stream"
    stats: dict[str, Any] = field(default_factory=dict)  # build facts: graph breaks, export size, ...
    uses_torch_allocator: bool = True  # whether torch.cuda.max_memory_allocated covers its memory
    # Whether forward already replays the rung's own CUDA graph (cuda_graph cells): its result is then the graph's
    # output buffer, which the next call overwrites; a caller that keeps results copies them.
    captured: bool = False
    # A context in which forward marks each layer's work as a profiler range named core.layers.SCOPE + its module
    # path, for the census (eager: hooks on its module; triton: its own launches). None where that would change
    # what runs (hooks make torch.compile recompile).
    layer_scopes: Callable[[], Any] | None = None
    # Where the rung has a profiler of its own (ONNX Runtime's): makes a profiling twin of forward and returns
    # (forward, finish); finish() ends that profile and returns its ranges as Chrome trace events (harness/run/census.py
    # LAYER, BASIS in their args), their ts in µs since the epoch.
    profiled: Callable[[], tuple[Callable[[Any], Any], Callable[[], list[dict]]]] | None = None
    # Training only: the model's parameters and buffers by name (fp32, on the CPU), read after the parity steps.
    state: Callable[[], dict[str, Any]] | None = None
    # Where the rung runs the network as its parity recipe's stages (core/recipes.py `Folded.stages`): those stages
    # as (name, function of the NCHW input the recipe gives it), for the stage check (core/parity.py).
    stages: Callable[[], list[tuple[str, Callable[[Any], Any]]]] | None = None
