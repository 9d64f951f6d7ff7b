"""`python -m harness train-to-accuracy`: each chosen rung trains the same network from the same seed and weights
for E epochs on real data, with its own training step (the one `--task train` times), and the test accuracy after
every epoch is reported per rung: the seed paper's accuracy table, as a curve. Each rung trains in a process of its
own, as a ladder cell runs (the C++ rungs in their programs, the Python rungs in the ladder's worker), on the same
images in the same batch order, handed over through the child contract (`--train-data`), and writes its state
after each epoch.

Data: by default scikit-learn's handwritten digits (1,797 8x8 images shipped inside scikit-learn, no download),
upsampled to --res, with a fixed stratified split (75% train, 25% test); or --data DIR, an ImageFolder tree with
train/ and test/ (or val/) subfolders. Accuracy is always measured the same way, by the eager model in eval mode
loaded with the rung's trained weights, so the curves differ only by the training.

The recipe is the usual one for a ResNet: each residual branch zero-initialised, SGD with momentum and weight decay
(core/train.py's step), the rate warmed up linearly to 0.1 x batch / 256 over the first epochs and then decayed to
zero along a cosine. From torchvision's initialisation at a constant rate, ResNet-50 on the digits diverged in its
first epoch (train loss 13) and never settled, so that two correct rungs ended tens of points apart
(docs/notes/train-to-accuracy.md).

Two correct trainings that round differently drift apart while the network learns fast, and meet again once it
has converged. So eager is also trained as its twins, the same step rounded differently: in the other layout (other
kernels), and on the GPU with cuDNN's benchmark mode off (other convolution algorithms). At each epoch the farthest
twin's distance from eager is what rounding alone moves the curve by there, the band a rung's own distance from
eager is read against.

`--infer RUNG:DTYPE,...` then evaluates the network eager trained (its last epoch's weights) on the test set with
each of those inference cells, in the worker as any cell (--eval-data), beside eager in strict fp32: each cell's
top-1 accuracy and the share of images whose top-1 it gives as eager fp32 does (issue 58: what fp8 keeps of a
trained network's answers). An fp8 cell calibrates its scales on training images, never on the test set; shapes
missing from the tuning tables run untuned (accuracy, not speed, is judged)."""
from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torchvision
from rich.console import Console
from safetensors.torch import load_file, save_file

from core import proc as procs
from core.cell import Cell, Store
from core.env import default_device, device_slug, environment
from core.model import write_weights, zero_init_residual
from core.paths import REPO
from core.placement import set_math_mode
from core.train import learning_rate
from harness.child.contract import ERROR, EVAL_RESULT_KEYS, TRAIN_RESULT_KEYS, WORKER, Protocol, contract_argv
from harness.results.accuracy_report import AGREEMENT_POINTS, TWIN, agreement, plural, write
from harness.run.context import shipped_tunings
from harness.run.failures import failure_status
from harness.run.plan import command_line
from harness.run.refusal import Refusal
from tiers import all_tiers
from tiers.base import ExternalTier, Tier

DIGITS_SPLIT_SEED = 0
WARMUP_EPOCHS = 2
REFERENCE_CELL = ("eager", "fp32")  # --infer's reference: every cell's top-1 is compared with its top-1
CALIBRATION_IMAGES = 512  # the training images an fp8 cell of --infer calibrates on


def twins(device: str, channels_last: bool) -> list[tuple[bool, tuple[tuple[str, str], ...]]]:
    """(layout, options) of each twin of TWIN: the other layout; on the GPU also cuDNN's benchmark mode off (on by
    default: tiers/base.py CUDNN_BENCHMARK), which picks other convolution algorithms."""
    return [(not channels_last, ())] + ([(channels_last, (("cudnn-benchmark", "off"),))] if device == "cuda" else [])


