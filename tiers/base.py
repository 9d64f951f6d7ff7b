"""The rung interface. A rung is one file in tiers/ that defines `TIER` (or `TIERS`, a list).

Two kinds, told apart by type, share one contract (docs/protocol.md):
- `PythonTier`: builds a callable in the worker process (harness/child/worker.py runs the protocol around it);
- `ExternalTier`: a program of its own (C++), which runs the same protocol itself; the rung only says how to build
  it (cached), which files it needs made from the run's weights, and how to start it.

Every hook the harness may call is declared here with its one signature; a rung overrides what it has.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from core.cell import FRAMEWORK_DTYPES, Built, Cell, Store


# The rungs that call PyTorch's cuDNN convolutions run them as a fixed-shape deployment does: with cuDNN's benchmark
# mode on (each shape's fastest algorithm timed once, at the first call). `--option TIER:cudnn-benchmark=off` runs
# cuDNN's heuristic choice instead. The C++ rungs read the same option (cpp/libtorch/torch_rung.h).
CUDNN_BENCHMARK = {"cudnn-benchmark": ("on", "off")}


class Tier:
    name: str = ""
    summary: str = ""
    models: tuple[str, ...] | None = None  # None: any torchvision classification model
    dtypes: tuple[str, ...] = FRAMEWORK_DTYPES
    # The 16-bit type the rung is deployed in: the default GPU ladder's 16-bit cell (a rung whose runtime lacks
    # bf16 kernels deploys fp16).
    half: str = "bf16"
    cuda_graph: bool = False  # whether the rung can run captured in a CUDA graph (--cuda-graph)
    cuda_graph_train: bool = False  # whether it can capture a whole training step too
    # Rung-specific options (`--option TIER:KEY=VALUE`): key -> its valid values (default first), or None for a
    # positive integer.
    options: dict[str, tuple[str, ...] | None] = {}
    # The rung's caches, kept between its processes in its Store.cache directory (the run's `cache/<rung>/`): a
    # rung with caches has cold (empty) and warm-start (kept) starts, and the runner fills them before measuring.
    caches: tuple[str, ...] = ()
    # Whether the prepare stage may fill those caches with build-only processes running side by side (no timing
    # goes into filling them; a rung that autotunes while building may not).
    warm_in_prepare: bool = False
    # Whether one built rung takes another batch size (the 'hot' start: a new shape in the same process).
    batch_change: bool = False
    # Why the rung cannot run `--task train` (None: it trains).
    cannot_train: str | None = "no training path"
    # Whether `micro` exists: a per-layer microbenchmark (`python -m harness micro`).
    has_micro: bool = False
    has_micro_train: bool = False  # whether its microbenchmark also times the training step's layers
    # Whether the network is written here, kernel by kernel (triton, cudnn), rather than run by a framework: the
    # reports state these rungs' speed against the best framework cell too (harness/results/derive.py best_framework).
    hand_written: bool = False

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
        if cell.device != "cuda" and cell.dtype != "fp32":
            return f"{cell.dtype} is a GPU tensor-core configuration; on the CPU only fp32 is measured"
        if cell.cuda_graph and cell.device != "cuda":
            return "CUDA graphs need the GPU"
        if cell.task == "train" and self.cannot_train:
            return f"{self.name} does not train: {self.cannot_train}"
        if cell.task == "train" and cell.cuda_graph and not self.cuda_graph_train:
            return f"{self.name} does not capture its training step in a CUDA graph"
        return None

    def parity_recipe(self, cell: Cell) -> str | None:
        """The recipe (core/recipes.py) this rung's cells below fp32 are also held to at their own dtype, or None:
        only the band against eager fp32 (a rung whose roundings are its compiler's, not written down here)."""
        return None

    def option_default(self, key: str, cell: Cell) -> str | None:
        """The value an unset option takes in `cell`, on its device and in its dtype (the first of its choices; None
        for integer options)."""
        choices = self.options.get(key)
        return choices[0] if choices else None

    def setting(self, cell: Cell, key: str) -> str | None:
        """The cell's value of option `key`: as given, else its default in that cell."""
        return cell.option(key, self.option_default(key, cell))

    def micro(self, batch: int, res: int, dtype: str, channels_last: bool, task: str = "infer",
              baselines: bool = True) -> list[dict[str, Any]]:
        """Per-layer microbenchmark on the GPU: one row per layer or distinct convolution (has_micro says whether
        the rung has one); with task 'train', one row per step of the training schedule (a rung that trains).
        `baselines`: also time each layer on what the rung's own table compares it with, where it has such
        columns (`micro --layers` runs those as rungs of their own and passes False)."""
        raise NotImplementedError(f"{self.name} has no microbenchmark")


class PythonTier(Tier):
    def build(self, model: Any, example: Any, cell: Cell, store: Store) -> Built:
        """`model`: the eager fp32 torchvision model on the CPU with the run's weights, in eval mode.
        `example`: the input on the device in the cell's dtype and layout. `store`: the rung's cache and tunings."""
        raise NotImplementedError

    def build_train(self, model: Any, example: Any, cell: Cell, store: Store, lr: Any = None) -> Built:
        """`--task train`: `forward(x, y=None)` is one training step (core/train.py) returning the loss, and
        `state()` the model's parameters and buffers. `model`: the eager fp32 model on the CPU in train mode;
        `example`: the fp32 input on the device in the cell's layout (bf16 and fp16 mean autocast); `lr`: the
        learning rate (default core.train.LEARNING_RATE), or a one-element tensor that a schedule sets before each
        step (train-to-accuracy)."""
        raise NotImplementedError(f"{self.name} does not train: {self.cannot_train}")

    def after(self, built: Built, example: Any, cell: Cell) -> dict[str, Any]:
        """Rung facts that need the measured state (a compiler's guards), taken after every timed phase."""
        return {}

    def changes_batch(self, cell: Cell) -> bool:
        """Whether this cell's built rung takes another batch size (a CUDA graph replays one)."""
        return self.batch_change and not cell.cuda_graph

    def hot_start(self, built: Built, example: Any, cell: Cell) -> dict[str, Any]:
        """The hot start: in the same process, the first call at a new batch size (batch + 1), synchronised."""
        if not self.changes_batch(cell):
            return {"batch_change": None, "reason": f"{cell.label} runs one fixed batch size"}
        bigger = torch.cat([example, example[:1]])
        t = time.perf_counter()
        built.forward(bigger)
        if example.is_cuda:
            torch.cuda.synchronize()
        return {"batch_change": f"{cell.batch} -> {cell.batch + 1}", "first_call_s": time.perf_counter() - t}


class ExternalTier(Tier):
    # Whether `prepare` makes files from the run's weights (an export), which the prepare stage then runs per dtype.
    prepares_files: bool = False

    def command(self, cell: Cell) -> list[str]:
        """The program to start for this cell (built and cached on first use), before the contract's options."""
        raise NotImplementedError

    def built(self, cell: Cell) -> bool:
        """Whether the program for this cell is already built (its build cached), so starting it costs no build."""
        return False

    def prepare(self, cell: Cell, weights: Path, workdir: Path, cache: Path) -> dict[str, str]:
        """Files the program needs made from the run's weights (e.g. a TorchScript module), written under
        `workdir` (the cell's) or `cache` (the run's, per rung, kept between cells); returns extra
        `--option KEY=VALUE` pairs naming them. Runs in the parent, before the child (prepares_files)."""
        return {}
