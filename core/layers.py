"""A network's layers as the kernel census names them: each module's path ("layer1.0.conv2"), the group it belongs to
(stem, layer1..layer4, head for a ResNet), its convolution and classifier calls in the order the forward runs them
(one traced pass on the meta device), and its distinct layers. `module_scopes` marks each module's forward as a profiler range, so that the kernels it launches carry its
path."""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from math import prod
from typing import Iterator

import torch

from core.model import skeleton

SCOPE = "layer:"  # the prefix of a module's profiler range (a user annotation in the trace)
# The args by which a rung's own ranges in the trace name their layer, what named it, and the pass (forward,
# backward, optimizer); cpp/cudnn/src/main.cpp writes the same.
LAYER, BASIS, PHASE = "census layer", "census basis", "census phase"
# ResNet's modules outside its stages, by the group they belong to.
STEM = ("conv1", "bn1", "relu", "maxpool")
HEAD = ("avgpool", "fc")


def group_of(path: str) -> str:
    """The layer group of a module path: 'stem', a stage ('layer3'), 'head', or the path's first part. A kernel
    that runs several modules is named by their paths joined with '+' ('conv1+maxpool'): the first one's group."""
    first = path.split("+", 1)[0].split(".", 1)[0]
    return "stem" if first in STEM else "head" if first in HEAD else first


def block_of(path: str) -> str:
    """The block a module belongs to: 'layer3.2' for 'layer3.2.conv1', the group outside the stages."""
    parts = path.split(".")
    return ".".join(parts[:2]) if parts[0].startswith("layer") and len(parts) > 1 else group_of(path)


@dataclass(frozen=True)
class Conv:
    path: str
    weight: tuple[int, ...]  # (out, in / groups, kh, kw)
    stride: int


@dataclass(frozen=True)
class Call:
    """One convolution or classifier call of the forward, as a traced pass saw it (per image)."""

    path: str
    weight: tuple[int, ...]
    stride: int
    pad: int
    size: tuple[int, int]  # its input's height and width (1 x 1 for the classifier)
    epilogue: str  # what follows it (epilogue_of); the classifier: 'none'
    elements: int  # activation elements it reads and writes once: input, output, and the shortcut it adds


