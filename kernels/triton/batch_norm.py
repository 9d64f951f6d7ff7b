"""Batch normalisation in training mode over NHWC tensors, forward and backward, for a training step written in
Triton (issue 60). Per channel c, over the P = N*H*W values of the batch:

  forward:  mean, var = the batch's moments (var biased, as the normalisation uses); xhat = (x - mean) * invstd,
            invstd = 1 / sqrt(var + eps); y = gamma * xhat + beta
  backward: dbeta = sum(dy); dgamma = sum(dy * xhat);
            dx = gamma * invstd * (dy - dbeta / P - xhat * dgamma / P)

Both directions are a per-channel reduction (a pass over the batch) and then a per-channel affine map of one or two
tensors (another pass): `forward`'s y = a*x + b (with a block's residual added and its ReLU where asked),
`backward`'s dx = k1*dy + k2*x + k3 with the coefficients folded on the host (dy through the ReLU first, its mask
read from the forward's output). In NHWC a channel is a column, so a program owns a block of columns and walks the
rows; the moments in one pass, each row block's mean and centred squares merged into the running ones (Chan et al.),
so that a large mean does not cancel the variance.

The reductions cut the rows into slices so that the GPU fills (kernels/triton/split.py), their row block tuned;
nothing is fused into the convolutions yet (docs/notes/cudnn-training.md counts what fusion saves).
tests/test_triton_backward.py holds both against PyTorch's autograd."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.triton import tuning
from kernels.triton.split import row_slices

BLOCK_P, BLOCK_C = 32, 64  # 64 columns: a 128-byte row of a bf16 tile; BLOCK_P rows: the untuned row block
# The reductions walk their slice a row block at a time, so a block's bytes are what each program has in flight:
# 4 KiB at 32 rows of bf16 is too little to near the memory's bandwidth (docs/notes/triton-training.md). Tuned, up
# to 256 rows (32 KiB); a slice's rows are a multiple of the largest, so that any block walks it whole.
REDUCTION_CONFIGS = [triton.Config({"BLOCK_P": rows}, num_warps=warps, num_stages=3)
                     for rows in (32, 64, 128, 256) for warps in (4, 8)]
MAX_BLOCK_P = max(c.kwargs["BLOCK_P"] for c in REDUCTION_CONFIGS)
UNTUNED = dict(BLOCK_P=BLOCK_P, num_warps=4, num_stages=3)


@tuning.autotune(REDUCTION_CONFIGS, key=["P", "C"])
@triton.jit
def _moments_kernel(x_ptr, mean_ptr, m2_ptr, P, C, ROWS, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr):
    """One slice of ROWS rows (program axis 1) of a block of columns: its mean and sum of centred squares (M2) per
    column, each row block's own merged in (Chan et al.'s pairwise update), so that a large mean never cancels the
    variance and the data is read once."""
    offs_c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    start = tl.program_id(1) * ROWS
    end = tl.minimum(start + ROWS, P)
    count = 0.0
    mean = tl.zeros((BLOCK_C,), dtype=tl.float32)
    m2 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for p0 in range(start, end, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        ok = (offs_p < end)[:, None] & c_ok[None, :]
        x = tl.load(x_ptr + offs_p[:, None] * C + offs_c[None, :], mask=ok, other=0.0).to(tl.float32)
        n = tl.minimum(end - p0, BLOCK_P).to(tl.float32)
        block_mean = tl.sum(x, 0) / n
        centred = tl.where(ok, x - block_mean[None, :], 0.0)
        delta = block_mean - mean
        total = count + n
        mean += delta * (n / total)
        m2 += tl.sum(centred * centred, 0) + delta * delta * (count * n / total)
        count = total
    out = tl.program_id(1) * C + offs_c
    tl.store(mean_ptr + out, mean, mask=c_ok)
    tl.store(m2_ptr + out, m2, mask=c_ok)


@tuning.autotune(REDUCTION_CONFIGS, key=["P", "C", "RELU"])
@triton.jit
def _grad_sums_kernel(dy_ptr, x_ptr, y_ptr, mean_ptr, invstd_ptr, sum_dy_ptr, sum_dy_xhat_ptr, P, C, ROWS,
                      RELU: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr):
    """One slice of ROWS rows (program axis 1): its partial sums of dy and dy * xhat per column."""
    offs_c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    start = tl.program_id(1) * ROWS
    end = tl.minimum(start + ROWS, P)
    mean = tl.load(mean_ptr + offs_c, mask=c_ok, other=0.0)
    invstd = tl.load(invstd_ptr + offs_c, mask=c_ok, other=0.0)
    sum_dy = tl.zeros((BLOCK_C,), dtype=tl.float32)
    sum_dy_xhat = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for p0 in range(start, end, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        ok = (offs_p < end)[:, None] & c_ok[None, :]
        at = offs_p[:, None] * C + offs_c[None, :]
        dy = tl.load(dy_ptr + at, mask=ok, other=0.0).to(tl.float32)
        if RELU:  # the gradient through the ReLU: zero where its output was not positive
            dy = tl.where(tl.load(y_ptr + at, mask=ok, other=0.0) > 0, dy, 0.0)
        xhat = (tl.load(x_ptr + at, mask=ok, other=0.0).to(tl.float32) - mean[None, :]) * invstd[None, :]
        sum_dy += tl.sum(dy, 0)
        sum_dy_xhat += tl.sum(tl.where(ok, dy * xhat, 0.0), 0)
    out = tl.program_id(1) * C + offs_c
    tl.store(sum_dy_ptr + out, sum_dy, mask=c_ok)
    tl.store(sum_dy_xhat_ptr + out, sum_dy_xhat, mask=c_ok)


@triton.jit
def _channel_affine_kernel(u_ptr, v_ptr, r_ptr, gate_ptr, out_ptr, k1_ptr, k2_ptr, k3_ptr, P, C, HAS_V: tl.constexpr,
                           HAS_R: tl.constexpr, GATE: tl.constexpr, RELU: tl.constexpr, BLOCK_P: tl.constexpr,
                           BLOCK_C: tl.constexpr):
    """out = k1[c] * u + k2[c] * v + r + k3[c], in fp32, stored in out's type: v (scaled per channel) and r (a
    residual, added as is) where given; u zeroed where `gate` is not positive (GATE: a ReLU's backward); the sum
    through a ReLU (RELU)."""
    offs_p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    ok = (offs_p < P)[:, None] & c_ok[None, :]
    at = offs_p[:, None] * C + offs_c[None, :]
    u = tl.load(u_ptr + at, mask=ok, other=0.0).to(tl.float32)
    if GATE:
        u = tl.where(tl.load(gate_ptr + at, mask=ok, other=0.0) > 0, u, 0.0)
    out = u * tl.load(k1_ptr + offs_c, mask=c_ok)[None, :]
    if HAS_V:
        out += tl.load(v_ptr + at, mask=ok, other=0.0).to(tl.float32) * tl.load(k2_ptr + offs_c, mask=c_ok)[None, :]
    if HAS_R:
        out += tl.load(r_ptr + at, mask=ok, other=0.0).to(tl.float32)
    out += tl.load(k3_ptr + offs_c, mask=c_ok)[None, :]
    if RELU:
        out = tl.maximum(out, 0.0)
    tl.store(out_ptr + at, out.to(out_ptr.dtype.element_ty), mask=ok)


def _affine(u: torch.Tensor, k1: torch.Tensor, k3: torch.Tensor, v: torch.Tensor | None = None,
            k2: torch.Tensor | None = None, residual: torch.Tensor | None = None, gate: torch.Tensor | None = None,
            relu: bool = False) -> torch.Tensor:
    c = u.shape[-1]
    p = u.numel() // c
    out = torch.empty_like(u)
    grid = (triton.cdiv(p, BLOCK_P), triton.cdiv(c, BLOCK_C))
    _channel_affine_kernel[grid](u, u if v is None else v, u if residual is None else residual,
                                 u if gate is None else gate, out, k1, k1 if k2 is None else k2, k3, p, c,
                                 v is not None, residual is not None, gate is not None, relu, BLOCK_P, BLOCK_C)
    return out


def forward(x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, eps: float = 1e-5,
            residual: torch.Tensor | None = None, relu: bool = False, tune: bool = True):
    """y = [relu](bn(x) [+ residual]) in x's type, the batch's mean and invstd (fp32, per channel) that backward
    needs, and its (biased) variance: `x` NHWC contiguous, `gamma` and `beta` fp32 [C]. The caller updates the
    running statistics from mean and var (unbiased there)."""
    mean, var = _moments(x, tune)
    invstd = torch.rsqrt(var + eps)
    a = gamma * invstd
    return _affine(x, a, beta - mean * a, residual=residual, relu=relu), mean, invstd, var


def backward(dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor, gamma: torch.Tensor,
             y: torch.Tensor | None = None, residual: bool = False, tune: bool = True):
    """dx (dy's type), dgamma and dbeta (fp32) of forward's output gradient `dy` (NHWC, x's shape); with `y`, the
    output of a forward with relu, the gradient goes through its ReLU first; with `residual`, also the residual's
    gradient (dy through the ReLU), returned last."""
    c = x.shape[-1]
    p = x.numel() // c
    slices, rows = _slices(x, tune)
    dbeta, dgamma = (torch.empty((slices, c), device=x.device, dtype=torch.float32) for _ in range(2))
    tuning.launch(_grad_sums_kernel, (triton.cdiv(c, BLOCK_C), slices),
                  (dy, x, dy if y is None else y, mean, invstd, dbeta, dgamma, p, c, rows, y is not None, BLOCK_C),
                  tune, UNTUNED)
    dbeta, dgamma = dbeta.sum(0), dgamma.sum(0)  # the slices in a fixed order: the same bits every call
    k1 = gamma * invstd
    k2 = -k1 * invstd * dgamma / p
    k3 = k1 * (mean * invstd * dgamma - dbeta) / p
    dx = _affine(dy, k1, k3, x, k2, gate=y)
    if not residual:
        return dx, dgamma, dbeta
    ones, zeros = _identity(c, x.device)
    return dx, dgamma, dbeta, (dy if y is None else _affine(dy, ones, zeros, gate=y))


def channel_sum(x: torch.Tensor, tune: bool = True) -> torch.Tensor:
    """The per-channel sum (fp32) over every other axis of `x` (NHWC or [N, C]): a classifier's bias gradient."""
    mean, _ = _moments(x, tune)
    return mean * (x.numel() // x.shape[-1])


def _slices(x: torch.Tensor, tune: bool) -> tuple[int, int]:
    """(slices, rows per slice) of a per-channel reduction over NHWC `x` (kernels/triton/split.py): in multiples of
    the largest row block a tuned launch may take, else of the untuned one (the interpreter's: so that the CPU
    tests' small tensors still have several slices to merge)."""
    c = x.shape[-1]
    block = MAX_BLOCK_P if tune and not tuning.INTERPRET else BLOCK_P
    return row_slices(x.numel() // c, triton.cdiv(c, BLOCK_C), block, x.device)


def _moments(x: torch.Tensor, tune: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-channel mean and biased variance (fp32) of NHWC `x`: each slice's from the kernel, then merged
    (the pooled mean, and the slices' M2 plus their spread about it)."""
    c = x.shape[-1]
    p = x.numel() // c
    slices, rows = _slices(x, tune)
    means, m2 = (torch.empty((slices, c), device=x.device, dtype=torch.float32) for _ in range(2))
    tuning.launch(_moments_kernel, (triton.cdiv(c, BLOCK_C), slices), (x, means, m2, p, c, rows, BLOCK_C), tune,
                  UNTUNED)
    counts = _slice_rows(p, rows, slices, x.device)
    mean = (counts * means).sum(0) / p
    return mean, (m2.sum(0) + (counts * (means - mean) ** 2).sum(0)) / p


def _per_shape(make):
    """`make`'s result kept per arguments (the last a device): the constants a step would otherwise rebuild in small
    launches every call. Never kept from inside a CUDA graph's capture, where it would be filled only when the
    graph replays."""
    kept: dict[tuple, object] = {}

    @functools.wraps(make)
    def get(*args):
        made = kept.get(args)
        if made is None:
            made = make(*args)
            if not (args[-1].type == "cuda" and torch.cuda.is_current_stream_capturing()):
                kept[args] = made
        return made
    return get


@_per_shape
def _slice_rows(p: int, rows: int, slices: int, device: torch.device) -> torch.Tensor:
    """The rows each slice of a reduction over `p` rows holds (the last may hold fewer), [slices, 1] fp32."""
    return (p - rows * torch.arange(slices, device=device)).clamp(max=rows).float()[:, None]


@_per_shape
def _identity(c: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The affine map's per-channel identity (ones, zeros; fp32)."""
    return (torch.ones(c, device=device, dtype=torch.float32), torch.zeros(c, device=device, dtype=torch.float32))
