"""The rung interface. A rung is one file in tiers/ that defines `TIER` (or `TIERS`, a list).

Two shapes share one contract (docs/protocol.md):
- `PythonTier`: builds a callable in the worker process (harness/worker.py runs the protocol around it);
- `ExternalTier`: a program of its own (C++), which runs the same protocol itself; the tier only says how to
  build it (cached) and start it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

DTYPES = ("fp32", "tf32", "fp16", "bf16")
TASKS = ("infer", "train")


class Unavailable(Exception):
    """Raised by a rung that cannot run here; the message is the exact reason shown to the user."""


@dataclass(frozen=True)
class Cell:
    """One measurement: a rung on one configuration. Its key identifies it in results and for resume."""

    tier: str
    model: str = "resnet50"
    batch: int = 1
    res: int = 224
    dtype: str = "fp32"
    channels_last: bool = False
    cuda_graph: bool = False
    device: str = "cuda"
    options: tuple[tuple[str, str], ...] = ()  # rung-specific, e.g. (("compile-mode", "max-autotune"),)
    task: str = "infer"  # 'infer': one forward; 'train': one training step (harness/train.py)

    def option(self, key: str, default: str | None = None) -> str | None:
        return dict(self.options).get(key, default)

    @property
    def key(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options)
        layout = "nhwc" if self.channels_last else "nchw"
        return (f"{'train:' if self.task == 'train' else ''}{self.tier}{'+graph' if self.cuda_graph else ''}[{opts}]/"
                f"{self.model}/b{self.batch}/r{self.res}/{self.dtype}/{layout}/{self.device}")

    @property
    def identity(self) -> str:
        """The key with every option at its rung's default left out: what makes two cells one measurement, for
        resume and for merged reports (`--option onnxruntime:conv-algo-search=EXHAUSTIVE` and no option)."""
        from tiers import all_tiers

        rung = all_tiers().get(self.tier)
        choices = rung.options if rung else {}
        kept = tuple((k, v) for k, v in self.options if not (choices.get(k) and choices[k][0] == v))
        return dataclasses.replace(self, options=kept).key

    @classmethod
    def of_record(cls, record: dict[str, Any]) -> Cell:
        fields = ("tier", "model", "batch", "res", "dtype", "channels_last", "cuda_graph", "device")
        return cls(**{f: record[f] for f in fields}, options=tuple(sorted((record.get("options") or {}).items())),
                   task=record.get("task", "infer"))

    @property
    def label(self) -> str:
        """Short rung label for tables: tier, its options and the CUDA-graph flag."""
        opts = ",".join(v for _, v in self.options)
        return self.tier + (f"({opts})" if opts else "") + ("+graph" if self.cuda_graph else "")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["options"] = dict(self.options)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Cell:
        return cls(**{**d, "options": tuple(d["options"].items())})


@dataclass
class Built:
    """What a Python rung's build returns. `forward(x)` takes the device input prepared by the worker (rung dtype
    and layout) and returns the logits; it may return before the GPU finishes (the worker times on `stream`)."""

    forward: Callable[[Any], Any]
    stream: Any = None  # torch.cuda.Stream the work is issued on; None = the current stream
    stream_description: str = "torch current stream"
    stats: dict[str, Any] = field(default_factory=dict)  # build facts: graph breaks, export size, ...
    uses_torch_allocator: bool = True  # whether torch.cuda.max_memory_allocated covers its memory
    # Training only: the model's parameters and buffers by name (fp32, on the CPU), read after the parity steps.
    state: Callable[[], dict[str, Any]] | None = None


class Tier:
    name: str = ""
    summary: str = ""
    models: tuple[str, ...] | None = None  # None: any torchvision classification model
    dtypes: tuple[str, ...] = DTYPES
    cuda_graph: bool = False  # whether the rung can run captured in a CUDA graph (--cuda-graph)
    # Rung-specific options (`--option TIER:KEY=VALUE`): key -> its valid values, or None for a positive integer.
    options: dict[str, tuple[str, ...] | None] = {}
    # The rung's caches on disk, kept between processes under the run's cache directory (its `--cache-dir`): a
    # rung with caches has cold (empty) and warm-start (kept) starts, and the runner fills them before measuring.
    caches: tuple[str, ...] = ()
    # Whether the prepare stage may fill those caches with build-only processes running side by side (no timing
    # goes into filling them; a rung that autotunes while building may not).
    warm_in_prepare: bool = False
    # Whether one built rung takes another batch size (the 'hot' start: a new shape in the same process).
    batch_change: bool = False
    # Why the rung cannot run `--task train` (None: it trains; a PythonTier then implements build_train).
    cannot_train: str | None = "no training path"

    def availability(self, device: str) -> str | None:
        """None if the rung can run on `device` ('cuda' or 'cpu'), else the exact reason it cannot."""
        return None

    def supports(self, cell: Cell) -> str | None:
        """None if the rung can run this cell, else why not (recorded as 'skipped')."""
        if self.models is not None and cell.model not in self.models:
            return f"{self.name} implements only {', '.join(self.models)}"
        if cell.dtype not in self.dtypes:
            return f"{self.name} does not implement {cell.dtype}"
        if cell.cuda_graph and not self.cuda_graph:
            return f"{self.name} has no CUDA-graph mode"
        if cell.device != "cuda" and cell.dtype in ("tf32", "fp16", "bf16"):
            return f"{cell.dtype} is a GPU tensor-core configuration; on the CPU only fp32 is measured"
        if cell.cuda_graph and cell.device != "cuda":
            return "CUDA graphs need the GPU"
        if cell.task == "train" and self.cannot_train:
            return f"{self.name} does not train: {self.cannot_train}"
        if cell.task == "train" and cell.cuda_graph:
            return "training steps are not captured in CUDA graphs here"
        return None


class PythonTier(Tier):
    kind = "python"

    def build(self, model: Any, example: Any, cell: Cell) -> Built:
        """`model`: the eager fp32 torchvision model on the CPU with the run's weights, in eval mode.
        `example`: the input on the device in the cell's dtype and layout."""
        raise NotImplementedError

    def build_train(self, model: Any, example: Any, cell: Cell, lr: float | None = None) -> Built:
        """`--task train`: `forward(x, y=None)` is one training step (harness/train.py) returning the loss, and
        `state()` the model's parameters and buffers. `model`: the eager fp32 model on the CPU in train mode;
        `example`: the fp32 input on the device in the cell's layout (bf16 and fp16 mean autocast); `lr`: the
        learning rate (default harness.train.LEARNING_RATE)."""
        raise NotImplementedError

    def changes_batch(self, cell: Cell) -> bool:
        """Whether this cell's built rung takes another batch size (a CUDA graph replays one)."""
        return self.batch_change and not cell.cuda_graph

    def hot_start(self, built: Built, example: Any, cell: Cell) -> dict[str, Any]:
        """The hot start: in the same process, the first call at a new batch size (batch + 1), synchronised."""
        import time

        import torch

        if not self.changes_batch(cell):
            return {"batch_change": None, "reason": f"{cell.label} runs one fixed batch size"}
        bigger = torch.cat([example, example[:1]])
        t = time.perf_counter()
        built.forward(bigger)
        if example.is_cuda:
            torch.cuda.synchronize()
        return {"batch_change": f"{cell.batch} -> {cell.batch + 1}", "first_call_s": time.perf_counter() - t}


