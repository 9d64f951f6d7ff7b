"""Plausible wrong networks: bugs a kernel writer could make, which every parity check must reject at every dtype
(docs/notes/parity.md). A check that cannot fail proves nothing; these are how it is made to.

A forward mutant lives in the weights (fed to a rung as its weights file, so the rung itself computes the wrong
network, hand-written rungs included), in the input (fed as its input), or in the structure (a ReLU, a residual add
or a padding that the rung's code gets wrong: eager's modules changed here; the triton rung's launches changed by
harness/mutations.py). A training mutant is a backward that is wrong: gradients hooked on eager's step.
Paths name modules that torchvision's resnet18 and resnet50 both have, so that the CPU test runs the same suite."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torchvision.models.resnet import Bottleneck


@dataclass(frozen=True)
class Mutant:
    name: str
    bug: str  # what the kernel writer got wrong
    kind: str  # "weights", "input", "structure" (forward) or "gradient" (training)
    target: str = ""  # the module path it changes
    change: Callable[..., None] | None = None  # weights / structure: in place on a copy of the model

    def model(self, model: torch.nn.Module) -> torch.nn.Module:
        """A copy of `model` with this mutant's bug (the model itself where the bug is not in it)."""
        if self.kind not in ("weights", "structure"):
            return model
        wrong = copy.deepcopy(model)
        with torch.no_grad():
            self.change(wrong.get_submodule(self.target) if self.target else wrong)
        return wrong


def _scale(bn, factor=1.1):
    bn.weight.mul_(factor)


def _zero_bias(m):
    m.bias.zero_()


def _transpose(conv):
    conv.weight.copy_(conv.weight.transpose(2, 3).clone())


def _skip_batch_norm(bn):
    bn.weight.fill_(1.0), bn.bias.zero_(), bn.running_mean.zero_(), bn.running_var.fill_(1.0 - bn.eps)


def _variance_as_std(bn):  # divides by var + eps where it should divide by sqrt(var + eps)
    bn.running_var.copy_((bn.running_var + bn.eps) ** 2 - bn.eps)


def _rows_off_by_one(fc):
    fc.weight.copy_(fc.weight.roll(1, 0).clone())


def _branch(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The residual branch of a torchvision BasicBlock or Bottleneck, without the final add and ReLU."""
    out = block.relu(block.bn1(block.conv1(x)))
    if isinstance(block, Bottleneck):
        out = block.relu(block.bn2(block.conv2(out)))
        return block.bn3(block.conv3(out))
    return block.bn2(block.conv2(out))


def _shortcut(block, x):
    return block.downsample(x) if block.downsample is not None else x


def _no_final_relu(block):
    block.forward = lambda x: _branch(block, x) + _shortcut(block, x)


def _no_residual(block):
    block.forward = lambda x: block.relu(_branch(block, x))


def shift_window(x: torch.Tensor, dims: tuple[int, int] = (2, 3)) -> torch.Tensor:
    """`x` moved one pixel down and right, zeros coming in: a 3x3 convolution of it is the convolution padded 2
    above and left and 0 below and right, the window one pixel off."""
    h, w = x.shape[dims[0]], x.shape[dims[1]]
    pad = [0] * (2 * x.dim())
    for d in dims:  # F.pad lists the last dimension first
        pad[2 * (x.dim() - 1 - d)] = 1
    return F.pad(x, pad).narrow(dims[0], 0, h).narrow(dims[1], 0, w)


def _shifted_padding(conv):
    plain = conv.forward
    conv.forward = lambda x: plain(shift_window(x))


FORWARD = (
    Mutant("bn-scale-x1.1-early", "a batch-norm scale 10% off, first layer of the first branch", "weights",
           "layer1.0.bn1", _scale),
    Mutant("bn-scale-x1.1-mid", "a batch-norm scale 10% off, mid-network", "weights", "layer3.1.bn2", _scale),
    Mutant("bn-scale-x1.1-late", "a batch-norm scale 10% off, in the last stage", "weights", "layer4.1.bn1", _scale),
    Mutant("bn-bias-dropped", "a batch-norm's bias not added", "weights", "layer2.0.bn1", _zero_bias),
    Mutant("bn-variance-as-std", "a batch-norm divides by its variance, not its standard deviation", "weights",
           "layer2.1.bn1", _variance_as_std),
    Mutant("downsample-bn-skipped", "a downsample's batch-norm not applied", "weights", "layer2.0.downsample.1",
           _skip_batch_norm),
    Mutant("fc-bias-dropped", "the classifier's bias not added", "weights", "fc", _zero_bias),
    Mutant("fc-rows-off-by-one", "the classifier's weight rows read one class off", "weights", "fc",
           _rows_off_by_one),
    Mutant("3x3-transposed", "a 3x3 kernel read transposed (kw, kh)", "weights", "layer3.0.conv2", _transpose),
    Mutant("input-bgr", "the input's channels read as BGR", "input"),
    Mutant("relu-dropped", "a block's final ReLU not applied", "structure", "layer3.1", _no_final_relu),
    Mutant("residual-dropped", "a block's residual add not done", "structure", "layer2.1", _no_residual),
    Mutant("padding-off-by-one", "a 3x3 convolution padded 2/0 instead of 1/1 (its window one pixel off)",
           "structure", "layer1.0.conv2", _shifted_padding),
)


def mutant_input(mutant: Mutant, x: torch.Tensor) -> torch.Tensor:
    """The input a rung is fed under `mutant` (channels reversed for input-bgr)."""
    return x.flip(1) if mutant.kind == "input" else x


def _hook(select: Callable[[str], bool], grad: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    def install(model: torch.nn.Module) -> None:
        for name, p in model.named_parameters():
            if select(name):
                p.register_hook(grad)
    return install


def _is_batch_norm_scale(name: str) -> bool:
    return name.endswith("weight") and (".bn" in name or name.startswith("bn") or "downsample.1" in name)


# Training mutants: gradient hooks installed on the model whose step runs (each gets the parameter's gradient).
TRAINING = (
    Mutant("block-branch-grads-zeroed", "one block's branch convolutions get no weight gradient", "gradient",
           "layer2.1", _hook(lambda n: n.startswith("layer2.1.conv"), torch.zeros_like)),
    Mutant("weight-grads-x0.7", "every weight gradient 0.7 of what it should be", "gradient", "",
           _hook(lambda n: n.endswith("weight") and not _is_batch_norm_scale(n), lambda g: g * 0.7)),
    Mutant("bn-scale-grad-dropped", "batch-norm's scale gets no gradient", "gradient", "",
           _hook(_is_batch_norm_scale, torch.zeros_like)),
    Mutant("layer4-grads-zeroed", "layer4 gets no gradient", "gradient", "layer4",
           _hook(lambda n: n.startswith("layer4."), torch.zeros_like)),
)

RIGHT = Mutant("none", "the right network", "none")


def check_names(names: list[str], suite: tuple[Mutant, ...]) -> list[Mutant]:
    """The mutants of `suite` named in `names` (all of them for an empty list); a clear error names the valid."""
    known = {m.name: m for m in suite}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown mutant {unknown[0]!r}; valid: {', '.join(known)}")
    return [known[n] for n in names] if names else list(suite)
