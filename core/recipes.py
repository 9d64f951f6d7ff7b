"""What a rung computes at its dtype, written out in PyTorch: the reference that a low-precision cell is held to
besides eager fp32 (core/parity.py, docs/notes/parity.md).

Against fp32 a bf16 cell must be allowed bf16's rounding, about 1% of the logits, and a wrong network can hide
inside that (a batch-norm scale x1.1 moves them 2%). Against a reference that rounds where the rung rounds, only
the order of fp32 sums differs, and the allowed error shrinks by an order of magnitude. A recipe is named by the
rung (`Tier.parity_recipe`):

- `eager`: the eager rung itself at the cell's dtype and layout (the ATen kernels every eager-family rung calls);
- `folded`: batch-norm folded into each convolution in fp64 and the weights rounded once to the dtype; the input
  rounded to the dtype; each convolution accumulates in fp32, then adds its bias, the residual (read as stored) and
  ReLU in fp32 and rounds once when it stores (TF32: fp32 storage, each value rounded to TF32 as it is stored); the stem's max-pool after it; the average pool and the classifier
  store the dtype too. The hand-written rungs compute this (kernels/triton, cpp/cudnn). `folded-fused-shortcut`:
  the same with a downsample summed into the block's last convolution before that one rounding (triton's
  fuse_shortcut), where `folded` rounds the downsample's output first (cudnn).
- fp8 (`folded` at dtype fp8): triton's e4m3 recipe, every rounding of tiers/triton.py's FP8_RECIPE, with the
  scales the rung calibrates (`calibration_amax`, on the calibration input, never on the parity input).

TF32 rounds to nearest with 10 mantissa bits (`round_tf32`), as cuBLAS and cuDNN convert their multiplicands.

A recipe is a specification written from the rung's documentation, independent of the rung's code: it shares no
function with kernels/ (a bug in the rung's packing is not repeated here)."""
from __future__ import annotations

import contextlib
import copy
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torchvision.models.resnet import BasicBlock, Bottleneck

from core.model import make_input
from core.placement import memory_format, set_math_mode, torch_dtype

RECIPES = ("eager", "folded", "folded-fused-shortcut")
E4M3_MAX = 448.0  # the largest finite e4m3 value
CALIBRATION_SEED = 2  # fp8's calibration input: neither the parity input (seed 0) nor the other input (seed 1)


def round_tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 `x` rounded to TF32 (10 explicit mantissa bits), to nearest with ties away from zero (cvt.rna.tf32)."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0x1000) & -0x2000).view(torch.float32)


STORED = {"bf16": torch.bfloat16, "fp16": torch.float16}


