"""Batch normalisation in training mode over NHWC tensors, forward and backward, for a training step written in
Triton (issue 60). Per channel c, over the P = N*H*W values of the batch:

  forward:  mean, var = the batch's moments (var biased, as the normalisation uses); xhat = (x - mean) * invstd,
            invstd = 1 / sqrt(var + eps); y = gamma * xhat + beta
  backward: dbeta = sum(dy); dgamma = sum(dy * xhat);
            dx = gamma * invstd * (dy - dbeta / P - xhat * dgamma / P)

Both directions are a per-channel reduction (a pass over the batch), a finalize over its slices' partials (one small
launch per direction: the statistics, the running ones' update, the affine map's coefficients and the parameters'
gradients, where torch's reductions and arithmetic took about thirty launches) and then a per-channel affine map of
one or two tensors (another pass): `forward`'s y = a*x + b (with a block's residual added, itself another batch
norm's map where it is a downsample's (`Normalized`, never written), and its ReLU where asked),
`backward`'s dx = k1*dy + k2*x + k3 (dy through the ReLU first, its mask read from the forward's output). In NHWC a
channel is a column, so a program owns a block of columns and walks the rows; the moments in one pass, each row
block's mean and centred squares merged into the running ones (Chan et al.), so that a large mean does not cancel the
variance.

The reductions cut the rows into slices so that the GPU fills (kernels/triton/split.py), their row block tuned.
In the training step both reductions come from a convolution's epilogue where they can (conv.conv2d_stats, a slice
per row of output tiles): the forward's moments from the convolution that produces x, the backward's sums from the
data gradient that produces dy; the same finalize kernels merge them. docs/notes/cudnn-training.md counts what
fusion saves.
tests/test_triton_backward.py holds both against PyTorch's autograd."""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.triton import tuning
from kernels.triton.conv import TileStats
from kernels.triton.split import row_slices

BLOCK_P, BLOCK_C = 32, 64  # 64 columns: a 128-byte row of a bf16 tile; BLOCK_P rows: the untuned row block
# The reductions walk their slice a row block at a time, so a block's bytes are what each program has in flight:
# 4 KiB at 32 rows of bf16 is too little to near the memory's bandwidth (docs/notes/triton-training.md). Tuned, up
# to 256 rows (32 KiB); a slice's rows are a multiple of the largest, so that any block walks it whole.
REDUCTION_CONFIGS = [triton.Config({"BLOCK_P": rows}, num_warps=warps, num_stages=3)
                     for rows in (32, 64, 128, 256) for warps in (4, 8)]
