"""Cross-entropy over a batch of logits, forward and backward in one kernel (issue 60's training step): per row,
the loss -log softmax(z)[label], and the gradient of the batch's mean loss, (softmax(z) - onehot(label)) / N.
One program per row (ResNet's 1000 classes fit one block); the softmax in fp32 from the row's maximum, whatever
the logits' type, as F.cross_entropy does from autocast's bf16 logits."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _cross_entropy_kernel(z_ptr, label_ptr, loss_ptr, dz_ptr, N, CLASSES, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < CLASSES
    z = tl.load(z_ptr + row * CLASSES + offs, mask=ok, other=float("-inf")).to(tl.float32)
    shifted = z - tl.max(z, 0)
    e = tl.where(ok, tl.exp(shifted), 0.0)
    total = tl.sum(e, 0)
    label = tl.load(label_ptr + row)
    tl.store(loss_ptr + row, tl.log(total) - tl.sum(tl.where(offs == label, shifted, 0.0), 0))
    grad = (e / total - (offs == label).to(tl.float32)) / N
    tl.store(dz_ptr + row * CLASSES + offs, grad.to(dz_ptr.dtype.element_ty), mask=ok)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's mean loss (fp32, a 0-d tensor) and its gradient with respect to `logits` [N, classes] (their
    type); `labels` [N] int."""
    n, classes = logits.shape
    losses = torch.empty(n, device=logits.device, dtype=torch.float32)
    grad = torch.empty_like(logits)
    _cross_entropy_kernel[(n,)](logits.contiguous(), labels.contiguous(), losses, grad, n, classes,
                                triton.next_power_of_2(classes))
    return losses.mean(), grad