def rounder(dtype: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The rounding of a stored value at the ladder's dtype (fp8: its bf16 outside the blocks), in fp32. TF32 keeps
    fp32 storage, each value rounded to TF32 by the kernel that stores it, for the products that read it."""
    if dtype == "tf32":
        return round_tf32
    stored = STORED.get(dtype)
    return (lambda t: t.to(stored).float()) if stored else (lambda t: t.float())


def fold(conv: torch.nn.Conv2d, bn: torch.nn.Module | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The convolution with its eval-mode batch-norm folded in, in fp64: (weight, bias)."""
    w = conv.weight.detach().double().cpu()
    b = conv.bias.detach().double().cpu() if conv.bias is not None else torch.zeros(w.shape[0], dtype=torch.float64)
    if bn is not None:
        s = bn.weight.detach().double().cpu() / torch.sqrt(bn.running_var.detach().double().cpu() + bn.eps)
        w = w * s[:, None, None, None]
        b = (b - bn.running_mean.detach().double().cpu()) * s + bn.bias.detach().double().cpu()
    return w, b


def calibration_input(batch: int, res: int) -> torch.Tensor:
    return make_input(batch, res, seed=CALIBRATION_SEED)


def calibration_amax(model: torch.nn.Module, x: torch.Tensor) -> dict[str, float]:
    """fp8's calibration: the largest |input| each convolution sees in a strict fp32 forward of `x`, by module path."""
    amax: dict[str, float] = {}
    hooks = [m.register_forward_pre_hook(lambda _m, inp, p=path: amax.__setitem__(p, inp[0].abs().max().item()))
             for path, m in model.named_modules() if isinstance(m, torch.nn.Conv2d)]
    try:
        with torch.no_grad(), strict_fp32():
            model.float()(x.float())
    finally:
        for h in hooks:
            h.remove()
    return amax


@contextlib.contextmanager
def strict_fp32() -> Iterator[None]:
    """TF32 off in matmuls and convolutions while it lasts, as it was after."""
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


class Folded:
    """The `folded` recipe of a torchvision ResNet at `dtype`, on `device`; `fused_shortcut`: a downsample summed
    into its block's last convolution before rounding (outside fp8). fp8: `amax` is the calibration
    (calibration_amax), and `outer` the dtype of the stem, the classifier, the downsamples' outputs and the last
    block's (bf16; "tf32" for the interpreter's fp8 network, which has no bf16 arithmetic: fp32 storage and TF32
    products); every other block's output is e4m3 (block_e4m3)."""

    def __init__(self, model: torch.nn.Module, dtype: str, device, fused_shortcut: bool,
                 amax: dict[str, float] | None = None, outer: str = "bf16") -> None:
        if dtype == "fp8" and amax is None:
            raise ValueError("the fp8 recipe needs the calibration's amax (calibration_amax)")
        self.model, self.dtype, self.device = model, dtype, device
        self.fused_shortcut = fused_shortcut and dtype != "fp8"
        self.amax = amax or {}
        self.outer = outer if dtype == "fp8" else dtype
        self.round = rounder(self.outer)
        blocks = [f"{_layer_name(model, layer)}.{i}" for layer in (model.layer1, model.layer2, model.layer3,
                                                                     model.layer4) for i in range(len(layer))]
        self.readers = dict(zip(blocks, blocks[1:]))  # fp8: whose conv1 reads a block's output

    def weights(self, conv, bn) -> tuple[torch.Tensor, torch.Tensor]:
        """Folded weights rounded once from fp64 to the dtype (TF32: to fp32, then to nearest TF32), in fp32; the
        bias in fp32."""
        w, b = fold(conv, bn)
        w = w.to(STORED.get(self.outer, torch.float32)).float()
        return (round_tf32(w) if self.outer == "tf32" else w).to(self.device), b.float().to(self.device)

    def conv(self, x, conv, bn) -> torch.Tensor:
        """The fp32 accumulation of one convolution plus its bias (x: fp32 holding the stored values)."""
        w, b = self.weights(conv, bn)
        return F.conv2d(x, w, None, conv.stride, conv.padding) + b[None, :, None, None]

    def conv_e4m3(self, x, path: str, conv, bn, stored_e4m3: bool) -> torch.Tensor:
        """fp8: the e4m3 product's fp32 result scaled back plus the bias. `x` is the input as stored: e4m3 codes
        (`stored_e4m3`, already in this convolution's input scale) or bf16 values, scaled and rounded here."""
        w, b = fold(conv, bn)
        packed = w.permute(2, 3, 1, 0).reshape(-1, w.shape[0])
        w_scale = packed.abs().amax(0).clamp_min(1e-30) / E4M3_MAX
        codes = (packed / w_scale).to(torch.float8_e4m3fn).float()
        wq = codes.reshape(w.shape[2], w.shape[3], w.shape[1], w.shape[0]).permute(3, 2, 0, 1).to(self.device)
        input_scale = max(self.amax[path], 1e-30) / E4M3_MAX
        if not stored_e4m3:
            x = e4m3(x * self.fp32(self.input_inv(path), x.device))
        scale = (w_scale * input_scale).to(torch.float32).to(self.device)
        acc = F.conv2d(x, wq, None, conv.stride, conv.padding)
        return acc * scale[None, :, None, None] + b.float().to(self.device)[None, :, None, None]

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        with strict_fp32():
            return self.forward(x.to(self.device).float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _, stage in self.stages():
            x = stage(x)
        return x

    def stages(self) -> list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]]:
        """The network as stages that a hand-written rung also runs one at a time: the stem (with its max-pool),
        each block by module path, and the head (average pool and classifier); each maps the stage before's output
        (NCHW, fp32 holding the stored values; the stem: the input) to its own."""
        m, r = self.model, self.round
        stages = [("stem", lambda x: r(F.max_pool2d(F.relu(self.conv(r(x), m.conv1, m.bn1)), 3, 2, 1)))]
        for layer in (m.layer1, m.layer2, m.layer3, m.layer4):
            for i, block in enumerate(layer):
                name = f"{_layer_name(m, layer)}.{i}"
                stages.append((name, lambda x, block=block, name=name: self.block(x, block, name)))
        head = _as_conv(m.fc)
        stages.append(("head", lambda x: r(self.conv(r(x.mean((2, 3)))[:, :, None, None], head, None).flatten(1))))
        return stages

    @torch.no_grad()
    def stage_outputs(self, x: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Each stage's output in turn, the recipe's own chain (stages)."""
        outputs = []
        with strict_fp32():
            x = x.to(self.device).float()
            for name, stage in self.stages():
                x = stage(x)
                outputs.append((name, x))
        return outputs

    def block(self, x: torch.Tensor, block: torch.nn.Module, name: str) -> torch.Tensor:
        r = self.round
        names = ("1", "2", "3") if isinstance(block, Bottleneck) else ("1", "2")
        if not isinstance(block, (BasicBlock, Bottleneck)):
            raise ValueError(f"the folded recipe covers torchvision's BasicBlock and Bottleneck, not {type(block)}")
        down = block.downsample
        if self.dtype == "fp8":
            return self.block_e4m3(x, block, name, names)
        h = x
        for i in names[:-1]:
            h = r(F.relu(self.conv(h, getattr(block, "conv" + i), getattr(block, "bn" + i))))
        last = self.conv(h, getattr(block, "conv" + names[-1]), getattr(block, "bn" + names[-1]))
        if down is None:
            return r(F.relu(last + x))
        shortcut = self.conv(x, down[0], down[1])
        return r(F.relu(last + shortcut)) if self.fused_shortcut else r(F.relu(last + r(shortcut)))

    def block_e4m3(self, x: torch.Tensor, block: torch.nn.Module, name: str, names: tuple[str, ...]) -> torch.Tensor:
        """fp8: every convolution reads e4m3 and a block's output is stored in e4m3 in the input scale of the
        convolution that reads it (the next block's conv1, whose downsample reads the same codes), returned as the
        e4m3 codes themselves; the last block's output in the outer dtype. `x` as stored: e4m3 codes (in this block's
        conv1 input scale; its residual scaled back by that scale) or outer-dtype values (the stem's output)."""
        stored = x.dtype == torch.float8_e4m3fn
        x = x.float()
        down = block.downsample
        if down is not None:
            identity = self.round(self.conv_e4m3(x, f"{name}.downsample.0", down[0], down[1], stored))
        else:
            identity = x * self.fp32(1 / self.input_inv(f"{name}.conv1"), x.device) if stored else x
        h = x
        for j, i in enumerate(names):
            conv, bn = getattr(block, "conv" + i), getattr(block, "bn" + i)
            out = self.conv_e4m3(h, f"{name}.conv{i}", conv, bn, stored_e4m3=stored or j > 0)
            if j + 1 < len(names):  # stored in e4m3, in the next convolution's input scale
                h = e4m3(F.relu(out) * self.fp32(self.input_inv(f"{name}.conv{names[j + 1]}"), out.device))
        out = F.relu(out + identity)
        reader = self.readers.get(name)
        if reader is None:
            return self.round(out)
        return e4m3(out * self.fp32(self.input_inv(f"{reader}.conv1"), out.device)).to(torch.float8_e4m3fn)

    def input_inv(self, path: str) -> float:
        """1 / a convolution's input scale: E4M3_MAX over its calibrated amax (as the kernels take it)."""
        return E4M3_MAX / max(self.amax[path], 1e-30)

    @staticmethod
    def fp32(value: float, device) -> torch.Tensor:
        """A scale as the kernels take it, a Python float passed as an fp32 argument; multiplied, as they do."""
        return torch.tensor(value, dtype=torch.float32, device=device)


def e4m3(t: torch.Tensor) -> torch.Tensor:
    """Saturated to e4m3's range, rounded to e4m3 (to nearest even), returned in fp32."""
    return t.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()


def _as_conv(fc: torch.nn.Linear) -> torch.nn.Conv2d:
    """The classifier as the 1x1 convolution of the pooled features that the hand-written rungs run."""
    conv = torch.nn.Conv2d(fc.in_features, fc.out_features, 1, device=fc.weight.device)
    with torch.no_grad():
        conv.weight.copy_(fc.weight[:, :, None, None])
        conv.bias.copy_(fc.bias)
    return conv


def _layer_name(model: torch.nn.Module, layer: torch.nn.Module) -> str:
    return next(name for name, m in model.named_children() if m is layer)


def folded(model: torch.nn.Module, x: torch.Tensor, dtype: str, fused_shortcut: bool,
           amax: dict[str, float] | None = None, outer: str = "bf16") -> torch.Tensor:
    """The `folded` recipe's logits of `x` at `dtype` (fp32), computed on x's device."""
    return Folded(model.eval(), dtype, x.device, fused_shortcut, amax, outer)(x)


def recipe_output(recipe: str, model: torch.nn.Module, x: torch.Tensor, dtype: str, channels_last: bool,
                  outer: str = "bf16") -> torch.Tensor:
    """The logits of `recipe` (RECIPES) for `model` on `x` at `dtype`, in fp32, computed on x's device; `model` is
    left as it was."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown parity recipe {recipe!r}; valid: {', '.join(RECIPES)}")
    if recipe == "eager":  # the eager rung's own build (tiers/eager.py): the module at the dtype and layout
        if dtype == "fp8":
            raise ValueError("eager has no fp8 recipe")
        set_math_mode(dtype)
        fmt = memory_format(channels_last)
        module = copy.deepcopy(model).eval().to(x.device, torch_dtype(dtype)).to(memory_format=fmt)
        with torch.inference_mode():
            return module(x.to(torch_dtype(dtype)).contiguous(memory_format=fmt)).float()
    return folded_recipe(recipe, model, x, dtype, outer)(x)


def folded_recipe(recipe: str, model: torch.nn.Module, x: torch.Tensor, dtype: str, outer: str = "bf16") -> Folded:
    """The `folded` or `folded-fused-shortcut` recipe of a copy of `model` at `dtype` on x's device (fp8: calibrated
    as the rung calibrates, on the calibration input of x's size)."""
    model = copy.deepcopy(model).eval()
    amax = (calibration_amax(copy.deepcopy(model).to(x.device),
                             calibration_input(x.shape[0], x.shape[-1]).to(x.device)) if dtype == "fp8" else None)
    return Folded(model, dtype, x.device, recipe == "folded-fused-shortcut", amax, outer)
