"""Convolution + folded batch-norm + residual + ReLU as one implicit-GEMM Triton kernel over NHWC tensors.

The GEMM view (as in the Triton matmul tutorial): C[M, COUT] = A[M, K] @ B[K, COUT] with
  M = N*OH*OW output pixels, K = KH*KW*CIN window elements, A = the input windows (never materialised: each
  program gathers its A tile straight from the NHWC input), B = the packed weights.
The trick that keeps one kernel fast for every kernel size: in NHWC, one *row* of a window (KW neighbouring pixels
times CIN channels) is a single contiguous run of KW*CIN elements, whatever the stride. So K is walked as KH rows of
KW*CIN contiguous elements: the A loads stay contiguous (vectorised) for 1x1, 3x3 and 7x7 alike, and the 7x7 stem with
its 3 input channels wastes little of a K tile (rows of 21 elements instead of 3).
A 1x1 convolution on a 1x1 image is a plain GEMM, so the classifier (FC + bias) runs on this kernel too.

The stem (7x7, stride 2, over 3 channels, then its max-pool) has a kernel of its own: kernels/triton/stem.py.

FP8 (e4m3, Hopper's tensor cores at twice the bf16 rate): the weights are stored in e4m3 with one scale per output
channel (batch-norm folding gives each channel its own range). Activations have one calibrated scale per tensor. A
tensor that only feeds the next convolution of its block is stored in e4m3 by its producer's epilogue (scaled by
1 / its scale, saturated): the consumer's A tiles go to the tensor cores as loaded, with half the bytes of bf16.
So is a block's output, which the next block reads twice: its conv1 (and downsample) as their input, its last
convolution as the residual, scaled back by the tensor's scale in the epilogue. Only the stem's output (the first
block's input), the downsample's and the last block's stay bf16; a convolution reading bf16 scales each A tile by
1 / its scale and rounds it to e4m3 on the chip. Either way the fp32 accumulator is scaled
back by both scales before the epilogue. Hopper's FP8 (and TF32) tensor
core instructions read B with K contiguous, so those weights are packed K-major ([COUT, K]); bf16 and strict-fp32
weights keep COUT contiguous.

A block's downsample (the 1x1 convolution on its shortcut) is fused into the block's last convolution: relu(conv(x) +
downsample(block input)) is one GEMM whose K first walks the convolution's window over x and then the block input's
channels at the downsample's stride (`fuse_shortcut`; the weights concatenated along K, the biases summed). The
downsample's output, as large as the block's own, then never goes through HBM, and the block is one launch shorter.

Split-K, for the late layers at small batches: at batch 1, layer4's 3x3 convolution has 49 output pixels and 512
channels, a handful of output tiles, each with a K of 4608 to walk; a handful of SMs stream 4.7 MB of weights
while the other 120 idle. With SPLIT_K > 1, each tile's K is cut into SPLIT_K slices, one program each. Every
program stores its fp32 partial tile in a workspace and counts itself in on the tile's counter; the last to arrive
adds the partials in slice order (the sum is the same whichever program comes last), runs the epilogue and resets
the counter to zero for the next launch. One kernel still, no memset and no separate reduction launch. The
workspace and counters are shared by every launch on a device, which is sound because launches on one stream run
one after another.

A training step's convolution also writes two statistics per channel of the tile it has just stored (STATS,
over the tile's rows, of the values as stored), so that a batch norm's reductions need no pass of their own over
that tensor (kernels/triton/batch_norm.py merges them): "moments", the tile's mean and centred sum of squares,
where the output is a batch norm's input; "grad_sums", where the output is the gradient of a batch norm's
(ReLU'd) output: its sum through the ReLU, and that times the batch norm's normalised input.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.triton.pdl import prefetch_l2, wait_for_prior_kernel
from kernels.triton.tuning import INTERPRET, autotune, launch

SMEM_BYTES = 200 * 1024  # shared memory a config's pipeline may use (H100: 227 KiB per block, less Triton's own)


def _config(bm, bn, bk, stages, warps, split=1):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split}, num_stages=stages,
                         num_warps=warps)


# Split-K's bounds: a partial tile holds at most SPLIT_TILE fp32 values, and a split launch has at most
# SPLIT_PROGRAMS programs (two waves of an H100's or H200's 132 SMs), so one workspace of their product serves all.
SPLIT_TILE, SPLIT_PROGRAMS = 64 * 128, 264
# Tiles of at most this many outputs (batch 1's) load their epilogue's operands early: 16 values a thread at 4 warps.
EARLY_TILE: tl.constexpr = tl.constexpr(32 * 64)

# Large tiles for the big batches, narrow ones for batch 1 (few output pixels: more programs, fuller GPU), and
# split-K over narrow tiles for the layers that have too few output tiles to fill the GPU (kept by _prune only there).
CONFIGS = [_config(128, 256, 64, 3, 8), _config(128, 128, 64, 3, 8), _config(128, 128, 64, 4, 4),
           _config(128, 64, 64, 4, 4), _config(64, 128, 64, 4, 4), _config(64, 64, 64, 4, 4),
           _config(32, 64, 64, 4, 4), _config(32, 32, 128, 4, 4)] + [
    _config(bm, bn, 64, 4, 4, split) for bm, bn in ((32, 64), (64, 64), (32, 128)) for split in (2, 4, 8, 16)]


MIN_BLOCK_M = min(c.kwargs["BLOCK_M"] for c in CONFIGS)  # the most rows of tiles a launch can have: its statistics'


def _steps(kh: int, row: int, bk: int, shortcut: int = 0) -> int:
    """K tiles one output tile walks: window rows times K tiles per row, then the shortcut's channels."""
    return kh * triton.cdiv(row, bk) + triton.cdiv(shortcut, bk)


def _split_fits(split: int, tiles: int, steps: int, bm: int, bn: int) -> bool:
    """Whether `split` slices are worth it and fit the shared workspace: each slice walks at least two K tiles."""
    return split == 1 or (bm * bn <= SPLIT_TILE and split * tiles <= SPLIT_PROGRAMS and steps >= 2 * split)


