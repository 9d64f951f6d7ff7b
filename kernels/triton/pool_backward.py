"""The pools of a training step over NHWC tensors (issue 60): the stem's max-pool forward that also keeps where
each maximum was, its backward, and the head's global-average-pool backward.

The max-pool's backward gathers rather than scatters: each input pixel visits the few windows that contain it
(at most 4 for 3x3/s2) in a fixed order and adds the gradient of those whose maximum it was. No atomics, so the
result is the same bits every call; the rule for ties is PyTorch's (the first maximum of the window in row-major
order), which the forward records as the window position (one byte) of each output.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_P, BLOCK_C = 32, 32


@triton.jit
def _tile(P, C, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's tile of pixels (axis 0) and channels (axis 1), and which of them exist."""
    offs_p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    return offs_p, offs_c, offs_p < P, offs_c < C


@triton.jit
def _max_pool_forward_kernel(x_ptr, y_ptr, pos_ptr, P, H, W, C, OH, OW, K: tl.constexpr, STRIDE: tl.constexpr,
                             PAD: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    offs_p, offs_c, p_ok, c_ok = _tile(P, C, BLOCK_P, BLOCK_C)  # output pixels (n, oh, ow)
    n, oh, ow = offs_p // (OH * OW), (offs_p // OW) % OH, offs_p % OW
    best = tl.full((BLOCK_P, BLOCK_C), float("-inf"), tl.float32)
    where = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.int32)
    for tap in tl.static_range(K * K):  # row-major: a later tap wins only if strictly larger (the first maximum)
        ih, iw = oh * STRIDE - PAD + tap // K, ow * STRIDE - PAD + tap % K
        inside = p_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        v = tl.load(x_ptr + (((n * H + ih) * W + iw) * C)[:, None] + offs_c[None, :],
                    mask=inside[:, None] & c_ok[None, :], other=float("-inf")).to(tl.float32)
        larger = v > best
        best = tl.where(larger, v, best)
        where = tl.where(larger, tap, where)
    ok = p_ok[:, None] & c_ok[None, :]
    at = offs_p[:, None] * C + offs_c[None, :]
    tl.store(y_ptr + at, best.to(y_ptr.dtype.element_ty), mask=ok)
    tl.store(pos_ptr + at, where.to(tl.int8), mask=ok)


@triton.jit
def _max_pool_backward_kernel(dy_ptr, pos_ptr, dx_ptr, P, H, W, C, OH, OW, K: tl.constexpr, STRIDE: tl.constexpr,
                              PAD: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    offs_p, offs_c, p_ok, c_ok = _tile(P, C, BLOCK_P, BLOCK_C)  # input pixels (n, ih, iw)
    n, ih, iw = offs_p // (H * W), (offs_p // W) % H, offs_p % W
    acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
    for tap in tl.static_range(K * K):  # the window whose tap lands on this pixel, if there is one
        top, left = ih + PAD - tap // K, iw + PAD - tap % K
        oh, ow = top // STRIDE, left // STRIDE
        window = p_ok & (top >= 0) & (left >= 0) & (top % STRIDE == 0) & (left % STRIDE == 0) & (oh < OH) & (ow < OW)
        ok = window[:, None] & c_ok[None, :]
        at = (((n * OH + oh) * OW + ow) * C)[:, None] + offs_c[None, :]
        mine = tl.load(pos_ptr + at, mask=ok, other=-1).to(tl.int32) == tap
        acc += tl.where(mine, tl.load(dy_ptr + at, mask=ok, other=0.0).to(tl.float32), 0.0)
    tl.store(dx_ptr + offs_p[:, None] * C + offs_c[None, :], acc.to(dx_ptr.dtype.element_ty),
             mask=p_ok[:, None] & c_ok[None, :])


def max_pool_forward(x: torch.Tensor, k: int = 3, stride: int = 2, pad: int = 1):
    """y and each output's window position of its (first) maximum, int8: `x` NHWC contiguous."""
    n, h, w, c = x.shape
    oh, ow = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
    y = torch.empty((n, oh, ow, c), device=x.device, dtype=x.dtype)
    pos = torch.empty((n, oh, ow, c), device=x.device, dtype=torch.int8)
    grid = (triton.cdiv(n * oh * ow, BLOCK_P), triton.cdiv(c, BLOCK_C))
    _max_pool_forward_kernel[grid](x, y, pos, n * oh * ow, h, w, c, oh, ow, k, stride, pad, BLOCK_P, BLOCK_C)
    return y, pos


def max_pool_backward(dy: torch.Tensor, pos: torch.Tensor, input_hw: tuple[int, int], k: int = 3, stride: int = 2,
                      pad: int = 1) -> torch.Tensor:
    """dx (NHWC, dy's type) of max_pool_forward's output gradient `dy`, from its positions `pos`."""
    n, oh, ow, c = dy.shape
    h, w = input_hw
    dx = torch.empty((n, h, w, c), device=dy.device, dtype=dy.dtype)
    grid = (triton.cdiv(n * h * w, BLOCK_P), triton.cdiv(c, BLOCK_C))
    _max_pool_backward_kernel[grid](dy, pos, dx, n * h * w, h, w, c, oh, ow, k, stride, pad, BLOCK_P, BLOCK_C)
    return dx


@triton.jit
def _avg_pool_backward_kernel(dy_ptr, dx_ptr, P, HW, C, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    offs_p, offs_c, p_ok, c_ok = _tile(P, C, BLOCK_P, BLOCK_C)  # input pixels (n, h, w)
    ok = p_ok[:, None] & c_ok[None, :]
    g = tl.load(dy_ptr + (offs_p // HW)[:, None] * C + offs_c[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(dx_ptr + offs_p[:, None] * C + offs_c[None, :], (g / HW).to(dx_ptr.dtype.element_ty), mask=ok)


def global_avg_pool_backward(dy: torch.Tensor, input_hw: tuple[int, int]) -> torch.Tensor:
    """dx (NHWC) of the global average pool's output gradient `dy` [N, C]: each pixel gets dy / (H*W)."""
    n, c = dy.shape
    h, w = input_hw
    dx = torch.empty((n, h, w, c), device=dy.device, dtype=dy.dtype)
    grid = (triton.cdiv(n * h * w, BLOCK_P), triton.cdiv(c, BLOCK_C))
    _avg_pool_backward_kernel[grid](dy, dx, n * h * w, h * w, c, BLOCK_P, BLOCK_C)
    return dx
