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
eager is read against."""
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
from core.files import write_text_atomic
from core.model import write_weights, zero_init_residual
from core.paths import REPO
from core.placement import set_math_mode
from core.train import learning_rate
from harness.child.contract import ERROR, TRAIN_RESULT_KEYS, WORKER, Protocol, contract_argv
from harness.results.plots import accuracy_curves
from harness.results.tables import markdown_table
from harness.run.context import shipped_tunings
from harness.run.failures import failure_status
from harness.run.plan import command_line
from harness.run.refusal import Refusal
from tiers import all_tiers
from tiers.base import ExternalTier, Tier

DIGITS_SPLIT_SEED = 0
WARMUP_EPOCHS = 2
AGREEMENT_POINTS = 1.5  # issue 28: a rung's curve within this many points of eager's at every epoch
TWIN = "eager"  # the rung trained again as its twins (`twins`)


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
    model.load_state_dict({k.split(".", 1)[1]: v for k, v in state.items()}, strict=False)
    model.to(device).eval()
    correct = 0
    with torch.inference_mode():
        for i in range(0, len(y), 256):
            correct += (model(x[i:i + 256].to(device)).argmax(1).cpu() == y[i:i + 256]).sum().item()
    return correct / len(y)


def plural(n: float, word: str) -> str:
    return f"{n:.3g} {word}{'' if n == 1 else 's'}"


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
    """A rung's training process ended without its result: the reason it said, or how it ended."""


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
    program = tier.command(cell) if isinstance(tier, ExternalTier) else WORKER
    argv = contract_argv(program, cell, files, Protocol(), {
        "train-data": str(workdir / "train.safetensors"), "states": str(states), "lr": repr(rates[0, 0].item()),
        "cache-dir": str(store.cache), "tunings": str(store.tunings or "")})
    proc = procs.run(argv, cwd=workdir if isinstance(tier, ExternalTier) else REPO, env=procs.child_env(),
                     capture_output=True, text=True)
    if proc.returncode != 0:
        said = [line[len(ERROR):] for line in proc.stdout.splitlines() if line.startswith(ERROR)]
        raise ChildFailed(said[-1] if said else failure_status(proc.returncode, None, proc.stderr[-3000:],
                                                               disk=workdir)[1])
    result = json.loads(files["result"].read_text())
    if set(result) != TRAIN_RESULT_KEYS:
        raise RuntimeError(f"{cell.tier} wrote {sorted(result)}, not the contract's {sorted(TRAIN_RESULT_KEYS)}")
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
    results, skipped, failed = [], {}, {}
    for name, layout, options in runs:
        tier = all_tiers()[name]
        cell = Cell(tier=name, model=config.model, batch=config.batch, res=config.res, dtype=dtype,
                    channels_last=layout, device=device, task="train", options=options)
        label = (f"{name} ({cell.layout})" if layout != channels_last else
                 f"{name} ({', '.join(f'{k}={v}' for k, v in options)})" if options else name)
        reason = tier.availability(device) or tier.supports(cell)
        if reason:
            skipped[label] = reason
            console.print(f"{label}: skipped: {reason}", markup=False, style="yellow")
            continue
        store = Store(cache=out / "cache" / name, tunings=shipped_tunings(gpu, name))
        store.cache.mkdir(parents=True, exist_ok=True)
        try:
            result = train_in_child(tier, initial, data_split, cell, order, rates, store,
                                    out / "programs" / f"{name}-{cell.layout}", show_epoch(console, label))
            results.append({**result, "rung": label, "layout": cell.layout, "options": dict(options)})
        except Exception as e:  # a rung that fails costs its own curve, not the others'
            failed[label] = " ".join((str(e) if isinstance(e, ChildFailed) else f"{type(e).__name__}: {e}").split())
            console.print(f"{label}: failed: {failed[label]}", markup=False, style="red")
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
           "failed": failed}
    write(doc, out, console)