def _k_tiles(bk: int, elem: int) -> tuple[int, ...]:
    """The K tiles a config offers for an element size: the same bytes a row for 4-byte types, both for 1-byte."""
    return (bk // 2,) if elem == 4 else (bk, 2 * bk) if elem == 1 else (bk,)


def _prune(configs, args, **_):
    """Fit the config list to one convolution: halve K tiles for 4-byte types (same shared memory), offer 1-byte
    types doubled ones too (e4m3's 128-byte row: half the fp32 promotions of an fp8 dot), shrink them to the window
    row (the stem's row is 21 elements), drop tiles larger than the problem or the shared memory, and drop split-K
    where its programs would not fit two waves or its slices would be too short (_split_fits)."""
    elem, row, m, cout = args["x_ptr"].element_size(), args["KW"] * args["CIN"], args["M"], args["COUT"]
    kept = {}
    for c, bk in ((c, bk) for c in configs for bk in _k_tiles(c.kwargs["BLOCK_K"], elem)):
        bm, bn, split = (c.kwargs[k] for k in ("BLOCK_M", "BLOCK_N", "SPLIT_K"))
        bk = min(bk, max(16, triton.next_power_of_2(row)))
        too_big = bm > max(32, triton.next_power_of_2(m)) or bn > max(32, triton.next_power_of_2(cout))
        tiles = triton.cdiv(m, bm) * triton.cdiv(cout, bn)
        if (too_big or c.num_stages * (bm + bn) * bk * elem > SMEM_BYTES
                or not _split_fits(split, tiles, _steps(args["KH"], row, bk, args["SC_CIN"]), bm, bn)):
            continue
        kept.setdefault((bm, bn, bk, split, c.num_stages, c.num_warps),
                        _config(bm, bn, bk, c.num_stages, c.num_warps, split))
    return list(kept.values()) or [_config(32, 32, 16, 2, 4)]


def _fixed(m, cout, kh, row, elem, shortcut=0):
    """The one config used untuned (autotune off: tiles sized to the problem; interpreter: the largest tiles the
    problem fills, since it runs each tile operation as one numpy call, so fewer, bigger tiles are much faster),
    split-K as deep as _split_fits allows."""
    if INTERPRET:
        bm, bn = 32 if m <= 32 else 64, 64 if cout <= 64 else 128
        bk, warps, stages = min(128, max(16, triton.next_power_of_2(row))), 4, 2
    else:
        bm = 128 if m >= 16384 else 64 if m >= 2048 else 32
        bn = 128 if cout >= 128 and bm >= 64 else 64
        bk = min(64 if elem < 4 else 32, max(16, triton.next_power_of_2(row)))
        warps, stages = 8 if bm * bn >= 16384 else 4, 3
    tiles, steps = triton.cdiv(m, bm) * triton.cdiv(cout, bn), _steps(kh, row, bk, shortcut)
    split = max(s for s in (1, 2, 4, 8, 16) if _split_fits(s, tiles, steps, bm, bn))
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps, num_stages=stages)


