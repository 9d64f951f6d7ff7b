"""`python -m harness train-to-accuracy`: each chosen rung trains the same network from the same seed and weights
for E epochs on real data, with its own training step (the one `--task train` times), and the test accuracy after
every epoch is reported per rung: the seed paper's accuracy table, as a curve.

Data: by default scikit-learn's handwritten digits (1,797 8x8 images shipped inside scikit-learn, no download),
upsampled to --res, with a fixed stratified split (75% train, 25% test); or --data DIR, an ImageFolder tree with
train/ and test/ (or val/) subfolders. Accuracy is always measured the same way, by the eager model in eval mode
loaded with the rung's trained weights, so the curves differ only by the training."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from harness.train import learning_rate
from tiers.base import Cell

DIGITS_SPLIT_SEED = 0


def digits(res: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """(x_train, y_train, x_test, y_test, facts): 3 x res x res images, normalised, from sklearn's digits."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = torch.nn.functional.interpolate(x, size=(res, res), mode="bilinear", align_corners=False)
    x = ((x - x.mean()) / x.std()).expand(-1, 3, -1, -1).contiguous()
    y = torch.tensor(d.target, dtype=torch.long)
    train_idx, test_idx = train_test_split(range(len(y)), test_size=0.25, random_state=DIGITS_SPLIT_SEED,
                                           stratify=d.target)
    facts = {"dataset": "scikit-learn digits (8x8, upsampled bilinearly)", "classes": 10,
             "train_images": len(train_idx), "test_images": len(test_idx),
             "split": f"stratified 75/25, random_state={DIGITS_SPLIT_SEED}"}
    return x[train_idx], y[train_idx], x[test_idx], y[test_idx], facts


def image_folder(root: Path, res: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """An ImageFolder tree (root/train and root/test or root/val), resized to res and held in memory."""
    import torchvision.transforms as T
    from torchvision.datasets import ImageFolder

    test_dir = next((root / d for d in ("test", "val") if (root / d).is_dir()), None)
    if not (root / "train").is_dir() or test_dir is None:
        raise ValueError(f"--data {root}: expected train/ and test/ (or val/) ImageFolder subdirectories")
    tf = T.Compose([T.Resize(res), T.CenterCrop(res), T.ToTensor(),
                    T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])

    def load(d: Path) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
        ds = ImageFolder(str(d), transform=tf)
        xs, ys = zip(*(ds[i] for i in range(len(ds))))
        return torch.stack(xs), torch.tensor(ys), ds.classes

    x_train, y_train, classes = load(root / "train")
    x_test, y_test, test_classes = load(test_dir)
    if classes != test_classes:
        raise ValueError(f"--data {root}: train/ and {test_dir.name}/ have different classes")
    return x_train, y_train, x_test, y_test, {"dataset": f"ImageFolder {root}", "classes": len(classes),
                                              "train_images": len(y_train), "test_images": len(y_test)}


def evaluate(model: torch.nn.Module, state: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
             device: str) -> float:
    """Top-1 test accuracy of the eager model in eval mode carrying `state` (harness.train.state_of's names)."""
    model.load_state_dict({k.split(".", 1)[1]: v for k, v in state.items()}, strict=False)
    model.to(device).eval()
    correct = 0
    with torch.inference_mode():
        for i in range(0, len(y), 256):
            correct += (model(x[i:i + 256].to(device)).argmax(1).cpu() == y[i:i + 256]).sum().item()
    return correct / len(y)


def train_rung(tier: Any, initial: torch.nn.Module, data: tuple, cell: Cell, epochs: int, seed: int,
               on_epoch) -> dict:
    """One rung from `initial`'s weights: E epochs of its training step over shuffled batches (the same order for
    every rung), the test accuracy after each."""
    import copy

    x_train, y_train, x_test, y_test = data
    model = copy.deepcopy(initial).train()
    example = x_train[: cell.batch].to(cell.device)
    if cell.channels_last:
        example = example.contiguous(memory_format=torch.channels_last)
    t = time.perf_counter()
    built = tier.build_train(model, example, cell, lr=learning_rate(cell.batch))
    build_s = time.perf_counter() - t
    evaluator = copy.deepcopy(initial)
    order = torch.Generator().manual_seed(seed)
    curve = []
    for epoch in range(1, epochs + 1):
        t = time.perf_counter()
        perm = torch.randperm(len(y_train), generator=order)
        losses = []
        for i in range(0, len(perm) - cell.batch + 1, cell.batch):  # full batches only: one shape per rung
            idx = perm[i:i + cell.batch]
            x = x_train[idx].to(cell.device)
            if cell.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            losses.append(built.forward(x, y_train[idx].to(cell.device)))
        mean_loss = torch.stack(losses).float().mean().item()  # one sync per epoch
        seconds = time.perf_counter() - t
        acc = evaluate(evaluator, built.state(), x_test, y_test, cell.device)
        curve.append({"epoch": epoch, "test_accuracy": acc, "train_loss": mean_loss, "epoch_s": seconds})
        on_epoch(cell, curve[-1])
    return {"rung": cell.label, "tier": cell.tier, "dtype": cell.dtype, "build_s": build_s, "curve": curve,
            "final_test_accuracy": curve[-1]["test_accuracy"] if curve else None}