@functools.lru_cache(maxsize=None)
def calls(model_name: str, res: int) -> tuple[Call, ...]:
    """The model's convolution and classifier calls in forward order (hooks on the meta device: nothing runs)."""
    with torch.device("meta"):
        model = skeleton(model_name).eval()
    order: list[Call] = []
    for path, m in model.named_modules():
        if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)):
            def hook(mod, inputs, output, p=path):
                conv = isinstance(mod, torch.nn.Conv2d)
                epilogue = epilogue_of(p, model) if conv else "none"
                size = tuple(inputs[0].shape[2:]) if conv else (1, 1)
                read = (inputs[0].numel() * span(size[0], output.shape[-2], mod.kernel_size[0], mod.stride[0])
                        * span(size[1], output.shape[-1], mod.kernel_size[1], mod.stride[1])
                        // (size[0] * size[1])) if conv else inputs[0].numel()
                elements = (read + output.numel() * (2 if epilogue == "add+relu" else 1)) // len(output)
                order.append(Call(p, tuple(mod.weight.shape), mod.stride[0] if conv else 1,
                                  mod.padding[0] if conv else 0, size, epilogue, elements))
            m.register_forward_hook(hook)
    with torch.no_grad():
        model(torch.empty(1, 3, res, res, device="meta"))
    return tuple(order)


def convolutions(model_name: str) -> tuple[Conv, ...]:
    """The model's convolutions in the order its forward calls them."""
    return tuple(Conv(c.path, c.weight, c.stride) for c in calls(model_name, 64) if len(c.weight) == 4)


def elements_per_group(model_name: str, res: int) -> dict[str, tuple[int, int]]:
    """Per layer group: (activation elements per image, weight elements) its convolutions and classifier read and
    write with each tensor through memory once (input, output, and the shortcut a block's last convolution adds):
    the floor of its memory traffic, as a layer's roofline counts it."""
    groups: dict[str, tuple[int, int]] = {}
    for c in calls(model_name, res):
        act, weights = groups.get(group_of(c.path), (0, 0))
        groups[group_of(c.path)] = (act + c.elements, weights + prod(c.weight))
    return groups


@contextlib.contextmanager
def module_scopes(model: torch.nn.Module) -> Iterator[None]:
    """Every submodule's forward inside a profiler range named SCOPE + its path, while the context lasts."""
    open_ranges: list = []
    handles = []
    for path, m in model.named_modules():
        if not path:
            continue
        handles.append(m.register_forward_pre_hook(lambda _m, _x, p=path: open_ranges.append(
            torch.ops.profiler._record_function_enter_new(SCOPE + p, None))))
        handles.append(m.register_forward_hook(
            lambda _m, _x, _y: torch.ops.profiler._record_function_exit._RecordFunction(open_ranges.pop())))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def span(size: int, out: int, window: int, stride: int) -> int:
    """Input rows (or columns) a convolution reads: all of them, unless its stride skips some between windows
    (a 1x1 convolution of stride 2, the downsample, reads every other row and column: a quarter of its input)."""
    return min(size, out * window) if window < stride else size


@dataclass(frozen=True)
class Layer:
    """A distinct convolution of the model with its epilogue, as the layer microbenchmark runs it alone: `path`
    names its first occurrence, `count` how many the forward has."""

    path: str
    weight: tuple[int, ...]
    stride: int
    pad: int
    size: tuple[int, int]  # its input's height and width
    epilogue: str  # 'relu', 'add+relu' (a block's last convolution: the residual added) or 'none' (downsample)
    count: int

    @property
    def shape(self) -> str:
        k, c, r, _ = self.weight
        return f"{r}x{r}/s{self.stride} {c}->{k} @{self.size[0]}x{self.size[1]} {self.epilogue}"

    def output_size(self) -> tuple[int, int]:
        r = self.weight[2]
        return tuple((s + 2 * self.pad - r) // self.stride + 1 for s in self.size)

    def flops(self, batch: int) -> int:
        k, c, r, s = self.weight
        p, q = self.output_size()
        return 2 * batch * k * c * r * s * p * q

    def bytes(self, batch: int, element: int) -> int:
        """Its floor of memory traffic: the input it reads, weights and output once (and the residual it adds)."""
        k, c, r, s = self.weight
        p, q = self.output_size()
        out = batch * k * p * q
        read = batch * c * span(self.size[0], p, r, self.stride) * span(self.size[1], q, s, self.stride)
        return element * (read + k * c * r * s + out * (2 if "add" in self.epilogue else 1))


def epilogue_of(path: str, model: torch.nn.Module) -> str:
    """What follows a convolution in torchvision's ResNet: its BatchNorm, then ReLU; the residual add first for a
    block's last convolution; nothing more for the downsample's."""
    if ".downsample." in path:
        return "none"
    block, _, name = path.rpartition(".")
    if not block:
        return "relu"
    last = "conv3" if hasattr(model.get_submodule(block), "conv3") else "conv2"
    return "add+relu" if name == last else "relu"


def distinct_layers(model_name: str, res: int) -> tuple[Layer, ...]:
    """The model's distinct convolutions (weights' shape, stride, input size, epilogue) in forward order."""
    seen: dict[tuple, list] = {}
    for c in calls(model_name, res):
        if len(c.weight) == 4:
            seen.setdefault((c.weight, c.stride, c.pad, c.size, c.epilogue), [c.path, 0])[1] += 1
    return tuple(Layer(path, w, stride, pad, size, epilogue, count)
                 for (w, stride, pad, size, epilogue), (path, count) in seen.items())


class LayerNet(torch.nn.Module):
    """One layer alone: convolution, BatchNorm (eval) and its epilogue; the residual it adds is a buffer of the
    output's shape, read as the block's shortcut would be. With a residual, it takes only that batch (`fixed_batch`:
    an exporter must not give it a free batch axis)."""

    def __init__(self, conv: torch.nn.Conv2d, bn: torch.nn.BatchNorm2d, epilogue: str, residual: torch.Tensor | None):
        super().__init__()
        self.conv, self.bn, self.epilogue = conv, bn, epilogue
        self.register_buffer("residual", residual)
        self.fixed_batch = None if residual is None else residual.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.conv(x))
        if self.residual is not None:
            y = y + self.residual
        return torch.relu(y) if self.epilogue != "none" else y


def layer_net(model: torch.nn.Module, layer: Layer, batch: int, seed: int = 0) -> torch.nn.Module:
    """`layer` of `model` (its trained or seeded weights) alone, eval mode, on the CPU in fp32."""
    conv = model.get_submodule(layer.path)
    prefix, _, name = layer.path.rpartition(".")
    bn = model.get_submodule((prefix + "." if prefix else "") + ("1" if name == "0" else name.replace("conv", "bn")))
    residual = None
    if layer.epilogue == "add+relu":
        g = torch.Generator().manual_seed(seed)
        residual = torch.randn(batch, layer.weight[0], *layer.output_size(), generator=g)
    return LayerNet(conv, bn, layer.epilogue, residual).eval()
