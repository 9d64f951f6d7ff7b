"""SGD with momentum and coupled weight decay, as torch.optim.SGD(momentum, weight_decay) computes it, over every
parameter at once (issue 60's training step): the parameters, their gradients and their momentum buffers each live
in one flat fp32 buffer (the tensors are views of it), so one launch updates the whole network.

  g = grad + weight_decay * p;  buf = g on the first step, else momentum * buf + g;  p = p - lr * buf

The first step needs no flag of its own: from a zeroed buffer, momentum * 0 + g is g exactly, so one kernel (and
one captured step, CUDA graphs) serves every step.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _sgd_kernel(p_ptr, g_ptr, buf_ptr, n, lr_ptr, momentum, weight_decay, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    lr = tl.load(lr_ptr)
    p = tl.load(p_ptr + offs, mask=ok)
    g = tl.load(g_ptr + offs, mask=ok) + weight_decay * p
    buf = momentum * tl.load(buf_ptr + offs, mask=ok) + g
    tl.store(buf_ptr + offs, buf, mask=ok)
    tl.store(p_ptr + offs, p - lr * buf, mask=ok)


def sgd_step(params: torch.Tensor, grads: torch.Tensor, momentum_buffer: torch.Tensor, lr: torch.Tensor,
             momentum: float, weight_decay: float) -> None:
    """Updates the flat fp32 `params` and `momentum_buffer` (zeros before the first step) in place from the flat
    `grads`. `lr`: a one-element fp32 tensor on their device, read by the kernel: a schedule changes it in place
    without a host sync, and a captured step replays with the new rate."""
    n = params.numel()
    _sgd_kernel[(triton.cdiv(n, BLOCK),)](params, grads, momentum_buffer, n, lr, momentum, weight_decay, BLOCK)
