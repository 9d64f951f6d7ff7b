"""One training step, the same for every rung that trains (`--task train`), and its parity over steps.

A step: forward with BatchNorm in training mode (batch statistics; running statistics updated), cross-entropy
against fixed labels, backward, SGD with momentum 0.9 and weight decay 1e-4. fp32 and tf32 are strict; bf16 and fp16
mean autocast over fp32 master weights, fp16 with a gradient scaler. A rung differs only in what runs the forward
(eager, scripted, compiled, C++) or the whole step.

The ladder's steps run at learning rate LEARNING_RATE (a step costs the same at any rate). From the ladder's random
weights the usual 0.1 x batch / 256 is chaotic: on the H100 at ResNet-50 batch 256, eager fp32 in NHWC and in NCHW
(the same step, rounded differently) were 40% apart in conv1's weights after 3 steps (docs/notes/training-parity.md).
train-to-accuracy, which trains for real, uses that usual rate as the peak of its schedule (harness/accuracy.py),
handed to the step as a one-element tensor that it updates before each step (a rate held in a tensor changes without
making torch.compile recompile the step).

Training starts from the run's weights with each residual branch's last BatchNorm scale at a tenth of the run's
(core.model.training_start): from the run's weights themselves the first gradients are chaotic
(docs/notes/training-parity.md), and from zero (the usual ResNet init) no gradient reaches a branch's convolutions
in the first step, so a dead backward there went unseen (docs/notes/parity.md).

Parity: from those weights, K_STEPS steps on the cell's input, each rung against eager fp32 (TF32 off): the
loss of each step, the weights' update (the K steps' change, which a small rate keeps small next to the weights)
over all parameters and of every parameter tensor on its own (each convolution, each BatchNorm's scale and bias,
the classifier), and the running statistics."""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.nn.functional as F

from core.cell import Built

K_STEPS = 3
LEARNING_RATE = 1e-3
MOMENTUM, WEIGHT_DECAY = 0.9, 1e-4
AMP = {"bf16": torch.bfloat16, "fp16": torch.float16}

# Per dtype: the largest allowed relative error of each step's loss (|loss - ref| / |ref|), of the weights' update
# over all parameters at once (||(w - w0) - (w_ref - w0)|| / ||w_ref - w0||) and of the running statistics (per
# tensor ||x - ref|| / ||ref||, the largest); and `gain`, how far from 1 each parameter tensor's update may be
# when projected on eager's (<u, u_ref> / <u_ref, u_ref>). fp32 differs from the reference in summation order only
# (other kernels, layouts, cuDNN's non-deterministic backward); tf32 and autocast round every product of the
# backward too. Rounding is noise across a tensor's elements, so it moves a tensor's update by up to 20% in bf16 but
# its gain by under 5%, while a gradient that is dropped, zeroed or scaled moves the gain of its tensor to 0 or to
# the scale. On the CPU (resnet50, batch 8, res 64, from core.model.training_start) eager bf16's gains lay in
# 0.955-1.018 and fp32's in 0.999-1.000; a block's convolutions or layer4 with no gradient, BatchNorm's scale with
# none, and every weight gradient x0.7 gave 0.0, 0.0, 0.0 and 0.69-0.70 (docs/notes/parity.md). BatchNorm in eval
# mode (first loss), gradients not zeroed (update) and frozen running statistics fail every fp32 cell too
# (tests/test_train.py).
TOLERANCES = {
    "fp32": {"loss": 1e-3, "update": 5e-2, "running_stats": 1e-3, "gain": 0.05},
    "tf32": {"loss": 1e-2, "update": 3e-1, "running_stats": 3e-2, "gain": 0.1},
    "fp16": {"loss": 3e-2, "update": 5e-1, "running_stats": 5e-2, "gain": 0.15},
    "bf16": {"loss": 5e-2, "update": 5e-1, "running_stats": 5e-2, "gain": 0.15},
}


def learning_rate(batch: int) -> float:
    """The usual rate for real training (train-to-accuracy): 0.1 x batch / 256, the linear scaling rule."""
    return 0.1 * batch / 256


def labels(n: int, num_classes: int, device: Any) -> torch.Tensor:
    """Fixed labels spread over the classes (the same for every rung and run)."""
    return (torch.arange(n, device=device) * 7919) % num_classes


def place_for_training(model: torch.nn.Module, cell: Any) -> torch.nn.Module:
    """fp32 master weights on the cell's device and layout, in train mode (autocast does the low precision)."""
    model = model.to(cell.device).train()
    return model.to(memory_format=torch.channels_last) if cell.channels_last else model


