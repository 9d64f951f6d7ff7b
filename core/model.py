"""The network every rung computes: a torchvision classifier with seeded weights, shared through one file."""
from __future__ import annotations

from pathlib import Path

import torch
import torchvision
from safetensors.torch import load_file, save_file
from torchvision.models.resnet import BasicBlock, Bottleneck

CLASSIFIERS = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "wide_resnet50_2",
               "resnext50_32x4d", "mobilenet_v2", "mobilenet_v3_large", "efficientnet_b0", "regnet_y_400mf",
               "convnext_tiny", "densenet121", "vgg16")


def check_model(name: str) -> None:
    if name not in CLASSIFIERS:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(CLASSIFIERS)}")


def build_model(name: str, seed: int = 0) -> torch.nn.Module:
    """torchvision's `name` with deterministic weights that make parity meaningful. torchvision leaves batch-norm
    at identity (statistics 0/1, affine 1/0), and a randomly initialised deep network maps every input to nearly
    the same logits: ResNet-50's outputs for two different inputs were 1.5% apart, inside the tf32 and bf16
    tolerances, so a rung that read its input wrongly passed (docs/notes/parity-weights.md). Hence:
    - batch-norm affine terms are random, so that a rung that folds or skips batch-norm wrongly fails parity;
    - each residual branch's last batch-norm scale is small (0.1-0.3, as SkipInit and Fixup damp it), so that
      the deep network is not chaotic: rounding (bf16) moves the logits far less than another input does;
    - batch-norm statistics are those the network measures on seeded N(0,1) inputs (one pass in training mode),
      so that each batch-norm normalises what it meets and the logits depend on the input."""
    check_model(name)
    torch.manual_seed(seed)
    model = torchvision.models.get_model(name, weights=None, num_classes=1000)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                n = m.num_features
                m.weight.copy_(torch.empty(n).uniform_(0.5, 1.5, generator=g))
                m.bias.copy_(torch.empty(n).normal_(0.0, 0.1, generator=g))
        for bn in _residual_branch_ends(model):
            bn.weight.copy_(torch.empty(bn.num_features).uniform_(0.1, 0.3, generator=g))
    return _calibrate_batch_norm(model, g)


def _residual_branch_ends(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The last batch-norm of each residual branch of torchvision's ResNets (none for other models)."""
    return [m.bn3 if isinstance(m, Bottleneck) else m.bn2 for m in model.modules()
            if isinstance(m, (BasicBlock, Bottleneck))]


def _calibrate_batch_norm(model: torch.nn.Module, g: torch.Generator, batch: int = 8,
                          res: int = 224) -> torch.nn.Module:
    """Batch-norm running statistics set to those of one training-mode pass over seeded N(0,1) inputs."""
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average: after one pass, exactly that batch's statistics
    model.train()
    with torch.no_grad():
        model(torch.randn(batch, 3, res, res, generator=g))
    for m in norms:
        m.momentum = 0.1  # torchvision's default, for training cells
        m.num_batches_tracked.zero_()
    return model.eval()


def zero_init_residual(model: torch.nn.Module) -> torch.nn.Module:
    """Each residual branch's last BatchNorm scale set to 0, as torchvision's `zero_init_residual=True` does (the
    usual ResNet training init, which train-to-accuracy trains from): every block starts as its shortcut. Models
    other than torchvision's ResNets are left as they are."""
    return damp_residual(model, 0.0)


# The training cells' start: each residual branch's last BatchNorm scale at a tenth of the run's (0.01-0.03). Not
# zero: from zero no gradient reaches a branch's convolutions in the first step, and a dead backward inside every
# branch passed parity (docs/notes/parity.md). Not the run's own 0.1-0.3: a deep BatchNorm network's first
# gradients are chaotic there (docs/notes/training-parity.md); at a tenth, eager fp32 NHWC and NCHW agree per
# parameter tensor to 0.4%.
TRAIN_BRANCH_DAMPING = 0.1


def training_start(model: torch.nn.Module) -> torch.nn.Module:
    """The weights the ladder's training cells start from (TRAIN_BRANCH_DAMPING)."""
    return damp_residual(model, TRAIN_BRANCH_DAMPING)


def damp_residual(model: torch.nn.Module, factor: float) -> torch.nn.Module:
    """Each residual branch's last BatchNorm scale multiplied by `factor` (torchvision's ResNets; others as they
    are)."""
    with torch.no_grad():
        for bn in _residual_branch_ends(model):
            bn.weight.mul_(factor)
    return model


def weights_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The contract's weights: the state dict in fp32, without the integer `num_batches_tracked` counters."""
    return {k: v.detach().float().contiguous() for k, v in model.state_dict().items()
            if not k.endswith("num_batches_tracked")}


def write_weights(model: torch.nn.Module, path: Path) -> None:
    save_file(weights_state(model), str(path))


def load_model(name: str, weights: Path) -> torch.nn.Module:
    """The model with the run's weights file loaded (how every Python rung starts). Built on the meta device and
    filled by assignment, so no time goes into a random initialisation that the file overwrites."""
    state = load_file(str(weights))
    with torch.device("meta"):
        model = skeleton(name)
        head = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)][-1]
        classes = state[f"{head}.weight"].shape[0] if f"{head}.weight" in state else num_classes(model)
        if classes != num_classes(model):  # a classifier of its own width (train-to-accuracy's data)
            model = skeleton(name, classes)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    counters = [k for k in missing if k.endswith("num_batches_tracked")]
    missing = [k for k in missing if k not in counters]
    if missing or unexpected:
        raise ValueError(f"weights file does not match {name}: missing {missing[:3]}, unexpected {unexpected[:3]}")
    for key in counters:  # not in the file (the contract leaves them out); unused in eval mode
        module, _, buffer = key.rpartition(".")
        setattr(model.get_submodule(module), buffer, torch.zeros((), dtype=torch.long))
    return model.eval()


def skeleton(name: str, classes: int = 1000) -> torch.nn.Module:
    """The architecture with torchvision's default initialisation (build under torch.device('meta') to skip it)."""
    check_model(name)
    return torchvision.models.get_model(name, weights=None, num_classes=classes)


def make_input(batch: int, res: int, seed: int = 0) -> torch.Tensor:
    """The contract's input: NCHW fp32, N(0,1), seeded by (seed, batch, res) so every rung sees the same."""
    g = torch.Generator().manual_seed(hash((seed, batch, res)) & 0x7FFFFFFF)
    return torch.randn(batch, 3, res, res, generator=g)


def write_input(x: torch.Tensor, path: Path) -> None:
    save_file({"input": x.contiguous()}, str(path))


def read_tensor(path: Path, name: str) -> torch.Tensor:
    return load_file(str(path))[name]


def num_classes(model: torch.nn.Module) -> int:
    """Outputs of the classifier: the last linear layer's (every model of CLASSIFIERS ends in one)."""
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1].out_features