_SPLIT_BUFFERS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _split_buffers(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K's workspace (fp32 partial tiles) and per-tile arrival counters (zero between launches) on `device`."""
    if device not in _SPLIT_BUFFERS:
        _SPLIT_BUFFERS[device] = (torch.empty(SPLIT_PROGRAMS * SPLIT_TILE, device=device, dtype=torch.float32),
                                  torch.zeros(SPLIT_PROGRAMS, device=device, dtype=torch.int32))
    return _SPLIT_BUFFERS[device]


@triton.jit
def tf32_round(t, PRECISION: tl.constexpr):
    """Under TF32, an fp32 value that a product will read, rounded to nearest TF32 (ties away, as cuBLAS and cuDNN
    convert) where it is stored: Hopper's tensor cores read the top 19 bits of an fp32 register, a truncation that
    biased every product by about -2^-11 and left the TF32 cell's logits as far from fp32 as bf16's
    (docs/notes/parity.md). Rounded once by its producer, a value costs the K loops nothing (rounded there, each
    time it is loaded, bf16 batch 256 ran 14% slower). Anything else as it is."""
    if PRECISION == "tf32" and t.dtype == tl.float32:
        t = ((t.to(tl.int32, bitcast=True) + 0x1000) & -8192).to(tl.float32, bitcast=True)
    return t


# The interpreter converts fp32 to e4m3 to nearest except where a value rounds up into the next binade, which it
# takes down a binade instead (127.9 to 64, not 128: triton-lang/triton#8322). Under it, to_e4m3 rounds first.
_E4M3_ROUND_FIRST: tl.constexpr = tl.constexpr(INTERPRET)


@triton.jit
def to_e4m3(t):
    """fp32 `t` (saturated to e4m3's +-448 already) as e4m3, to nearest even. Under the interpreter the value is
    first rounded to e4m3's three mantissa bits in fp32 (exact for its normal range, to nearest even), which the
    conversion then keeps: so the CPU tests see the GPU's rounding, and the fp8 recipe's codes."""
    if _E4M3_ROUND_FIRST:
        bits = t.to(tl.int32, bitcast=True)
        t = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    return t.to(tl.float8e4nv)


@triton.jit
def dot_fp32(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b, summed in fp32. For e4m3 operands Triton's default on sm90 leaves the whole K loop to the tensor
    cores' fp8 accumulation, which keeps fewer bits than fp32 (cuBLAS's fast-accumulation mode; DeepSeek-V3 measured
    about 14): its block outputs sat 4-20% of e4m3 codes from the fp32-summed recipe (H200, 2026-12-02). Here the
    tensor cores' sums go into the fp32 accumulator after each dot, every K step, as cuBLAS's default does."""
    if a.dtype.is_fp8():
        return tl.dot(a, b, acc, max_num_imprecise_acc=a.shape[1])
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def norm_relu(a, keep, norm_ptr, c, c_ok, CIN, CHANNEL_AXIS: tl.constexpr):
    """The norm prologue (MLPerf's norm-conv): relu(a * scale + shift) of a batch norm's input tile `a`, its channels
    `c` along CHANNEL_AXIS (norm_ptr: the scale, then the shift, fp32 [2, CIN]), where `keep`, else 0 (the stored
    activation's padding), rounded to a's type as the pass that stores it rounds."""
    scale = tl.load(norm_ptr + c, mask=c_ok, other=0.0)
    shift = tl.load(norm_ptr + CIN + c, mask=c_ok, other=0.0)
    if CHANNEL_AXIS == 1:
        scale, shift = scale[None, :], shift[None, :]
    else:
        scale, shift = scale[:, None], shift[:, None]
    return tl.where(keep, tl.maximum(a.to(tl.float32) * scale + shift, 0.0), 0.0).to(a.dtype)


def check_norm(norm: torch.Tensor | None, cin: int) -> None:
    """A norm prologue's operand: its batch norm's scale and shift, fp32 [2, CIN]."""
    if norm is not None and (norm.shape != (2, cin) or norm.dtype != torch.float32):
        raise ValueError(f"a norm prologue takes its batch norm's scale and shift as fp32 [2, {cin}], not "
                         f"{norm.dtype} {list(norm.shape)}")


def round_tf32(t: torch.Tensor) -> torch.Tensor:
    """fp32 weights rounded to nearest TF32 once, when packed (tf32_round does the activations as they are stored)."""
    bits = t.to(torch.float32).contiguous().view(torch.int32)
    return ((bits + 0x1000) & -0x2000).view(torch.float32)


@triton.jit
def _channel_operands(bias_ptr, scale_ptr, offs_n, n_ok, FP8: tl.constexpr):
    """The epilogue's per-output-channel operands: the folded bias, and FP8's scales (1.0 outside FP8)."""
    bias = tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0)
    scale = tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0) if FP8 else 1.0
    return bias, scale


@triton.jit
def _output_tile(offs_m, offs_n, M, COUT):
    """Offsets and mask of an output tile in y [M, COUT] (and in the residual, shaped like it)."""
    return offs_m[:, None] * COUT + offs_n[None, :], (offs_m < M)[:, None] & (offs_n < COUT)[None, :]


@triton.jit
def _residual(res_ptr, offs, mask, res_scale):
    """A residual tile in fp32: one stored in e4m3 (an FP8 block's input) scaled back by its scale."""
    res = tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if res_ptr.dtype.element_ty.is_fp8():
        res = res * res_scale
    return res


@triton.jit
def _epilogue(acc, offs_m, offs_n, M, COUT, bias, scale, res, res_ptr, res_scale, y_ptr, out_inv,
              LOAD_RES: tl.constexpr, RELU: tl.constexpr, FP8: tl.constexpr, PRECISION: tl.constexpr):
    """On the fp32 tile before it leaves the chip: FP8's scales, folded batch-norm bias, residual (`res`, loaded
    early, or 0.0; with LOAD_RES loaded here, from res_ptr, `_residual`), ReLU; stored (in e4m3: scaled by 1 / the
    output's scale and saturated first; under TF32 rounded to it), and returned as stored. A large tile loads its
    residual here, after the bias is added:
    loaded before (in the caller), it is live beside the accumulator and the bias, and a 128x128 tile needs 132
    registers instead of 128, one program per SM instead of two."""
    if FP8:
        acc = acc * scale[None, :]
    acc += bias[None, :]
    y_offs, y_mask = _output_tile(offs_m, offs_n, M, COUT)
    if LOAD_RES:
        acc += _residual(res_ptr, y_offs, y_mask, res_scale)
    else:
        acc += res
    if RELU:
        acc = tl.maximum(acc, 0.0)
    if y_ptr.dtype.element_ty.is_fp8():
        out = to_e4m3(tl.clamp(acc * out_inv, -448.0, 448.0))
    else:
        out = tf32_round(acc.to(y_ptr.dtype.element_ty), PRECISION)
    tl.store(y_ptr + y_offs, out, mask=y_mask)
    return out  # as stored (kernels/triton/pair.py multiplies it on)


@triton.jit
def _tile_stats(out, offs_m, offs_n, m_ok, n_ok, pid_m, M, COUT, a_ptr, b_ptr, bn_x_ptr, gate_ptr, bn_mean_ptr,
                bn_invstd_ptr, STATS: tl.constexpr, BLOCK_M: tl.constexpr):
    """Two statistics per channel of the stored tile over its output pixels, into row pid_m of a and b (fp32
    [cdiv(M, BLOCK_M), COUT]), as a batch norm's reduction kernels write a slice of BLOCK_M rows. "moments": the
    mean and sum of centred squares (M2). "grad_sums": the tile is the gradient of relu(bn(x)), gated by that
    output (`gate`) and its sum, and its sum times xhat = (x - mean) * invstd of the batch norm's input x."""
    v = tl.where(m_ok[:, None], out.to(tl.float32), 0.0)
    if STATS == "moments":
        a = tl.sum(v, 0) / tl.minimum(M - pid_m * BLOCK_M, BLOCK_M).to(tl.float32)
        centred = tl.where(m_ok[:, None], v - a[None, :], 0.0)
        b = tl.sum(centred * centred, 0)
    else:
        at, ok = _output_tile(offs_m, offs_n, M, COUT)
        v = tl.where(tl.load(gate_ptr + at, mask=ok, other=0.0) > 0, v, 0.0)
        mean = tl.load(bn_mean_ptr + offs_n, mask=n_ok, other=0.0)
        invstd = tl.load(bn_invstd_ptr + offs_n, mask=n_ok, other=0.0)
        xhat = (tl.load(bn_x_ptr + at, mask=ok, other=0.0).to(tl.float32) - mean[None, :]) * invstd[None, :]
        a = tl.sum(v, 0)
        b = tl.sum(v * xhat, 0)
    tl.store(a_ptr + pid_m * COUT + offs_n, a, mask=n_ok)
    tl.store(b_ptr + pid_m * COUT + offs_n, b, mask=n_ok)


@triton.jit
def _first_weight_row(step, k_steps, main_steps, ROW, KH, BLOCK_K: tl.constexpr):
    """The first K row of the weights that K step `step` reads: in window row step // k_steps, or past the window's
    KH * ROW rows, in the shortcut's."""
    return tl.where(step < main_steps, (step // k_steps) * ROW + (step % k_steps) * BLOCK_K,
                    KH * ROW + (step - main_steps) * BLOCK_K)


@triton.jit
def _prefetch_weights(w_ptr, k_lo, k_hi, K, COUT, n0, part, parts, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                      W_KMAJOR: tl.constexpr):
    """prefetch_l2 every 128-byte line of part `part` of `parts` (every parts-th K tile) of the weights' K rows
    [k_lo, k_hi) for output channels n0..n0+BLOCK_N: one address per line, along the contiguous side (COUT, or K
    where K-major)."""
    LINE: tl.constexpr = 128 // (w_ptr.dtype.element_ty.primitive_bitwidth // 8)  # elements per line
    for k0 in range(k_lo + part * BLOCK_K, k_hi, parts * BLOCK_K):
        if W_KMAJOR:  # [COUT, K]: each channel's BLOCK_K run is contiguous
            lines: tl.constexpr = BLOCK_K // LINE if BLOCK_K > LINE else 1
            n = tl.minimum(n0 + tl.arange(0, BLOCK_N), COUT - 1)
            k = tl.minimum(k0 + tl.arange(0, lines) * LINE, K - 1)
            prefetch_l2(w_ptr + n[:, None] * K + k[None, :])
        else:  # [K, COUT]: each row's BLOCK_N run is contiguous
            lines: tl.constexpr = BLOCK_N // LINE if BLOCK_N > LINE else 1
            k = tl.minimum(k0 + tl.arange(0, BLOCK_K), K - 1)
            n = tl.minimum(n0 + tl.arange(0, lines) * LINE, COUT - 1)
            prefetch_l2(w_ptr + k[:, None] * COUT + n[None, :])


@triton.jit
def _window_gemm(x_ptr, w_ptr, res_ptr, offs_m, offs_n, m_ok, n_ok, first, last, H, W, CIN, OH, OW, COUT,
                 SC_H, SC_W, SC_CIN, a_inv, KH: tl.constexpr, KW: tl.constexpr, STRIDE: tl.constexpr,
                 PAD: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr, W_KMAJOR: tl.constexpr,
                 SC_STRIDE: tl.constexpr, K_ALIGN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, norm_ptr, NORM: tl.constexpr):
    """The fp32 tile conv(x) [offs_m, offs_n] over K steps [first, last): the window's (KH rows of KW*CIN elements,
    each row in K tiles), then, with a fused downsample (SC_STRIDE > 0), the shortcut's SC_CIN channels. NORM:
    x is a batch norm's input, taken through its affine map and ReLU on the fly (norm_ptr: its scale, then its
    shift, per channel, fp32 [2, CIN]), rounded to x's type as the pass that stores them rounds."""
    ROW = KW * CIN  # elements in one window row, contiguous in memory
    k_steps = tl.cdiv(ROW, BLOCK_K)
    main_steps = KH * k_steps
    K = KH * ROW + SC_CIN
    offs_k = tl.arange(0, BLOCK_K)
    # Where each output pixel's window starts in x (and its pixel in the shortcut, the block's input). At batch 1 a
    # kernel is a few thousand instructions per warp, issued with one warp per scheduler: integer divisions by
    # runtime sizes cost there. A 1x1 stride-1 window (and a stride-1 shortcut) is the output pixel itself.
    if KH == 1 and KW == 1 and STRIDE == 1 and PAD == 0 and SC_STRIDE <= 1:
        window, shortcut = offs_m * CIN, offs_m * SC_CIN
    else:
        ow = offs_m % OW
        oh = (offs_m // OW) % OH
        img = offs_m // (OW * OH)
        ih0, iw0 = oh * STRIDE - PAD, ow * STRIDE - PAD  # the window's start (< 0: in the padding)
        window = ((img * H + ih0) * W + iw0) * CIN  # ... as an offset into x, at the window's first row
        shortcut = ((img * SC_H + oh * SC_STRIDE) * SC_W + ow * SC_STRIDE) * SC_CIN
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # One flat loop over every K step (window row kh, K tile in that row; then the shortcut's K tiles), so Triton
    # software-pipelines all of it: the shortcut's first loads are in flight while the window's last tiles multiply.
    # The step's window row kh and K tile kt in that row, advanced as counters (no division in the loop).
    kh = first // k_steps if SPLIT_K > 1 else 0
    kt = first - kh * k_steps
    for step in range(first, last):
        k0 = kt * BLOCK_K  # the K tile's first position inside the window row
        src, rows, row_len, w_row = x_ptr, window + kh * W * CIN, ROW, kh * ROW
        if SC_STRIDE > 0:  # a step past the window reads the shortcut's channels instead (scalar and 1-D selects)
            in_shortcut = step >= main_steps
            k0 = tl.where(in_shortcut, (step - main_steps) * BLOCK_K, k0)
            src = tl.where(in_shortcut, res_ptr, x_ptr)
            # (through a tl.where, Triton's alignment analysis would lose the rows' 16-element alignment, and with it
            # the asynchronous copies of A)
            rows += in_shortcut.to(tl.int32) * (shortcut - rows)
            row_len = tl.where(in_shortcut, SC_CIN, ROW)
            w_row = tl.where(in_shortcut, KH * ROW, w_row)
        kk = k0 + offs_k  # positions inside the row
        k = w_row + kk  # rows of the weights
        # K tiles that divide the window rows and the shortcut's channels are never partial: no mask along K
        k_ok = kk < row_len if K_ALIGN % BLOCK_K else tl.full((BLOCK_K,), True, tl.int1)
        a_mask = m_ok[:, None] & k_ok[None, :]
        if PAD > 0:  # the window may hang over the image border: those elements are the zero padding
            ih = ih0 + kh
            col = (iw0 * CIN)[:, None] + kk[None, :]  # offset inside the image row
            inside = ((ih >= 0) & (ih < H))[:, None] & (col >= 0) & (col < W * CIN)
            if SC_STRIDE > 0:
                inside = inside | in_shortcut
            a_mask = a_mask & inside
        a = tl.load(src + rows[:, None] + kk[None, :], mask=a_mask, other=0.0)
        if NORM:  # MLPerf's norm-conv: the normalised activation is never stored
            a = norm_relu(a, a_mask, norm_ptr, kk % CIN if KW > 1 else kk, k_ok, CIN, 1)
        if FP8 and not x_ptr.dtype.element_ty.is_fp8():  # e4m3 saturates at 448: clamp first, as a calibrated
            a = to_e4m3(tl.clamp(a.to(tl.float32) * a_inv, -448.0, 448.0))  # scale leaves only outliers
        if W_KMAJOR:
            b_ptrs = w_ptr + offs_n[None, :] * K + k[:, None]
        else:
            b_ptrs = w_ptr + k[:, None] * COUT + offs_n[None, :]
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = dot_fp32(a, b, acc, PRECISION)
        kt += 1
        kh += (kt == k_steps).to(tl.int32)
        kt = tl.where(kt == k_steps, 0, kt)
    return acc


# PRECISION in the key: TF32 and strict fp32 share their dtypes but not their best tiles (each tuned for itself).
# STATS in the key: the epilogue's statistics change which tile is fastest (the data gradient's sums take the
# largest tiles to 255 registers), so each kind is tuned on its own
@autotune(CONFIGS, key=["M", "H", "W", "CIN", "COUT", "KH", "KW", "STRIDE", "PRECISION", "SC_CIN", "SC_STRIDE",
                        "STATS"], prune=_prune)
@triton.jit(do_not_specialize=["M", "H", "W", "OH", "OW", "SC_H", "SC_W"])  # one compile for every layer's sizes
def conv2d_nhwc_kernel(
        x_ptr, w_ptr, bias_ptr, res_ptr, y_ptr,  # x [N,H,W,CIN]; w [K, COUT] or K-major [COUT, K] (K = KH*KW*CIN
        M, H, W, CIN, OH, OW, COUT,              # + SC_CIN); bias [COUT] fp32; res, y [M, COUT]
        SC_H, SC_W, SC_CIN,  # the shortcut: res [N, SC_H, SC_W, SC_CIN] is the block's input, and y adds its 1x1
                             # convolution at stride SC_STRIDE (the downsample), weights after x's along K
        scale_ptr, a_inv, out_inv, res_scale,  # FP8: [COUT] fp32, the input's scale times each channel's weight
                                               # scale; 1 / the input's scale; 1 / the output's (y in e4m3); the
                                               # residual's scale (res in e4m3)
        part_ptr, count_ptr,  # split-K: fp32 partial tiles [SPLIT_K, tiles, BLOCK_M, BLOCK_N]; int32 counters [tiles]
        a_ptr, b_ptr,  # STATS: each row of tiles' two statistics per channel, fp32 [cdiv(M, BLOCK_M), COUT]
        bn_x_ptr, gate_ptr, bn_mean_ptr, bn_invstd_ptr,  # "grad_sums": the batch norm's input, ReLU'd output (both
                                                         # as y) and moments (fp32 [COUT])
        KH: tl.constexpr, KW: tl.constexpr, STRIDE: tl.constexpr, PAD: tl.constexpr,
        HAS_RES: tl.constexpr, RELU: tl.constexpr, PRECISION: tl.constexpr,  # PRECISION: "ieee" (fp32) or "tf32"
        FP8: tl.constexpr, W_KMAJOR: tl.constexpr, SC_STRIDE: tl.constexpr,  # SC_STRIDE 0: no shortcut
        K_ALIGN: tl.constexpr,  # a power of two (at most 128) dividing KW * CIN and SC_CIN
        STATS: tl.constexpr,  # "none", "moments" or "grad_sums" (_tile_stats)
        NORM: tl.constexpr,  # x a batch norm's input, normalised and ReLU'd on the load (_window_gemm; scale_ptr:
                             # its scale and shift, fp32 [2, CIN])
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr = 1,
        GROUP_M: tl.constexpr = 8, GDC: tl.constexpr = False):
    tl.static_assert(SC_STRIDE == 0 or not (HAS_RES or FP8), "a shortcut replaces the residual; bf16/fp32 only")
    tl.static_assert(STATS == "none" or not FP8, "statistics of the values as stored: bf16/fp32 outputs only")
    tl.static_assert(not NORM or not (FP8 or SC_STRIDE), "a norm prologue takes scale_ptr, and no shortcut")
    # Which output tile, and (split-K) which slice of K: programs are numbered in groups of GROUP_M tiles down M, so
    # programs running together share the same weight tiles (and neighbouring input rows) in L2.
    # (Each integer division by a runtime size is some 20 instructions: batch 1's few tiles take a shorter way.)
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(COUT, BLOCK_N)
    tile = pid % (num_m * num_n) if SPLIT_K > 1 else pid
    if num_m <= GROUP_M:  # one group holds every row of tiles
        pid_m = tile % num_m
        pid_n = tile // num_m
    else:
        first_m = (tile // (GROUP_M * num_n)) * GROUP_M
        group_m = min(num_m - first_m, GROUP_M)
        pid_m = first_m + (tile % (GROUP_M * num_n)) % group_m
        pid_n = (tile % (GROUP_M * num_n)) // group_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # output pixels (n, oh, ow) of this tile
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output channels of this tile
    m_ok, n_ok = offs_m < M, offs_n < COUT

    # K steps: the window's (KH rows of KW*CIN elements, each row in K tiles), then the shortcut's SC_CIN channels.
    ROW = KW * CIN  # elements in one window row, contiguous in memory
    k_steps = tl.cdiv(ROW, BLOCK_K)
    main_steps = KH * k_steps
    steps = main_steps + tl.cdiv(SC_CIN, BLOCK_K)
    K = KH * ROW + SC_CIN
    if SPLIT_K == 1:
        first, last = 0, steps
    else:
        per_slice = tl.cdiv(steps, SPLIT_K)
        first = (pid // (num_m * num_n)) * per_slice
        last = tl.minimum(first + per_slice, steps)
    # No kernel writes the weights: fetch the slice into L2 while the kernel before still runs, each line once,
    # shared among the programs of the slice's column of tiles (program pid_m takes every num_m-th K tile): one
    # program alone would start its own tile that much later.
    # (A slice past the last step, last <= first, has k_lo >= K: nothing to fetch.)
    if GDC:
        if SPLIT_K == 1:  # every weight row
            k_lo, k_hi = 0, K
        else:
            k_lo = _first_weight_row(first, k_steps, main_steps, ROW, KH, BLOCK_K)
            k_hi = tl.minimum(_first_weight_row(last - 1, k_steps, main_steps, ROW, KH, BLOCK_K) + BLOCK_K, K)
        _prefetch_weights(w_ptr, k_lo, k_hi, K, COUT, pid_n * BLOCK_N, pid_m, num_m, BLOCK_K, BLOCK_N, W_KMAJOR)
    # A small tile (batch 1's: latency-bound) loads its epilogue's operands early, so their latency is not added
    # after the last K step: the per-channel ones, which no kernel writes, even before the wait (off the chain of
    # kernels), the residual before the K loop. A large tile would hold them in registers through the loop.
    EARLY: tl.constexpr = BLOCK_M * BLOCK_N <= EARLY_TILE
    if EARLY:
        bias, scale = _channel_operands(bias_ptr, scale_ptr, offs_n, n_ok, FP8)
    wait_for_prior_kernel(GDC)  # nothing above loaded what a kernel writes, or stored

    res = 0.0
    if EARLY and HAS_RES:
        y_offs, y_mask = _output_tile(offs_m, offs_n, M, COUT)
        res = _residual(res_ptr, y_offs, y_mask, res_scale)
    acc = _window_gemm(x_ptr, w_ptr, res_ptr, offs_m, offs_n, m_ok, n_ok, first, last, H, W, CIN, OH, OW, COUT,
                       SC_H, SC_W, SC_CIN, a_inv, KH, KW, STRIDE, PAD, PRECISION, FP8, W_KMAJOR, SC_STRIDE, K_ALIGN,
                       BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, scale_ptr, NORM)

    LATE_RES: tl.constexpr = HAS_RES and not EARLY
    if not EARLY:
        bias, scale = _channel_operands(bias_ptr, scale_ptr, offs_n, n_ok, FP8)
    if SPLIT_K == 1:
        out = _epilogue(acc, offs_m, offs_n, M, COUT, bias, scale, res, res_ptr, res_scale, y_ptr, out_inv,
                        LATE_RES, RELU, FP8, PRECISION)
        if STATS != "none":
            _tile_stats(out, offs_m, offs_n, m_ok, n_ok, pid_m, M, COUT, a_ptr, b_ptr, bn_x_ptr, gate_ptr,
                        bn_mean_ptr, bn_invstd_ptr, STATS, BLOCK_M)
    else:
        tiles = num_m * num_n
        in_tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        # only the rows of real output pixels: the classifier at batch 1 fills one row of its tile's 32
        tl.store(part_ptr + (pid * BLOCK_M * BLOCK_N + in_tile), acc, mask=m_ok[:, None])  # pid: slice * tiles + tile
        tl.debug_barrier()  # every thread's part of the partial stored before the counter says it is
        if tl.atomic_add(count_ptr + tile, 1, sem="acq_rel") == SPLIT_K - 1:  # the last of the tile's slices
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k_slice in tl.static_range(SPLIT_K):  # in slice order: the same sum whichever slice came last;
                # unrolled, so the loads of all slices are in flight together, not one L2 round trip per slice
                acc += tl.load(part_ptr + ((k_slice * tiles + tile) * BLOCK_M * BLOCK_N + in_tile),
                               mask=m_ok[:, None], other=0.0,
                               cache_modifier=".cg")  # from L2, where the other SMs' partials are
            tl.atomic_xchg(count_ptr + tile, 0)  # ready for the next launch
            out = _epilogue(acc, offs_m, offs_n, M, COUT, bias, scale, res, res_ptr, res_scale, y_ptr, out_inv,
                            LATE_RES, RELU, FP8, PRECISION)
            if STATS != "none":
                _tile_stats(out, offs_m, offs_n, m_ok, n_ok, pid_m, M, COUT, a_ptr, b_ptr, bn_x_ptr, gate_ptr,
                            bn_mean_ptr, bn_invstd_ptr, STATS, BLOCK_M)


@dataclass
class PackedConv:
    """A convolution with its batch-norm folded in, laid out for the kernel."""

    weight: torch.Tensor  # [KH*KW*CIN, COUT]: rows ordered (kh, kw, cin), cin fastest, matching the NHWC input;
    bias: torch.Tensor  # [COUT], fp32 (added to the fp32 accumulator)      K-major: its transpose, [COUT, K]
    kh: int
    kw: int
    stride: int
    pad: int
    cout: int
    kmajor: bool = False
    fp8: bool = False
    scale: torch.Tensor | None = None  # FP8: [COUT] fp32, the input's scale (amax / 448) x each channel's weights'
    input_inv: float = 1.0  # FP8: 1 / the input's calibrated scale
    output_inv: float | None = None  # FP8: 1 / the output's calibrated scale, where it is stored in e4m3
    output_dtype: torch.dtype | None = None  # FP8: e4m3 or the network's activations' type; else None: the input's
    shortcut_stride: int = 0  # the block's downsample fused in (fuse_shortcut), at this stride; 0: none

    def output_size(self, h: int, w: int) -> tuple[int, int]:
        """The output's height and width over an input of h x w (as the kernel reads it)."""
        return (h + 2 * self.pad - self.kh) // self.stride + 1, (w + 2 * self.pad - self.kw) // self.stride + 1


E4M3_MAX = 448.0  # the largest finite e4m3 value


def fold_batch_norm(weight, bn=None, bias=None) -> tuple[torch.Tensor, torch.Tensor]:
    """An eval-mode BatchNorm2d (`bn`) folded into the convolution's [COUT, CIN, KH, KW] `weight` and `bias`, in
    fp64 on the host: bn(conv(x)) = conv(x; weight * s) + (bias - mean) * s + beta, with s = gamma / sqrt(var + eps)."""
    def f64(t):  # folding happens on the host, wherever the model lives
        return t.detach().to("cpu", torch.float64)

    w = f64(weight)
    b = f64(bias) if bias is not None else torch.zeros(w.shape[0], dtype=torch.float64)
    if bn is not None:
        s = f64(bn.weight) / torch.sqrt(f64(bn.running_var) + bn.eps)
        w = w * s[:, None, None, None]
        b = (b - f64(bn.running_mean)) * s + f64(bn.bias)
    return w, b


def pack_conv(weight, stride=1, pad=0, bn=None, bias=None, dtype=torch.float32, device="cpu", kmajor=False,
              input_amax: float | None = None, output_amax: float | None = None, tf32: bool = False) -> PackedConv:
    """Fold an eval-mode BatchNorm2d (`bn`) into the convolution (fold_batch_norm) and round it once to `dtype`;
    with `input_amax` (the largest |input| the calibration saw), to e4m3 with one scale for the weights and one for
    the input, K-major, and with `output_amax` too (the largest |output|), writing its output in e4m3. `tf32`: fp32
    weights rounded to nearest TF32, for a network whose products are TF32's."""
    w, b = fold_batch_norm(weight, bn, bias)
    cout, _, kh, kw = w.shape
    packed = _gemm_rows(w)
    bias32 = b.to(device, torch.float32).contiguous()
    if input_amax is not None:
        w_scale = packed.abs().amax(0).clamp_min(1e-30) / E4M3_MAX  # per output channel
        e4m3 = (packed / w_scale).t().to(torch.float8_e4m3fn)
        input_scale = max(input_amax, 1e-30) / E4M3_MAX
        return PackedConv(e4m3.to(device).contiguous(), bias32, kh, kw, stride, pad, cout, kmajor=True, fp8=True,
                          scale=(w_scale * input_scale).to(device, torch.float32).contiguous(),
                          input_inv=E4M3_MAX / max(input_amax, 1e-30),  # as its producer's output_inv, exactly
                          output_inv=E4M3_MAX / max(output_amax, 1e-30) if output_amax is not None else None,
                          output_dtype=torch.float8_e4m3fn if output_amax is not None else dtype)
    if tf32:
        packed = round_tf32(packed)
    if kmajor:
        packed = packed.t()
    return PackedConv(packed.to(device, dtype).contiguous(), bias32, kh, kw, stride, pad, cout, kmajor=kmajor)


def pack_weights(weight: torch.Tensor, stride: int = 1, pad: int = 0, bias: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.float32) -> PackedConv:
    """A convolution's [COUT, CIN, KH, KW] `weight` (and `bias`) laid out for the kernel where it lives, with no
    batch norm to fold: a training step's, packed every step from the current weights. (pack_conv folds on the
    host in fp64, a copy each way and host work per convolution: in a ResNet-50 step, 108 synchronising copies and
    most of its 326 ms of host time, H200.) The same bits as pack_conv's: fp32 to fp64 is exact, so either path
    rounds once to `dtype`."""
    cout, _, kh, kw = weight.shape
    packed = _gemm_rows(weight.detach()).to(dtype).contiguous()
    b = bias.detach().float().contiguous() if bias is not None else _zero_bias(cout, weight.device)
    return PackedConv(packed, b, kh, kw, stride, pad, cout)


def _gemm_rows(weight: torch.Tensor) -> torch.Tensor:
    """[COUT, CIN, KH, KW] as the implicit GEMM's [KH*KW*CIN, COUT]: rows ordered (kh, kw, cin), as NHWC windows."""
    cout, cin, kh, kw = weight.shape
    return weight.permute(2, 3, 1, 0).reshape(kh * kw * cin, cout)


@functools.lru_cache(maxsize=None)
def _zero_bias(cout: int, device: torch.device) -> torch.Tensor:
    return torch.zeros(cout, device=device, dtype=torch.float32)


def check_residual_scale(residual: torch.Tensor | None, scale: float | None) -> None:
    """A residual stored in e4m3 needs its scale to be read back; one in any other type has none."""
    if (residual is not None and residual.dtype == torch.float8_e4m3fn) != (scale is not None):
        raise ValueError(f"a residual in e4m3 takes its scale (residual_scale), any other none; got a "
                         f"{None if residual is None else residual.dtype} residual and scale {scale}")


def fuse_shortcut(last: PackedConv, down: PackedConv) -> PackedConv:
    """A block's last convolution with its downsample (1x1, batch-norm folded) fused in: relu(conv(x) +
    downsample(block input)) as one GEMM whose K runs over the convolution's window and then the block input's
    channels, with one bias (their sum). The downsample's output, as large as the block's, never goes through memory,
    and a block is one launch shorter. Not in FP8, where the two inputs would need scales of their own."""
    if last.fp8 or down.fp8 or (down.kh, down.kw, down.pad) != (1, 1, 0) or last.kmajor != down.kmajor:
        raise ValueError(f"fuse_shortcut takes a 1x1 unpadded downsample packed like the convolution, outside FP8; "
                         f"not {down.kh}x{down.kw} pad {down.pad}, fp8 {last.fp8 or down.fp8}, K-major "
                         f"{last.kmajor}/{down.kmajor}")
    weight = torch.cat([last.weight, down.weight], dim=1 if last.kmajor else 0).contiguous()
    return replace(last, weight=weight, bias=last.bias + down.bias, shortcut_stride=down.stride)


def conv2d(x: torch.Tensor, p: PackedConv, residual: torch.Tensor | None = None, relu: bool = True,
           precision: str = "ieee", tune: bool = True, pdl: bool = False,
           shortcut: torch.Tensor | None = None, residual_scale: float | None = None,
           norm: torch.Tensor | None = None) -> torch.Tensor:
    """y = relu(conv(x) + bias + residual), NHWC in and out (`x` contiguous [N, H, W, CIN]); with a fused downsample
    (fuse_shortcut), relu(conv(x) + downsample(shortcut) + bias), `shortcut` the block's input. A residual stored in
    e4m3 comes with its scale (`residual_scale`). `pdl`: launched as a programmatic dependent launch
    (kernels/triton/pdl.py). `norm`: x is a batch norm's input and the convolution reads relu(x * scale + shift),
    norm its scale and shift, fp32 [2, CIN] (the norm prologue)."""
    return _conv2d(x, p, residual, relu, precision, tune, pdl, shortcut, residual_scale=residual_scale, norm=norm)[0]


class TileStats(NamedTuple):
    """Two per-channel statistics of a convolution's output (_tile_stats), fp32 [slices, COUT] each, a slice per row
    of output tiles of `rows` pixels (the last one short; only the first cdiv(M, rows) rows are written)."""
    a: torch.Tensor
    b: torch.Tensor
    rows: int


class BatchNormSaved(NamedTuple):
    """What a batch norm's backward reads of its forward, for a gradient's producer to sum it: its input x, its
    ReLU'd output (the gate) and its moments."""
    x: torch.Tensor
    gate: torch.Tensor
    mean: torch.Tensor
    invstd: torch.Tensor


def conv2d_stats(x: torch.Tensor, p: PackedConv, residual: torch.Tensor | None = None,
                 bn: BatchNormSaved | None = None, precision: str = "ieee",
                 tune: bool = True, norm: torch.Tensor | None = None) -> tuple[torch.Tensor, TileStats]:
    """conv(x) + bias [+ residual], without a ReLU, and two statistics per channel from its epilogue (_tile_stats):
    without `bn` its moments (it is a batch norm's input); with `bn`, it is the gradient of that batch norm's
    output, and the sums its backward needs. `norm` as conv2d's."""
    n, h, w, _ = x.shape
    oh, ow = p.output_size(h, w)
    slices = triton.cdiv(n * oh * ow, MIN_BLOCK_M)  # rows for any tile the tuning picks
    a, b = (torch.empty((slices, p.cout), device=x.device, dtype=torch.float32) for _ in range(2))
    y, chosen = _conv2d(x, p, residual, False, precision, tune, False, None, (a, b), bn, norm=norm)
    return y, TileStats(a, b, chosen["BLOCK_M"])


def _conv2d(x, p, residual, relu, precision, tune, pdl, shortcut, stats=None, bn=None,
            residual_scale=None, norm=None) -> tuple[torch.Tensor, dict]:
    """conv2d's launch, also for conv2d_stats (`stats`: the two statistics' buffers; `bn`: a BatchNormSaved for
    "grad_sums", else "moments"): y and the meta-parameters it ran with."""
    if bool(p.shortcut_stride) != (shortcut is not None) or (shortcut is not None and residual is not None):
        raise ValueError("a convolution with its downsample fused in takes the block's input as `shortcut` (and no "
                         "residual); any other takes no shortcut")
    check_norm(norm, x.shape[-1])
    if norm is not None and (p.fp8 or shortcut is not None):
        raise ValueError("a norm prologue takes no fp8 convolution or fused shortcut")
    check_residual_scale(residual, residual_scale)
    n, h, w, cin = x.shape
    cout = p.cout
    oh, ow = p.output_size(h, w)
    y = torch.empty((n, oh, ow, cout), device=x.device, dtype=p.output_dtype or x.dtype)
    m = n * oh * ow

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(cout, meta["BLOCK_N"]) * meta["SPLIT_K"],)

    # res_ptr carries the residual, or the shortcut's input (y: unused); unused statistics' pointers take y and the
    # bias, so that a launch's dtypes in its tuning key do not depend on its statistics (STATS names those)
    second = shortcut if shortcut is not None else residual if residual is not None else y
    sc_h, sc_w, sc_cin = shortcut.shape[1:] if shortcut is not None else (0, 0, 0)
    kind = "none" if stats is None else "moments" if bn is None else "grad_sums"
    args = (x, p.weight, p.bias, second, y, m, h, w, cin, oh, ow, cout, sc_h, sc_w, sc_cin,
            p.scale if p.fp8 else norm if norm is not None else p.bias,  # the scale pointer (bias: unused)
            p.input_inv, p.output_inv or 1.0,
            residual_scale or 1.0, *_split_buffers(x.device), *(stats or (p.bias, p.bias)),
            *(bn or (y, y, p.bias, p.bias)), p.kh, p.kw,
            p.stride, p.pad, residual is not None, relu, precision, p.fp8, p.kmajor, p.shortcut_stride,
            math.gcd(p.kw * cin, sc_cin, 128), kind, norm is not None)
    chosen = launch(conv2d_nhwc_kernel, grid, args, tune, _fixed(m, cout, p.kh, p.kw * cin, x.element_size(), sc_cin),
                    pdl)
    return y, chosen