def make_step(forward: Callable[[torch.Tensor], torch.Tensor], params_of: torch.nn.Module, cell: Any,
              num_classes: int, lr: float | torch.Tensor | None = None) -> Callable[..., torch.Tensor]:
    """step(x, y=None) -> loss (detached, not synchronised). `forward` runs the model (eager, scripted or
    compiled); `params_of` owns the parameters it trains; y: the labels (default: fixed ones, sliced from a tensor
    of batch + 1, so that another batch size takes the same step); lr: default LEARNING_RATE, or a one-element
    tensor whose value each step reads (a schedule sets it in place)."""
    optimizer = torch.optim.SGD(params_of.parameters(), lr=LEARNING_RATE if lr is None else lr, momentum=MOMENTUM,
                                weight_decay=WEIGHT_DECAY)
    amp = AMP.get(cell.dtype)
    scaler = torch.amp.GradScaler(cell.device) if cell.dtype == "fp16" else None
    targets = labels(cell.batch + 1, num_classes, cell.device)

    def step(x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(cell.device, dtype=amp) if amp else contextlib.nullcontext():
            loss = F.cross_entropy(forward(x), targets[: x.shape[0]] if y is None else y)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        return loss.detach()

    return step


def built_step(forward: Callable[[torch.Tensor], torch.Tensor], params_of: torch.nn.Module, cell: Any,
               num_classes: int, lr: float | torch.Tensor | None = None, stats: dict | None = None) -> Any:
    """What a rung's build_train returns: the step of make_step as `forward`, the state of `params_of`, and the
    memory the rung knows of (besides `stats`)."""
    return Built(forward=make_step(forward, params_of, cell, num_classes, lr), state=lambda: state_of(params_of),
                 stats={**(stats or {}), "memory": memory_split(params_of)})


def state_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and floating-point buffers (running statistics) by name, fp32 on the CPU."""
    out = {f"param.{k}": v.detach().float().cpu().contiguous() for k, v in model.named_parameters()}
    out.update({f"buffer.{k}": v.detach().float().cpu().contiguous() for k, v in model.named_buffers()
                if v.is_floating_point()})
    return out


def memory_split(model: torch.nn.Module) -> dict[str, int]:
    """What the rung knows of its memory: weights, gradients and optimizer state (momentum), in bytes."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"weights_bytes": weights, "gradient_bytes": weights, "optimizer_state_bytes": weights}


def output_tensors(losses: list[torch.Tensor], state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The cell's output file for a training cell: the loss of each parity step, then the state after them."""
    return {"loss": torch.stack([loss.float().cpu() for loss in losses]).contiguous(), **state}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (the absolute error where b is all zeros)."""
    a, b = a.double(), b.double()
    scale = b.norm().item()
    err = (a - b).norm().item()
    return err / scale if scale > 0 else err


def _gain(u: torch.Tensor, ref: torch.Tensor) -> float:
    """<u, ref> / <ref, ref>: the share of eager's update that this update carries (1 where ref is all zeros and u
    is too)."""
    u, ref = u.double().flatten(), ref.double().flatten()
    norm = (ref @ ref).item()
    return (u @ ref).item() / norm if norm > 0 else (1.0 if not u.any() else float("inf"))


def compare(out: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], initial: dict[str, torch.Tensor],
            dtype: str) -> dict:
    """Parity over steps: each step's loss, the relative error of the weights' update over all parameters (from
    `initial`, the run's weights by parameter name), every parameter tensor's gain (the worst group is recorded)
    and the running statistics' largest relative error, with the tensor that has it."""
    tol = TOLERANCES[dtype]
    if set(out) != set(ref):
        missing, extra = sorted(set(ref) - set(out)), sorted(set(out) - set(ref))
        return {"ok": False, "reason": f"state differs from eager's: missing {missing[:3]}, extra {extra[:3]}"}
    if not all(torch.isfinite(t).all() for t in out.values()):
        return {"ok": False, "reason": "loss or state has NaN or Inf"}
    loss_err = [abs(a - b) / abs(b) for a, b in zip(out["loss"].tolist(), ref["loss"].tolist())]
    params = [k for k in ref if k.startswith("param.")]
    update = {k: out[k].double() - initial[k.removeprefix("param.")].double() for k in params}
    update_ref = {k: ref[k].double() - initial[k.removeprefix("param.")].double() for k in params}
    update_err = _rel(torch.cat([update[k].flatten() for k in params]),
                      torch.cat([update_ref[k].flatten() for k in params]))
    per_tensor = {k: _rel(update[k], update_ref[k]) for k in params}
    gains = {k: _gain(update[k], update_ref[k]) for k in params}
    worst_group = max(gains, key=lambda k: abs(gains[k] - 1), default=None)
    stats = {k: _rel(out[k], ref[k]) for k in ref if k.startswith("buffer.")}
    stats_worst = max(stats, key=stats.get, default=None)
    stats_err = stats[stats_worst] if stats_worst else 0.0
    failures = []
    if max(loss_err) > tol["loss"]:
        step = loss_err.index(max(loss_err)) + 1
        failures.append(f"loss rel err {max(loss_err):.2e} > {tol['loss']:.0e} (step {step})")
    if update_err > tol["update"]:
        failures.append(f"update rel err {update_err:.2e} > {tol['update']:.0e}")
    if worst_group and abs(gains[worst_group] - 1) > tol["gain"]:
        off = [k for k in params if abs(gains[k] - 1) > tol["gain"]]
        failures.append(f"{len(off)} parameter tensors' update off eager's by more than {tol['gain']:.0%} in gain "
                        f"(worst {worst_group.removeprefix('param.')}: gain {gains[worst_group]:.3f})")
    if stats_err > tol["running_stats"]:
        failures.append(f"running_stats rel err {stats_err:.2e} > {tol['running_stats']:.0e} ({stats_worst})")
    return {
        "ok": not failures,
        "reason": "; ".join(failures) or None,
        "steps": len(loss_err),
        "loss": out["loss"].tolist(),
        "loss_ref": ref["loss"].tolist(),
        "loss_rel_err": loss_err,
        "rel_err": max(max(loss_err), update_err, stats_err),
        "update_rel_err": update_err,
        "update_worst_tensor": max(per_tensor, key=per_tensor.get, default=None),
        "update_worst_tensor_rel_err": max(per_tensor.values(), default=0.0),
        "worst_group": worst_group and worst_group.removeprefix("param."),
        "worst_group_gain": gains.get(worst_group),
        "worst_group_rel_err": per_tensor.get(worst_group),
        "groups": len(params),
        "running_stats_rel_err": stats_err,
        "running_stats_worst": stats_worst,
        "tolerance": tol,
        "reference": f"eager fp32 (TF32 off), same weights, input and labels, {K_STEPS} steps at lr {LEARNING_RATE}",
    }