class ExternalTier(Tier):
    kind = "external"

    def command(self, cell: Cell) -> list[str]:
        """The program to start for this cell (built and cached on first use), before the contract's options."""
        raise NotImplementedError

    def built(self, cell: Cell) -> bool:
        """Whether the program for this cell is already built (its build cached), so starting it costs no build."""
        return False

    def prepare(self, cell: Cell, weights: Any, workdir: Any, cache: Any) -> dict[str, str]:
        """Files the program needs made from the run's weights (e.g. a TorchScript module), written under
        `workdir` (the cell's) or `cache` (the run's, per rung, kept between cells); returns extra
        `--option KEY=VALUE` pairs naming them. Runs in the parent, before the child."""
        return {}


def torch_dtype(dtype: str) -> Any:
    """The torch type of the ladder's dtype name (tf32 is fp32 storage with TF32 math)."""
    import torch

    return {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]


def zero_example(cell: Cell) -> Any:
    """A zero input of the cell's shape on its device, dtype and layout: what an export traces with."""
    import torch

    x = torch.zeros(cell.batch, 3, cell.res, cell.res, device=cell.device, dtype=torch_dtype(cell.dtype))
    return x.contiguous(memory_format=torch.channels_last if cell.channels_last else torch.contiguous_format)


def place_model(model: Any, cell: Cell) -> Any:
    """The eager model on the cell's device, dtype and memory layout (what every PyTorch-based rung starts from)."""
    import torch

    model = model.to(cell.device, torch_dtype(cell.dtype))
    return model.to(memory_format=torch.channels_last) if cell.channels_last else model