MAX_BLOCK_P = max(c.kwargs["BLOCK_P"] for c in REDUCTION_CONFIGS)
UNTUNED = dict(BLOCK_P=BLOCK_P, num_warps=4, num_stages=3)
# The finalize kernels read BLOCK_S slices' partials at a time, each slot of the tile summing its own slices in
# order and the slots added by one tree at the end: a fixed order (the same bits every call) in SLICES / BLOCK_S
# steps. One slice at a time, a stem's 528 slices took 23 us a launch on the H200 (results/nvidia-h200/train/triton).
BLOCK_S = 32
# A finalize kernel is a program per 64 channels, walking every slice: past this many, _merge_slices_kernel first
# merges them, FINALIZE_SLICES groups in parallel (a layer1 convolution's epilogue writes 6,272 slices a channel).
FINALIZE_SLICES = 128


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
def _merged_moments(means_ptr, m2_ptr, offs_c, c_ok, C, FIRST, LAST, ROWS, P, BLOCK_C: tl.constexpr,
                    BLOCK_S: tl.constexpr):
    """Slices [FIRST, LAST)'s means and M2 (slice s: rows s * ROWS.. of P, the last one short) merged into theirs
    (BLOCK_S slices a step, each slot of the tile summing its own slices in order and the slots added by one tree at
    the end: a fixed order, the same bits every call)."""
    n = (tl.minimum(LAST * ROWS, P) - FIRST * ROWS).to(tl.float32)
    weighted = tl.zeros((BLOCK_S, BLOCK_C), dtype=tl.float32)
    for s0 in range(FIRST, LAST, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        ok = (offs_s < LAST)[:, None] & c_ok[None, :]
        rows = tl.minimum(ROWS, P - offs_s * ROWS).to(tl.float32)[:, None]
        weighted += tl.where(ok, rows * tl.load(means_ptr + offs_s[:, None] * C + offs_c[None, :], mask=ok), 0.0)
    mean = tl.sum(weighted, 0) / n
    m2 = tl.zeros((BLOCK_S, BLOCK_C), dtype=tl.float32)
    for s0 in range(FIRST, LAST, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        ok = (offs_s < LAST)[:, None] & c_ok[None, :]
        at = offs_s[:, None] * C + offs_c[None, :]
        rows = tl.minimum(ROWS, P - offs_s * ROWS).to(tl.float32)[:, None]
        spread = tl.load(means_ptr + at, mask=ok, other=0.0) - mean[None, :]
        m2 += tl.where(ok, tl.load(m2_ptr + at, mask=ok, other=0.0) + rows * spread * spread, 0.0)
    return mean, tl.sum(m2, 0)


@triton.jit
def _summed(ptr, offs_c, c_ok, C, FIRST, LAST, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):
    """Slices [FIRST, LAST) of fp32 [slices, C] partial sums added, in the same fixed order as _merged_moments."""
    total = tl.zeros((BLOCK_S, BLOCK_C), dtype=tl.float32)
    for s0 in range(FIRST, LAST, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        ok = (offs_s < LAST)[:, None] & c_ok[None, :]
        total += tl.load(ptr + offs_s[:, None] * C + offs_c[None, :], mask=ok, other=0.0)
    return tl.sum(total, 0)


@triton.jit
def _merge_slices_kernel(a_ptr, b_ptr, out_a_ptr, out_b_ptr, P, C, SLICES, ROWS, GROUP, MOMENTS: tl.constexpr,
                         BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):
    """GROUP slices' partials merged into one (program axis 1: which group): means and M2 with MOMENTS, else both
    arrays summed. A convolution's epilogue writes a slice per row of output tiles, thousands at layer1, which the
    finalize kernels (a program per 64 channels) would walk one after another."""
    offs_c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    first = tl.program_id(1) * GROUP
    last = tl.minimum(first + GROUP, SLICES)
    if MOMENTS:
        a, b = _merged_moments(a_ptr, b_ptr, offs_c, c_ok, C, first, last, ROWS, P, BLOCK_C, BLOCK_S)
    else:
        a = _summed(a_ptr, offs_c, c_ok, C, first, last, BLOCK_C, BLOCK_S)
        b = _summed(b_ptr, offs_c, c_ok, C, first, last, BLOCK_C, BLOCK_S)
    out = tl.program_id(1) * C + offs_c
    tl.store(out_a_ptr + out, a, mask=c_ok)
    tl.store(out_b_ptr + out, b, mask=c_ok)


@triton.jit
def _moments_finalize_kernel(means_ptr, m2_ptr, gamma_ptr, beta_ptr, mean_ptr, invstd_ptr, scale_ptr, shift_ptr,
                             run_mean_ptr, run_var_ptr, batches_ptr, P, C, SLICES, ROWS, eps, momentum,
                             AFFINE: tl.constexpr, RUNNING: tl.constexpr, BLOCK_C: tl.constexpr,
                             BLOCK_S: tl.constexpr):
    """The slices' means and M2 merged into the batch's mean and biased variance per column (the mean stored); with
    AFFINE its invstd and the forward's map y = scale * x + shift; with RUNNING PyTorch's running statistics (an
    exponential average of the mean and of the unbiased variance) and its batch count."""
    offs_c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    mean, m2 = _merged_moments(means_ptr, m2_ptr, offs_c, c_ok, C, 0, SLICES, ROWS, P, BLOCK_C, BLOCK_S)
    var = m2 / P
    tl.store(mean_ptr + offs_c, mean, mask=c_ok)
    if AFFINE:
        invstd = 1.0 / tl.sqrt(var + eps)
        tl.store(invstd_ptr + offs_c, invstd, mask=c_ok)
        scale = tl.load(gamma_ptr + offs_c, mask=c_ok, other=0.0) * invstd
        tl.store(scale_ptr + offs_c, scale, mask=c_ok)
        tl.store(shift_ptr + offs_c, tl.load(beta_ptr + offs_c, mask=c_ok, other=0.0) - mean * scale, mask=c_ok)
    if RUNNING:
        run_mean = tl.load(run_mean_ptr + offs_c, mask=c_ok, other=0.0)
        tl.store(run_mean_ptr + offs_c, run_mean + momentum * (mean - run_mean), mask=c_ok)
        run_var = tl.load(run_var_ptr + offs_c, mask=c_ok, other=0.0)
        unbiased = var * P / tl.maximum(P - 1, 1)
        tl.store(run_var_ptr + offs_c, run_var + momentum * (unbiased - run_var), mask=c_ok)
        if tl.program_id(0) == 0:
            tl.store(batches_ptr, tl.load(batches_ptr) + 1)


@triton.jit
def _grad_finalize_kernel(sum_dy_ptr, sum_dy_xhat_ptr, gamma_ptr, mean_ptr, invstd_ptr, dgamma_ptr, dbeta_ptr, k1_ptr,
                          k2_ptr, k3_ptr, P, C, SLICES, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):
    """The slices' partial sums added into dbeta = sum(dy) and dgamma = sum(dy * xhat), and the coefficients of
    dx = k1 * dy + k2 * x + k3 (the module docstring's dx with xhat = (x - mean) * invstd)."""
    offs_c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    dbeta = _summed(sum_dy_ptr, offs_c, c_ok, C, 0, SLICES, BLOCK_C, BLOCK_S)
    dgamma = _summed(sum_dy_xhat_ptr, offs_c, c_ok, C, 0, SLICES, BLOCK_C, BLOCK_S)
    mean = tl.load(mean_ptr + offs_c, mask=c_ok, other=0.0)
    invstd = tl.load(invstd_ptr + offs_c, mask=c_ok, other=0.0)
    k1 = tl.load(gamma_ptr + offs_c, mask=c_ok, other=0.0) * invstd
    tl.store(dgamma_ptr + offs_c, dgamma, mask=c_ok)
    tl.store(dbeta_ptr + offs_c, dbeta, mask=c_ok)
    tl.store(k1_ptr + offs_c, k1, mask=c_ok)
    tl.store(k2_ptr + offs_c, -k1 * invstd * dgamma / P, mask=c_ok)
    tl.store(k3_ptr + offs_c, k1 * (mean * invstd * dgamma - dbeta) / P, mask=c_ok)


# The affine pass streams two to four tensors and writes one or two: a tile of BLOCK_P rows of 64 channels, its
# row count and warps tuned per shape as the reductions' are (what that bought: docs/notes/triton-training.md).
@tuning.autotune(REDUCTION_CONFIGS, key=["P", "C", "HAS_V", "HAS_R", "GATE", "KEEP_GATED", "RELU"])
@triton.jit
def _channel_affine_kernel(u_ptr, v_ptr, r_ptr, gate_ptr, out_ptr, gated_ptr, k1_ptr, k2_ptr, k3_ptr, P, C,
                           HAS_V: tl.constexpr, HAS_R: tl.constexpr, GATE: tl.constexpr, KEEP_GATED: tl.constexpr,
                           RELU: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr):
    """out = k1[c] * u + k2[c] * v + r + k3[c], in fp32, stored in out's type: v (scaled per channel) and r (a
    residual, added as is) where given; u zeroed where `gate` is not positive (GATE: a ReLU's backward), and that
    gated u also stored to `gated` (KEEP_GATED: a block's residual gradient, without a pass of its own); the sum
    through a ReLU (RELU). Idempotent, so the autotuner may run it several times."""
    offs_p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    ok = (offs_p < P)[:, None] & c_ok[None, :]
    at = offs_p[:, None] * C + offs_c[None, :]
    u = tl.load(u_ptr + at, mask=ok, other=0.0).to(tl.float32)
    if GATE:
        u = tl.where(tl.load(gate_ptr + at, mask=ok, other=0.0) > 0, u, 0.0)
        if KEEP_GATED:
            tl.store(gated_ptr + at, u.to(gated_ptr.dtype.element_ty), mask=ok)
    out = u * tl.load(k1_ptr + offs_c, mask=c_ok)[None, :]
    if HAS_V:
        out += tl.load(v_ptr + at, mask=ok, other=0.0).to(tl.float32) * tl.load(k2_ptr + offs_c, mask=c_ok)[None, :]
    if HAS_R:
        out += tl.load(r_ptr + at, mask=ok, other=0.0).to(tl.float32)
    out += tl.load(k3_ptr + offs_c, mask=c_ok)[None, :]
    if RELU:
        out = tl.maximum(out, 0.0)
    tl.store(out_ptr + at, out.to(out_ptr.dtype.element_ty), mask=ok)


def _affine(u: torch.Tensor, k1: torch.Tensor, k3: torch.Tensor, tune: bool, v: torch.Tensor | None = None,
            k2: torch.Tensor | None = None, residual: torch.Tensor | None = None, gate: torch.Tensor | None = None,
            relu: bool = False, gated: torch.Tensor | None = None) -> torch.Tensor:
    """The affine map's output (u's type); `gated`, where given, receives u through the gate."""
    c = u.shape[-1]
    p = u.numel() // c
    out = torch.empty_like(u)

    def grid(meta):
        return (triton.cdiv(p, meta["BLOCK_P"]), triton.cdiv(c, BLOCK_C))

    tuning.launch(_channel_affine_kernel, grid,
                  (u, u if v is None else v, u if residual is None else residual, u if gate is None else gate, out,
                   u if gated is None else gated, k1, k1 if k2 is None else k2, k3, p, c, v is not None,
                   residual is not None, gate is not None, gated is not None, relu, BLOCK_C), tune, UNTUNED)
    return out


class Normalized(NamedTuple):
    """A batch norm's output left unapplied, scale * x + shift per channel (fp32 [C] each), for the kernel that reads
    it to apply: a block's downsample, whose output only the block's add reads, is never written."""
    x: torch.Tensor
    scale: torch.Tensor
    shift: torch.Tensor


def forward(x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, eps: float = 1e-5,
            residual: torch.Tensor | Normalized | None = None, relu: bool = False, tune: bool = True,
            running: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, momentum: float = 0.1,
            moments: TileStats | None = None):
    """y = [relu](bn(x) [+ residual]) in x's type, and the batch's mean and invstd (fp32, per channel) that backward
    needs: `x` NHWC contiguous, `gamma` and `beta` fp32 [C]. `running`: the module's
    running mean, running variance and batch count, updated as PyTorch's training-mode batch norm does. `moments`:
    x's partial moments where its producer wrote them (conv.conv2d_stats), else the moments kernel reads x.
    `residual`: a tensor, or another batch norm's Normalized output, applied in the same pass."""
    stats = statistics(x, tune, gamma, beta, eps, running, momentum, moments)
    return apply(x, stats, residual, relu, tune), stats.mean, stats.invstd


def apply(x: torch.Tensor, stats: Statistics, residual: torch.Tensor | Normalized | None = None,
          relu: bool = False, tune: bool = True) -> torch.Tensor:
    """forward's pass: stats' affine map of x, the residual added (a Normalized one mapped on the way), the ReLU."""
    if isinstance(residual, Normalized):
        return _affine(x, stats.scale, stats.shift + residual.shift, tune, v=residual.x, k2=residual.scale, relu=relu)
    return _affine(x, stats.scale, stats.shift, tune, residual=residual, relu=relu)


def backward(dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor, gamma: torch.Tensor,
             y: torch.Tensor | None = None, residual: bool = False, tune: bool = True,
             dgamma: torch.Tensor | None = None, dbeta: torch.Tensor | None = None, sums: TileStats | None = None):
    """dx (dy's type), dgamma and dbeta (fp32) of forward's output gradient `dy` (NHWC, x's shape); with `y`, the
    output of a forward with relu, the gradient goes through its ReLU first; with `residual`, also the residual's
    gradient (dy through the ReLU), returned last. `dgamma`, `dbeta`: where to write those gradients (views of a
    flat gradient buffer), else new tensors. `sums`: dy's partial sums (through the ReLU) and of dy times xhat
    where its producer wrote them (conv.conv2d_stats with the batch norm's BatchNormSaved), else a pass reads dy."""
    c = x.shape[-1]
    p = x.numel() // c
    sum_dy, sum_dy_xhat, rows = _fewer_slices(sums or _grad_sums(dy, x, y, mean, invstd, tune), p, moments=False)
    slices = triton.cdiv(p, rows)
    dgamma = _channels(c, x.device) if dgamma is None else dgamma
    dbeta = _channels(c, x.device) if dbeta is None else dbeta
    k1, k2, k3 = (_channels(c, x.device) for _ in range(3))
    _grad_finalize_kernel[(triton.cdiv(c, BLOCK_C),)](sum_dy, sum_dy_xhat, gamma, mean, invstd, dgamma, dbeta, k1,
                                                       k2, k3, p, c, slices, BLOCK_C, BLOCK_S)
    gated = torch.empty_like(dy) if residual and y is not None else None  # the residual's gradient: dy past the ReLU
    dx = _affine(dy, k1, k3, tune, x, k2, gate=y, gated=gated)
    if not residual:
        return dx, dgamma, dbeta
    return dx, dgamma, dbeta, (dy if y is None else gated)


def channel_sum(x: torch.Tensor, tune: bool = True) -> torch.Tensor:
    """The per-channel sum (fp32) over every other axis of `x` (NHWC or [N, C]): a classifier's bias gradient."""
    return statistics(x, tune).mean * (x.numel() // x.shape[-1])


def _slices(x: torch.Tensor, tune: bool) -> tuple[int, int]:
    """(slices, rows per slice) of a per-channel reduction over NHWC `x` (kernels/triton/split.py): in multiples of
    the largest row block a tuned launch may take, else of the untuned one (the interpreter's: so that the CPU
    tests' small tensors still have several slices to merge)."""
    c = x.shape[-1]
    block = MAX_BLOCK_P if tune and not tuning.INTERPRET else BLOCK_P
    return row_slices(x.numel() // c, triton.cdiv(c, BLOCK_C), block, x.device)


class Statistics(NamedTuple):
    """A batch's per-channel mean (fp32) and, given gamma and beta, its invstd and the forward's affine map."""
    mean: torch.Tensor
    invstd: torch.Tensor | None
    scale: torch.Tensor | None
    shift: torch.Tensor | None


def statistics(x: torch.Tensor, tune: bool, gamma: torch.Tensor | None = None, beta: torch.Tensor | None = None,
               eps: float = 0.0, running: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
               momentum: float = 0.1, moments: TileStats | None = None) -> Statistics:
    """The per-channel statistics of NHWC `x` (forward's, without its pass over x): each slice's mean and M2
    (`moments`, or the moments kernel's), merged by the finalize kernel, which also gives the affine map (with
    `gamma` and `beta`) and updates `running`."""
    c = x.shape[-1]
    p = x.numel() // c
    means, m2, rows = _fewer_slices(moments or _moments(x, tune), p, moments=True)
    slices = triton.cdiv(p, rows)
    mean = _channels(c, x.device)
    affine = gamma is not None
    invstd, scale, shift = (_channels(c, x.device) for _ in range(3)) if affine else (None, None, None)
    run_mean, run_var, batches = running or (mean, mean, mean)  # unread without RUNNING, as the rest without AFFINE
    _moments_finalize_kernel[(triton.cdiv(c, BLOCK_C),)](
        means, m2, gamma if affine else mean, beta if affine else mean, mean, invstd if affine else mean,
        scale if affine else mean, shift if affine else mean, run_mean, run_var, batches, p, c, slices, rows, eps,
        momentum, affine, running is not None, BLOCK_C, BLOCK_S)
    return Statistics(mean, invstd, scale, shift)


def _fewer_slices(partials: TileStats, p: int, moments: bool) -> TileStats:
    """`partials` (a slice per `rows` of the `p` rows) with groups of slices merged, where there are more than a
    finalize should walk: their means and M2 with `moments`, else their sums."""
    a, b, rows = partials
    slices, c = triton.cdiv(p, rows), a.shape[1]
    if slices <= FINALIZE_SLICES:
        return partials
    group = triton.cdiv(slices, FINALIZE_SLICES)
    groups = triton.cdiv(slices, group)
    merged_a, merged_b = (torch.empty((groups, c), device=a.device, dtype=torch.float32) for _ in range(2))
    _merge_slices_kernel[(triton.cdiv(c, BLOCK_C), groups)](a, b, merged_a, merged_b, p, c, slices, rows, group,
                                                            moments, BLOCK_C, BLOCK_S)
    return TileStats(merged_a, merged_b, rows * group)


def _moments(x: torch.Tensor, tune: bool) -> TileStats:
    """Each slice's mean and M2 per channel of NHWC `x`, by the moments kernel."""
    c = x.shape[-1]
    slices, rows = _slices(x, tune)
    means, m2 = (torch.empty((slices, c), device=x.device, dtype=torch.float32) for _ in range(2))
    tuning.launch(_moments_kernel, (triton.cdiv(c, BLOCK_C), slices), (x, means, m2, x.numel() // c, c, rows,
                                                                       BLOCK_C), tune, UNTUNED)
    return TileStats(means, m2, rows)


def _grad_sums(dy: torch.Tensor, x: torch.Tensor, y: torch.Tensor | None, mean: torch.Tensor, invstd: torch.Tensor,
               tune: bool) -> TileStats:
    """Each slice's sums of dy (through the ReLU of output `y`, where given) and of dy times xhat, by the gradient
    sums kernel."""
    c = x.shape[-1]
    slices, rows = _slices(x, tune)
    sum_dy, sum_dy_xhat = (torch.empty((slices, c), device=x.device, dtype=torch.float32) for _ in range(2))
    tuning.launch(_grad_sums_kernel, (triton.cdiv(c, BLOCK_C), slices),
                  (dy, x, dy if y is None else y, mean, invstd, sum_dy, sum_dy_xhat, x.numel() // c, c, rows,
                   y is not None, BLOCK_C), tune, UNTUNED)
    return TileStats(sum_dy, sum_dy_xhat, rows)


def _channels(c: int, device: torch.device) -> torch.Tensor:
    return torch.empty(c, device=device, dtype=torch.float32)
