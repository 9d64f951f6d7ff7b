"""A torchvision ResNet run entirely on our Triton kernels, NHWC from the stem to the classifier."""
from __future__ import annotations

import contextlib
import re
from functools import partial
from typing import Callable, Iterator

import torch

from kernels.triton import plan
from kernels.triton.conv import PackedConv, conv2d, fuse_shortcut, pack_conv
from kernels.triton.pair import chain_pays, chainable, conv_pair, pairable, pays
from kernels.triton.pool import global_avg_pool
from kernels.triton.stem import pack_stem, stem, stem_fuses


def _pack(conv: torch.nn.Conv2d, bn, dtype, device, pack=pack_conv, **packing):
    if conv.groups != 1 or conv.dilation != (1, 1) or conv.stride[0] != conv.stride[1]:
        raise ValueError(f"unsupported convolution {conv} (grouped, dilated or anisotropic)")
    return pack(conv.weight, conv.stride[0], conv.padding[0], bn, conv.bias, dtype, device, **packing)


def pack_block(block: torch.nn.Module, dtype, device, packing=lambda name: {}, prefix: str = ""):
    """A BasicBlock or Bottleneck: its convolutions in order (the last one takes the residual) and the optional
    downsample (1x1 convolution + batch-norm on the shortcut), which outside FP8 is fused into the last convolution
    (fuse_shortcut; None is left in its place). `packing(path)`: pack_conv's layout and FP8 options for the
    convolution at `prefix` + its name."""
    names = ("1", "2", "3") if hasattr(block, "conv3") else ("1", "2")
    convs = [_pack(getattr(block, "conv" + i), getattr(block, "bn" + i), dtype, device,
                   **packing(f"{prefix}conv{i}")) for i in names]
    down = (_pack(block.downsample[0], block.downsample[1], dtype, device, **packing(f"{prefix}downsample.0"))
            if block.downsample is not None else None)
    if down is not None and not down.fp8:
        convs[-1], down = fuse_shortcut(convs[-1], down), None
    return convs, down


def block_conv_index(path: str) -> int:
    """i for a block's convolution (module path `...conv<i>`), 0 for any other (stem, downsample, classifier)."""
    conv = re.fullmatch(r".+\.conv(\d)", path)
    return int(conv[1]) if conv else 0


def readers(blocks: list[str], convs: int) -> dict[str, str]:
    """For each block convolution (module path) whose output one convolution reads first, that one's path: conv1 ->
    conv2 -> ... -> the block's last (conv<convs>) -> the next block's conv1 (which the next downsample reads too, in
    the same scale). The downsamples and the last block's last convolution are not in it."""
    within = {f"{b}.conv{i}": f"{b}.conv{i + 1}" for b in blocks for i in range(1, convs)}
    return within | {f"{b}.conv{convs}": f"{nxt}.conv1" for b, nxt in zip(blocks, blocks[1:])}