def digits(res: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """(x_train, y_train, x_test, y_test, facts): 3 x res x res images, normalised, from sklearn's digits."""
    from sklearn.datasets import load_digits  # scikit-learn: only for the digits
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
    import torchvision.transforms as T  # only for --data
    from torchvision.datasets import ImageFolder

    if not root.exists():
        raise ValueError(f"--data {root}: does not exist")
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
    """Top-1 test accuracy of the eager model in eval mode carrying `state` (core.train.state_of's names)."""
    load_state(model, state)
    model.to(device).eval()
    correct = 0
    with torch.inference_mode():
        for i in range(0, len(y), 256):
            correct += (model(x[i:i + 256].to(device)).argmax(1).cpu() == y[i:i + 256]).sum().item()
    return correct / len(y)


def load_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """A rung's written state (core.train.state_of's `param.NAME` and `buffer.NAME`) into `model`."""
    model.load_state_dict({k.split(".", 1)[1]: v for k, v in state.items()}, strict=False)


def learning_rates(peak: float, epochs: int, steps: int, warmup_epochs: int = WARMUP_EPOCHS) -> torch.Tensor:
    """[epochs, steps]: each step's rate, rising linearly to `peak` over the first warmup_epochs (at most half the
    run), then falling to zero along a cosine (Goyal et al.'s warm-up, Loshchilov and Hutter's decay)."""
    total = epochs * steps
    warm = min(warmup_epochs * steps, total // 2)
    rates = [peak * (k + 1) / warm if k < warm else
             peak * 0.5 * (1 + math.cos(math.pi * (k - warm) / (total - warm))) for k in range(total)]
    return torch.tensor(rates, dtype=torch.float64).view(epochs, steps)


def batch_order(images: int, batch: int, epochs: int, seed: int) -> torch.Tensor:
    """[epochs, steps x batch]: each epoch's shuffled image indices, cut to full batches (one shape per rung); the
    same for every rung."""
    order = torch.Generator().manual_seed(seed)
    steps = images // batch
    return torch.stack([torch.randperm(images, generator=order)[:steps * batch] for _ in range(epochs)])


class ChildFailed(Exception):
    """A rung's process ended without its result: the reason it said, or how it ended."""


def run_child(tier: Tier, cell: Cell, files: dict[str, Path], extra: dict[str, str], workdir: Path,
              keys: frozenset[str], **env: str) -> dict:
    """One cell's child on data (the rung's program, or for a Python rung the ladder's worker): its result file,
    which must hold `keys`; ChildFailed with the reason it said, or how it ended."""
    program = tier.command(cell) if isinstance(tier, ExternalTier) else WORKER
    proc = procs.run(contract_argv(program, cell, files, Protocol(), extra),
                     cwd=workdir if isinstance(tier, ExternalTier) else REPO, env=procs.child_env(**env),
                     capture_output=True, text=True)
    if proc.returncode != 0:
        said = [line[len(ERROR):] for line in proc.stdout.splitlines() if line.startswith(ERROR)]
        raise ChildFailed(said[-1] if said else failure_status(proc.returncode, None, proc.stderr[-3000:],
                                                               disk=workdir)[1])
    result = json.loads(files["result"].read_text())
    if set(result) != keys:
        raise RuntimeError(f"{cell.tier} wrote {sorted(result)}, not the contract's {sorted(keys)}")
    return result


def train_in_child(tier: Tier, initial: torch.nn.Module, data: tuple, cell: Cell, order: torch.Tensor,
                   rates: torch.Tensor, store: Store, workdir: Path, on_epoch) -> dict:
    """A rung in a process of its own, as every ladder cell runs (a crash or an error costs its curve, with its
    reason): the rung's program, or for a Python rung the ladder's worker, takes the same weights, images, batch
    order and rates through the contract (--train-data), trains with the rung's own step and writes its state after
    each epoch, which is evaluated here the same way for every rung."""
    x_train, y_train, x_test, y_test = data
    states = workdir / "states"
    states.mkdir(parents=True, exist_ok=True)
    files = {"weights": workdir / "weights.safetensors", "input": workdir / "input.safetensors",
             "output": workdir / "output.safetensors", "result": workdir / "result.json"}
    write_weights(initial, files["weights"])
    save_file({"input": x_train[:cell.batch].float().contiguous()}, str(files["input"]))
    save_file({"x": x_train.float().contiguous(), "y": y_train.float(), "order": order.float(), "lr": rates.float()},
              str(workdir / "train.safetensors"))
    t = time.perf_counter()
    result = run_child(tier, cell, files, {
        "train-data": str(workdir / "train.safetensors"), "states": str(states), "lr": repr(rates[0, 0].item()),
        "cache-dir": str(store.cache), "tunings": str(store.tunings or "")}, workdir, TRAIN_RESULT_KEYS)
    evaluator = copy.deepcopy(initial)
    curve = []
    for e in result["epochs"]:
        state = load_file(str(states / f"epoch-{e['epoch']}.safetensors"))
        curve.append({"epoch": e["epoch"], "test_accuracy": evaluate(evaluator, state, x_test, y_test, cell.device),
                      "train_loss": e["train_loss"], "epoch_s": e["seconds"]})
        on_epoch(curve[-1])
    return {"tier": cell.tier, "dtype": cell.dtype, "build_s": result["cold"]["build_s"],
            "program_s": time.perf_counter() - t, "curve": curve,
            "final_test_accuracy": curve[-1]["test_accuracy"] if curve else None}


def store_or_skip(tier: Tier, cell: Cell, label: str, out: Path, gpu: str | None, skipped: dict[str, str],
                  console: Console, why_not: str | None = None) -> Store | None:
    """The cell's store (its rung's cache under the run, the tunings shipped for this GPU), or None once the reason
    it cannot run here is in `skipped` and on the terminal."""
    reason = tier.availability(cell.device) or tier.supports(cell) or why_not
    if reason:
        skipped[label] = reason
        console.print(f"{label}: skipped: {reason}", markup=False, style="yellow")
        return None
    store = Store(cache=out / "cache" / cell.tier, tunings=shipped_tunings(gpu, cell.tier))
    store.cache.mkdir(parents=True, exist_ok=True)
    return store


def record_failure(e: Exception, label: str, failed: dict[str, str], console: Console) -> None:
    """A cell that failed costs its own curve or row, with the reason, in `failed` and on the terminal."""
    failed[label] = " ".join((str(e) if isinstance(e, ChildFailed) else f"{type(e).__name__}: {e}").split())
    console.print(f"{label}: failed: {failed[label]}", markup=False, style="red")


def infer_in_child(tier: Tier, network: torch.nn.Module, x_test: torch.Tensor, x_calibration: torch.Tensor,
                   cell: Cell, store: Store, workdir: Path) -> tuple[torch.Tensor, dict]:
    """A rung's forward of `network` over every test image in a process of its own (--eval-data); its logits, and
    its build and evaluation times."""
    workdir.mkdir(parents=True, exist_ok=True)
    files = {"weights": workdir / "weights.safetensors", "input": workdir / "input.safetensors",
             "output": workdir / "output.safetensors", "result": workdir / "result.json"}
    write_weights(network, files["weights"])
    save_file({"input": x_test[:cell.batch].float().contiguous()}, str(files["input"]))
    save_file({"x": x_test.float().contiguous()}, str(workdir / "test.safetensors"))
    save_file({"x": x_calibration.float().contiguous()}, str(workdir / "calibration.safetensors"))
    t = time.perf_counter()
    result = run_child(tier, cell, files, {
        "eval-data": str(workdir / "test.safetensors"), "calibration": str(workdir / "calibration.safetensors"),
        "cache-dir": str(store.cache), "tunings": str(store.tunings or "")}, workdir, EVAL_RESULT_KEYS,
        LADDER_NO_AUTOTUNE="1")
    return load_file(str(files["output"]))["output"], {"build_s": result["cold"]["build_s"],
                                                       "program_s": time.perf_counter() - t}


def infer_trained(config: "AccuracyConfig", initial: torch.nn.Module, state: Path, data: tuple, device: str,
                  gpu: str | None, out: Path, console: Console) -> dict:
    """--infer: the network of `state` (eager's last epoch) evaluated on the test set by each inference cell and
    by REFERENCE_CELL first; each cell's top-1 accuracy and its top-1 agreement with the reference's."""
    x_train, _, x_test, y_test = data
    network = copy.deepcopy(initial)
    load_state(network, load_file(str(state)))
    cells, skipped, failed = [], {}, {}
    reference = None  # the reference cell's top-1; without it, no cell has an agreement
    for name, dtype in [REFERENCE_CELL, *(c for c in config.infer if c != REFERENCE_CELL)]:
        label = f"{name} {dtype}"
        tier = all_tiers()[name]
        cell = Cell(tier=name, model=config.model, batch=config.batch, res=config.res, dtype=dtype,
                    channels_last=device == "cuda", device=device)
        store = store_or_skip(tier, cell, label, out, gpu, skipped, console, why_not=(
            f"{name} is a program of its own; evaluation on data runs the Python rungs' worker"
            if isinstance(tier, ExternalTier) else None))
        if store is None:
            continue
        try:
            logits, times = infer_in_child(tier, network, x_test, x_train[:CALIBRATION_IMAGES], cell, store,
                                           out / "programs" / f"infer-{name}-{dtype}")
        except Exception as e:  # a cell that fails costs its own row
            record_failure(e, label, failed, console)
            continue
        top1 = logits.argmax(1)
        if (name, dtype) == REFERENCE_CELL:
            reference = top1
        agreement = None if reference is None else (top1 == reference).float().mean().item()
        cells.append({"rung": name, "dtype": dtype, "test_accuracy": (top1 == y_test).float().mean().item(),
                      "agreement": agreement, **times})
        console.print(f"  {label:14s} test accuracy {100 * cells[-1]['test_accuracy']:5.1f}%"
                      + ("" if agreement is None else
                         f", top-1 as {' '.join(REFERENCE_CELL)}'s on {100 * agreement:5.1f}% of the images"),
                      markup=False)
    return {"network": f"eager's after epoch {config.epochs}", "reference": " ".join(REFERENCE_CELL),
            "calibration": f"the first {min(CALIBRATION_IMAGES, len(x_train))} training images",
            "batch": config.batch, "cells": cells, "skipped": skipped, "failed": failed}


@dataclass
class AccuracyConfig:
    """What `python -m harness train-to-accuracy` takes; None means the device's default."""

    tiers: list[str]
    model: str = "resnet18"
    epochs: int = 30
    batch: int = 64
    res: int = 32
    dtype: str | None = None
    data: Path | None = None
    device: str | None = None
    seed: int = 0
    out: Path | None = None
    infer: list[tuple[str, str]] = field(default_factory=list)  # (rung, dtype): the trained network evaluated by each
    argv: list[str] = field(default_factory=list)  # the command line that made it (recorded with the results)


def run(config: AccuracyConfig) -> None:
    """Trains each rung that can from one seed and one set of weights; accuracy.json, accuracy.md and the plot."""
    device = config.device or default_device()
    if device == "cuda" and default_device() != "cuda":
        raise Refusal("--device cuda: no NVIDIA GPU visible (NVML found none); valid here: cpu")
    dtype = config.dtype or ("bf16" if device == "cuda" else "fp32")
    out = (config.out or Path("runs") / f"accuracy-{config.model}-{device}").resolve()
    try:
        x_train, y_train, x_test, y_test, data = (image_folder(config.data, config.res) if config.data
                                                  else digits(config.res))
    except (ValueError, OSError) as e:
        raise Refusal(str(e)) from None
    if config.batch > len(y_train):
        raise Refusal(f"--batch {config.batch} exceeds the {len(y_train)} training images")
    if config.infer and TWIN not in config.tiers:
        raise Refusal(f"--infer evaluates the network {TWIN} trains: add {TWIN} to --tiers")
    console = Console()
    torch.manual_seed(config.seed)
    initial = zero_init_residual(torchvision.models.get_model(config.model, weights=None,
                                                              num_classes=data["classes"]))
    set_math_mode(dtype)
    order = batch_order(len(y_train), config.batch, config.epochs, config.seed)
    rates = learning_rates(learning_rate(config.batch), config.epochs, order.shape[1] // config.batch)
    env = environment(device)
    gpu = device_slug(env) if device == "cuda" else None
    data_split = (x_train, y_train, x_test, y_test)
    channels_last = device == "cuda"
    runs = [(name, channels_last, ()) for name in config.tiers]
    if TWIN in config.tiers:
        runs += [(TWIN, layout, options) for layout, options in twins(device, channels_last)]
    results, skipped, failed, states = [], {}, {}, {}
    for name, layout, options in runs:
        tier = all_tiers()[name]
        cell = Cell(tier=name, model=config.model, batch=config.batch, res=config.res, dtype=dtype,
                    channels_last=layout, device=device, task="train", options=options)
        label = (f"{name} ({cell.layout})" if layout != channels_last else
                 f"{name} ({', '.join(f'{k}={v}' for k, v in options)})" if options else name)
        store = store_or_skip(tier, cell, label, out, gpu, skipped, console)
        if store is None:
            continue
        workdir = out / "programs" / "-".join([name, cell.layout, *(f"{k}={v}" for k, v in options)])
        try:
            result = train_in_child(tier, initial, data_split, cell, order, rates, store, workdir,
                                    show_epoch(console, label))
            results.append({**result, "rung": label, "layout": cell.layout, "options": dict(options)})
            states[label] = workdir / "states" / f"epoch-{config.epochs}.safetensors"
        except Exception as e:  # a rung that fails costs its own curve, not the others'
            record_failure(e, label, failed, console)
    inference = None
    if config.infer:
        inference = (infer_trained(config, initial, states[TWIN], data_split, device, gpu, out, console)
                     if TWIN in states else {"skipped_all": f"{TWIN} trained no network to evaluate"})
    warm = (int(rates.argmax()) + 1) / rates.shape[1]  # the epochs the schedule rose over (at most half the run)
    doc = {"model": config.model, "device": device, "dtype": dtype, "epochs": config.epochs, "batch": config.batch,
           "res": config.res, "seed": config.seed, "data": data, "environment": env,
           "recipe": f"torchvision's initialisation with each residual branch's last BatchNorm scale at zero; the "
                     f"step of core/train.py (SGD, momentum 0.9, weight decay 1e-4) at a rate warmed up linearly "
                     f"to 0.1 x batch / 256 = {learning_rate(config.batch):g} over the first {plural(warm, 'epoch')} "
                     f"(at most half the run), then decayed to zero along a cosine; full shuffled batches; accuracy by "
                     f"the eager model in eval mode with the rung's weights",
           "learning_rates": rates.tolist(), "command": command_line(config.argv), "rungs": results,
           "agreement": agreement(results, TWIN), "agreement_points": AGREEMENT_POINTS, "skipped": skipped,
           "failed": failed, "inference": inference}
    write(doc, out, console)


def show_epoch(console: Console, label: str):
    """The live line of each epoch as it ends."""
    return lambda e: console.print(f"  {label:14s} epoch {e['epoch']:2d}: test accuracy "
                                      f"{100 * e['test_accuracy']:5.1f}%, train loss {e['train_loss']:.3f}, "
                                      f"{e['epoch_s']:.1f} s", markup=False)