def agreement(results: list[dict], reference: str) -> dict:
    """Per rung, its distance from `reference`'s curve in points at each epoch, the epochs beyond
    AGREEMENT_POINTS, and of those the ones beyond the band at that epoch: the farthest distance of the
    reference's twins (what rounding alone moved the curve by there); {} without the reference's curve."""
    ref = next((r for r in results if r["rung"] == reference), None)
    if ref is None:
        return {}
    twins = [r for r in results if r["tier"] == reference and r is not ref]

    def distance(r: dict) -> list[float]:
        return [round(100 * abs(a["test_accuracy"] - b["test_accuracy"]), 2) for a, b in zip(r["curve"], ref["curve"])]

    band = [max(epoch) for epoch in zip(*map(distance, twins))] if twins else None
    out = {}
    for r in results:
        if r is ref:
            continue
        points = distance(r)
        beyond = [e for e, d in enumerate(points, start=1) if d > AGREEMENT_POINTS]
        out[r["rung"]] = {
            "twin": r in twins, "points": points, "max_points": max(points, default=0.0), "epochs": len(points),
            "epochs_beyond": beyond,
            "epochs_beyond_twin": None if band is None or r in twins else
            [e for e in beyond if points[e - 1] > band[e - 1]],
        }
    return out


def show_epoch(console: Console, label: str):
    """The live line of each epoch as it ends."""
    return lambda e: console.print(f"  {label:14s} epoch {e['epoch']:2d}: test accuracy "
                                      f"{100 * e['test_accuracy']:5.1f}%, train loss {e['train_loss']:.3f}, "
                                      f"{e['epoch_s']:.1f} s", markup=False)


def write(doc: dict, out: Path, console: Console) -> None:
    """accuracy.json, accuracy.md (test accuracy per epoch, a row per epoch and a column per rung, then each rung's
    agreement with eager) and the plot; one line per rung."""
    results, data = doc["rungs"], doc["data"]
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "accuracy.json", json.dumps(doc, indent=1))
    plot = accuracy_curves(doc, out / "plots" / "accuracy.png") if results else None
    table = [{"epoch": str(e + 1), **{r["rung"]: f"{100 * r['curve'][e]['test_accuracy']:.1f}"
                                      for r in results if e < len(r["curve"])}}
             for e in range(max((len(r["curve"]) for r in results), default=0))]
    lines = [f"# Train to accuracy: {doc['model']} on {data['dataset']}", "",
             f"{data['train_images']} training and {data['test_images']} test images, {data['classes']} classes; "
             f"{doc['epochs']} epochs at batch {doc['batch']}, res {doc['res']}, {doc['dtype']}, on {doc['device']}, "
             f"seed {doc['seed']}. Recipe: {doc['recipe']}. Test accuracy (top-1, %) after each epoch:", "",
             *markdown_table(table), ""]
    summary = [{"rung": r["rung"], "final %": f"{100 * r['final_test_accuracy']:.1f}",
                **agreement_columns(doc["agreement"].get(r["rung"])),
                "train s": f"{sum(c['epoch_s'] for c in r['curve']):.1f}", "build s": f"{r['build_s']:.1f}"}
               for r in results]
    if summary:
        lines += [f"Each rung against {TWIN}: the largest distance in points, the epochs farther than "
                  f"{AGREEMENT_POINTS} points, and of those the ones farther than the farthest of {TWIN}'s twins was "
                  f"at that epoch (the same step rounded differently: {TWIN} in the other layout, and on the GPU "
                  f"with cuDNN's benchmark mode off; '-': no twin).", "",
                  *markdown_table(summary), ""]
    lines += [f"- {name}: skipped: {reason}" for name, reason in doc["skipped"].items()]
    lines += [f"- {name}: failed: {reason}" for name, reason in doc.get("failed", {}).items()]
    if plot:
        lines += ["", "![test accuracy per epoch](plots/accuracy.png)", ""]
    write_text_atomic(out / "accuracy.md", "\n".join(lines))
    for r in results:
        console.print(f"{r['rung']}: {100 * r['final_test_accuracy']:.1f}% test accuracy after "
                      f"{plural(doc['epochs'], 'epoch')}", markup=False)
    console.print(f"JSON: {out / 'accuracy.json'}  markdown: {out / 'accuracy.md'}", markup=False)


def agreement_columns(a: dict | None) -> dict[str, str]:
    """The summary table's columns for one rung's agreement with eager (empty for eager itself)."""
    if a is None:
        return {"max pts": "", f"> {AGREEMENT_POINTS} pts": "", "> twin": ""}

    def epochs(es: list[int] | None) -> str:  # how many, and the first six of them
        if not es:
            return "-" if es is None else "0"
        return f"{len(es)} ({', '.join(map(str, es[:6]))}{', ...' if len(es) > 6 else ''})"

    return {"max pts": f"{a['max_points']:.1f}", f"> {AGREEMENT_POINTS} pts": epochs(a["epochs_beyond"]),
            "> twin": epochs(a["epochs_beyond_twin"])}
