"""Pooling over NHWC tensors: the stem's 3x3/s2 max-pool (where the stem does not fuse it, stem.py) and the head's
global average pool.

Both are memory-bound: a program owns a tile of (pixels x channels), channels innermost so loads are contiguous.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.conv import tf32_round
from kernels.triton.pdl import wait_for_prior_kernel
from kernels.triton.tuning import autotune, launch

_CONFIGS = [triton.Config({"BLOCK_P": 32, "BLOCK_C": 64}, num_warps=4),
            triton.Config({"BLOCK_P": 16, "BLOCK_C": 128}, num_warps=4),
            triton.Config({"BLOCK_P": 64, "BLOCK_C": 64}, num_warps=8)]
_FIXED = dict(BLOCK_P=32, BLOCK_C=64, num_warps=4, num_stages=2)


@autotune(_CONFIGS, key=["P", "H", "W", "C"])
@triton.jit
def max_pool_nhwc_kernel(x_ptr, y_ptr, P, H, W, C, OH, OW,
                         K: tl.constexpr, STRIDE: tl.constexpr, PAD: tl.constexpr,
                         BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, GDC: tl.constexpr = False):
    wait_for_prior_kernel(GDC)
    offs_p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)  # output pixels (n, oh, ow)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ow = offs_p % OW
    oh = (offs_p // OW) % OH
    img = offs_p // (OW * OH)
    c_ok = offs_c < C
    acc = tl.full((BLOCK_P, BLOCK_C), float("-inf"), tl.float32)
    for kh in tl.static_range(K):  # unrolled: K*K shifted loads, padding reads as -inf
        for kw in tl.static_range(K):
            ih = oh * STRIDE - PAD + kh
            iw = ow * STRIDE - PAD + kw
            ok = (offs_p < P) & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            v = tl.load(x_ptr + (((img * H + ih) * W + iw) * C)[:, None] + offs_c[None, :],
                        mask=ok[:, None] & c_ok[None, :], other=float("-inf"))
            acc = tl.maximum(acc, v.to(tl.float32))
    tl.store(y_ptr + (offs_p * C)[:, None] + offs_c[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(offs_p < P)[:, None] & c_ok[None, :])


@autotune(_CONFIGS, key=["HW", "C"])
@triton.jit
def avg_pool_nhwc_kernel(x_ptr, y_ptr, HW, C, PRECISION: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
                         GDC: tl.constexpr = False):
    # One program: one image, BLOCK_C channels; walk its HW pixels BLOCK_P at a time, summing in fp32.
    wait_for_prior_kernel(GDC)
    img = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    acc = tl.zeros((BLOCK_C,), tl.float32)
    for p0 in range(0, HW, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        v = tl.load(x_ptr + ((img * HW + offs_p) * C)[:, None] + offs_c[None, :],
                    mask=(offs_p < HW)[:, None] & (offs_c < C)[None, :], other=0.0)
        acc += tl.sum(v.to(tl.float32), axis=0)
    tl.store(y_ptr + img * C + offs_c, tf32_round((acc / HW).to(y_ptr.dtype.element_ty), PRECISION), mask=offs_c < C)


def max_pool2d(x: torch.Tensor, k: int = 3, stride: int = 2, pad: int = 1, tune: bool = True,
               pdl: bool = False) -> torch.Tensor:
    """NHWC max-pool (`x` contiguous [N, H, W, C])."""
    n, h, w, c = x.shape
    oh, ow = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
    y = torch.empty((n, oh, ow, c), device=x.device, dtype=x.dtype)
    p = n * oh * ow

    def grid(meta):
        return (triton.cdiv(p, meta["BLOCK_P"]), triton.cdiv(c, meta["BLOCK_C"]))

    launch(max_pool_nhwc_kernel, grid, (x, y, p, h, w, c, oh, ow, k, stride, pad), tune, _FIXED, pdl)
    return y


def global_avg_pool(x: torch.Tensor, tune: bool = True, pdl: bool = False, precision: str = "ieee") -> torch.Tensor:
    """NHWC [N, H, W, C] -> [N, C], the mean over the pixels (under TF32, `precision`, rounded to it for the
    classifier's products)."""
    n, h, w, c = x.shape
    y = torch.empty((n, c), device=x.device, dtype=x.dtype)

    def grid(meta):
        return (n, triton.cdiv(c, meta["BLOCK_C"]))

    launch(avg_pool_nhwc_kernel, grid, (x, y, h * w, c, precision), tune, _FIXED, pdl)
    return y