def run_block(x: torch.Tensor, packed, conv=conv2d, pair=None, first: torch.Tensor | None = None,
              chain: PackedConv | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """relu(convs(x) + shortcut(x)) on NHWC `x`, every batch-norm, ReLU and the residual add fused into the convs;
    with `pair` (conv_pair's signature), a bottleneck's conv2 and conv3 in one kernel, and with `chain` the next
    block's conv1 in it too. `first`: this block's conv1 output, where the block before computed it. Returns the
    block's output and the next block's conv1 output (None unless chained)."""
    convs, down = packed
    identity = x if down is None else conv(x, down, relu=False)
    h = first if first is not None else conv(x, convs[0])
    if convs[-1].shortcut_stride:  # the downsample fused in: it reads the block's input itself
        side = {"shortcut": identity}
    else:  # in FP8 the block's input may be stored in e4m3: in its conv1's input scale
        side = {"residual": identity,
                "residual_scale": 1 / convs[0].input_inv if identity.dtype == torch.float8_e4m3fn else None}
    if pair is not None:
        return pair(h, convs[1], convs[2], chain=chain, **side)
    for p in convs[1:-1]:
        h = conv(h, p)
    return conv(h, convs[-1], **side), None


PAIRS = ("auto", "on", "off")


class TritonResNet:
    """torchvision's ResNet (BasicBlock or Bottleneck blocks) with batch-norm folded at construction.
    `precision` is the tl.dot input precision for fp32 tensors: "ieee" (strict fp32) or "tf32" (weights K-major).
    `fp8_amax`: each convolution's calibrated input amax by module path (core/recipes.py calibration_amax): the
    blocks' convolutions then run in e4m3 and store their outputs in e4m3, in the scale of the convolution that
    reads them (a block's last: the next block's conv1), except the downsample's and the last block's, in `dtype`
    (bf16); the stem and the classifier stay bf16, as FP8 recipes keep the first and last layers. `pdl`: every kernel a
    programmatic dependent launch (kernels/triton/pdl.py). `pairs`: a bottleneck's conv2 and conv3 as one kernel
    (kernels/triton/pair.py) in every block whose downsample, if any, is fused into conv3 ("on"), in those where it
    pays ("auto", `pays`), or in none ("off"); `chains`: a pair also runs the next block's conv1 on its output,
    wherever it can ("on", `chainable`), where it pays ("auto", `chain_pays`), or nowhere ("off")."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, device, precision: str = "ieee", tune: bool = True,
                 fp8_amax: dict[str, float] | None = None, planned: bool = False, pdl: bool = False,
                 pairs: str = "auto", chains: str = "auto"):
        for name, value in (("pairs", pairs), ("chains", chains)):
            if value not in PAIRS:
                raise ValueError(f"{name} must be one of {', '.join(PAIRS)}, not {value!r}")
        self.conv = partial(conv2d, precision=precision, tune=tune, pdl=pdl)
        self.pair = partial(conv_pair, precision=precision, tune=tune, pdl=pdl)
        self.pairs, self.chains = pairs, chains
        self.stem_pool = partial(stem, precision=precision, tune=tune, pdl=pdl)
        self.avg_pool = partial(global_avg_pool, tune=tune, pdl=pdl, precision=precision)
        kmajor = dtype == torch.float32 and precision == "tf32"

        blocks = [f"layer{i + 1}.{j}" for i, layer in enumerate((model.layer1, model.layer2, model.layer3,
                                                                    model.layer4)) for j in range(len(layer))]
        reader = readers(blocks, 3 if hasattr(model.layer1[0], "conv3") else 2)

        def packing(path: str) -> dict:
            if not fp8_amax:
                return {"kmajor": kmajor, "tf32": kmajor}
            # e4m3 out in the scale of the convolution that reads the output; the downsample's and the last
            # block's output (the average pool's input) in bf16
            return {"input_amax": fp8_amax[path],
                    "output_amax": fp8_amax[reader[path]] if path in reader else None}

        # with its max-pool fused in, except in strict fp32, whose FMAs would pay the fused layout's multiplies
        self.stem = _pack(model.conv1, model.bn1, dtype, device, pack_stem, kmajor=kmajor, tf32=kmajor,
                          fused=stem_fuses(dtype, precision))
        self.blocks = [pack_block(block, dtype, device, packing, f"{name}.") for name, block in zip(
            blocks, (b for layer in (model.layer1, model.layer2, model.layer3, model.layer4) for b in layer))]
        fc = model.fc  # the classifier is a 1x1 convolution of the pooled [N, 1, 1, C] features
        self.fc = pack_conv(fc.weight[:, :, None, None], bias=fc.bias, dtype=dtype, device=device, kmajor=kmajor,
                            tf32=kmajor)
        # planned: each input shape's forward recorded once, then replayed (kernels/triton/plan.py)
        self.planned, self.plans, self.scoped = planned, {}, False
        # Each packed convolution's module path in the torchvision model (its batch-norm folded in), for the census.
        self.paths = {id(self.fc): "fc"}
        for name, (convs, down) in zip(blocks, self.blocks):
            self.paths.update({id(p): f"{name}.conv{i + 1}" + ("+downsample.0" if p.shortcut_stride else "")
                               for i, p in enumerate(convs)})
            if down is not None:
                self.paths[id(down)] = f"{name}.downsample.0"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """`x`: [N, 3, H, W] in any memory format; a channels_last tensor is already NHWC, so this costs nothing."""
        x = x.permute(0, 2, 3, 1).contiguous()
        if not self.planned or self.scoped:  # the census's named launches go through Triton's own path
            return self.forward(x)
        key = (x.shape, x.dtype, x.device)
        if key not in self.plans:
            self.plans[key] = plan.record(self.forward, x)
            return self.plans[key].output
        return self.plans[key](x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The network on NHWC `x`, each launch through Triton's own launch path."""
        x = self.stem_pool(x, self.stem)
        ahead = None  # this block's conv1 output, where the block before computed it
        for i, packed in enumerate(self.blocks):
            paired = self.paired(x, packed)
            following = self.blocks[i + 1][0][0] if i + 1 < len(self.blocks) else None
            chain = following if paired and self.chained(packed[0][-1], following) else None
            x, ahead = run_block(x, packed, self.conv, self.pair if paired else None, ahead, chain)
        return self.head(x)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The average pool and the classifier on the last block's NHWC output: the logits."""
        pooled = self.avg_pool(x)
        return self.conv(pooled[:, None, None, :], self.fc, relu=False).view(pooled.shape[0], -1)

    def stages(self, dtype: torch.dtype) -> list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]]:
        """The network as the parity recipe's stages (core/recipes.py `Folded.stages`): the stem, each block alone
        (its pair where forward would run one, never chained) and the head, each on an NCHW input converted to
        `dtype` (the activations' type; in FP8 a block's input stored in e4m3 is read as stored), returning NCHW
        as stored: so each can be fed the recipe's own input and judged alone, before the network amplifies a
        small difference."""
        def nhwc(x):  # a block's input stored in e4m3 (fp8) is read as stored
            x = x.permute(0, 2, 3, 1).contiguous()
            return x if x.dtype == torch.float8_e4m3fn else x.to(dtype)

        def block(x, packed):
            x = nhwc(x)
            return run_block(x, packed, self.conv, self.pair if self.paired(x, packed) else None)[0].permute(0, 3, 1, 2)

        blocks = [(self.paths[id(convs[0])].rsplit(".", 1)[0], partial(block, packed=(convs, down)))
                  for convs, down in self.blocks]
        return [("stem", lambda x: self.stem_pool(nhwc(x), self.stem).permute(0, 3, 1, 2)), *blocks,
                ("head", lambda x: self.head(nhwc(x)))]

    def paired(self, x: torch.Tensor, packed) -> bool:
        """Whether the block `packed` runs its conv2 and conv3 as one kernel on its input `x`."""
        convs, down = packed
        if self.pairs == "off" or down is not None or len(convs) != 3:
            return False
        return pairable(convs[1], convs[2]) and (self.pairs == "on" or pays(x, convs[1], convs[2]))

    def chained(self, tail: PackedConv, following: PackedConv | None) -> bool:
        """Whether a pair ending in `tail` also runs `following`, the next block's conv1."""
        if self.chains == "off" or following is None or not chainable(tail, following):
            return False
        return self.chains == "on" or chain_pays(tail, following)

    @contextlib.contextmanager
    def layer_scopes(self, prefix: str) -> Iterator[None]:
        """While it lasts, each launch runs inside a profiler range named `prefix` + the module path it computes
        (the census's layers); outside it, the launches carry no such cost."""
        def named(fn, path_of):
            def call(*args, **kwargs):
                with torch.profiler.record_function(prefix + path_of(*args)):
                    return fn(*args, **kwargs)
            return call

        plain = self.conv, self.pair, self.stem_pool, self.avg_pool
        self.scoped = True
        self.conv = named(self.conv, lambda x, p, **_: self.paths[id(p)])
        self.pair = named(self.pair, lambda x, p, tail, chain=None, **_: "+".join(
            self.paths[id(c)] for c in (p, tail, chain) if c is not None))
        self.stem_pool = named(self.stem_pool, lambda x, p: "conv1+maxpool")
        self.avg_pool = named(self.avg_pool, lambda x: "avgpool")
        try:
            yield
        finally:
            self.conv, self.pair, self.stem_pool, self.avg_pool = plain
            self.scoped = False
