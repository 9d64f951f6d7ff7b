"""A bottleneck's 3x3 convolution and the 1x1 convolution after it as one kernel: the 3x3's output stays on the chip.

In a bottleneck block, conv2 (3x3, C channels) feeds conv3 (1x1, C -> COUT2, plus the residual and ReLU; in a
block's first, the downsample fused in instead, conv.py `fuse_shortcut`: its K then goes on over the block input's
channels). Apart, conv2 writes its [M, C] output and conv3 reads it back: at batch 256, 103 MB each way in every
layer1 block. Here a program computes conv2's tile for all C channels at once (C at most 256: the whole row of
channels is one tile) with conv2's own K loop (conv.py `_window_gemm`), applies its bias and ReLU, rounds it as
conv2 would have stored it (the activations' type; in fp8, e4m3 in conv3's input scale), and multiplies it, still
in registers, by conv3's weights, BLOCK_N2 output channels at a time, each slice with conv3's epilogue. Flash
attention keeps its scores on the chip between its two products the same way.

What it costs: conv2's tile can no longer be split along its channels, so a launch has M / BLOCK_M programs, and
each runs both products in turn. On the H100 at batch 256 (bf16, `results/.../checks/pairs/`) a layer1 pair ran in
395 us against 569 apart, a layer2 pair 251 against 309, but a layer3 pair (256 channels: a 64 x 256 fp32 tile,
one program of 8 warps per SM) 316 against 195. A block's first, its downsample fused in: layer1.0 448 against 493,
but layer2.0, whose 256 input channels each slice of conv3 reads again, 434 against 355. So the pair runs by
default (`pays`) where conv2 has at most 128 channels, the block's input (if conv3 reads it) no more, and the batch
gives every SM a tile (not at batch 1).

Chained (`chain`, C3 > 0), the pair also runs the next block's conv1 (a 1x1) on its output: each slice, as
stored, is multiplied by that conv1's weights too, so conv1 never reads the block's output back. It paid only into
a 64-channel conv1 after a pair without a downsample (`chain_pays`).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.triton.conv import (SMEM_BYTES, PackedConv, _channel_operands, _epilogue, _k_tiles, _prefetch_weights,
                                 _window_gemm, check_residual_scale, dot_fp32, tf32_round, to_e4m3)
from kernels.triton.pdl import wait_for_prior_kernel
from kernels.triton.tuning import INTERPRET, autotune, launch

# The pair is the default (pairs=auto) where conv2 has at least this many output pixels (a 64-pixel tile for each
# of an H100's or H200's 132 SMs) and at most this many channels.
PAIR_MIN_PIXELS, PAIR_MAX_CHANNELS = 132 * 64, 128

# 64- and 128-pixel tiles, conv3 in slices of 64 or 128 channels, 4 or 8 warps; 4 stages for the large tiles only
# (each configuration is compiled and timed on a cold build: ten, not all 24 combinations)
CONFIGS = [triton.Config({"BLOCK_M": bm, "BLOCK_K": 64, "BLOCK_N2": bn2}, num_stages=stages, num_warps=warps)
           for bm in (64, 128) for bn2 in (64, 128) for warps in (4, 8)
           for stages in ((3, 4) if bm == 128 and warps == 8 else (3,))]


def _prune(configs, args, **_):
    """Configurations whose fp32 tiles (conv2's BLOCK_M x C; conv3's BLOCK_M x BLOCK_N2 beside the next conv1's
    BLOCK_M x C3) hold at most 64 values a thread, and whose shared memory fits: conv2's pipeline, two of conv3's
    weight slices and, chained, two of the next conv1's and the slice it reads (ptxas agrees within 25% on the
    H100's tiles); K tiles per element size as conv.py's (_k_tiles)."""
    elem, c, m, cout2, c3 = (args["x_ptr"].element_size(), args["COUT"], args["M"], args["COUT2"],
                             args.get("C3", 0))
    kept = []
    for cfg, bk in ((cfg, bk) for cfg in configs for bk in _k_tiles(cfg.kwargs["BLOCK_K"], elem)):
        bm, bn2 = (cfg.kwargs[k] for k in ("BLOCK_M", "BLOCK_N2"))
        threads = 32 * cfg.num_warps
        if (bm * c <= 64 * threads and bm * (bn2 + c3) <= 64 * threads and bn2 <= cout2
                and bm <= max(32, triton.next_power_of_2(m))
                and (cfg.num_stages * (bm + c) * bk + 2 * c * bn2 + (2 * bn2 * c3 + bm * bn2 if c3 else 0)) * elem
                <= SMEM_BYTES):
            kept.append(triton.Config({"BLOCK_M": bm, "BLOCK_K": bk, "BLOCK_N2": bn2}, num_stages=cfg.num_stages,
                                      num_warps=cfg.num_warps))
    return kept or [triton.Config({"BLOCK_M": 32, "BLOCK_K": 16, "BLOCK_N2": 32}, num_stages=2, num_warps=4)]


@autotune(CONFIGS, key=["M", "H", "W", "CIN", "COUT", "COUT2", "KH", "KW", "STRIDE", "PRECISION", "SC_CIN",
                        "SC_STRIDE", "C3"], prune=_prune)
@triton.jit(do_not_specialize=["M", "H", "W", "OH", "OW", "SC_H", "SC_W"])  # one compile for every layer's sizes
def conv_pair_kernel(
        x_ptr, w_ptr, bias_ptr,  # conv2: x [N, H, W, CIN]; w [K, COUT] or K-major [COUT, K]; bias [COUT] fp32
        w2_ptr, bias2_ptr, res_ptr, y_ptr,  # conv3: w2 [K2, COUT2] or K-major [COUT2, K2], K2 = COUT + SC_CIN;
        M, H, W, CIN, OH, OW, COUT2,        # res, y [M, COUT2]
        SC_H, SC_W, SC_CIN,  # a downsample fused into conv3 (conv.py `fuse_shortcut`): res [N, SC_H, SC_W, SC_CIN] is
                             # the block's input, read at stride SC_STRIDE (0: none; res is the residual)
        scale_ptr, a_inv, mid_inv, scale2_ptr, out2_inv, res_scale,  # FP8: conv2's scales ([COUT], 1 / x's), 1 /
        # conv3's input scale, conv3's scales [COUT2], 1 / its output's scale (y in e4m3), the residual's scale
        # (res in e4m3) (conv.py's kernel has the same)
        w3_ptr, bias3_ptr, y3_ptr, scale3_ptr, a3_inv, out3_inv,  # the next block's conv1 (C3 > 0): w3 [COUT2, C3]
        # or K-major [C3, COUT2], y3 [M, C3]; FP8: its scales [C3], 1 / its input's scale, 1 / its output's scale
        COUT: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, STRIDE: tl.constexpr, PAD: tl.constexpr,
        PRECISION: tl.constexpr, FP8: tl.constexpr, W_KMAJOR: tl.constexpr, K_ALIGN: tl.constexpr,
        SC_STRIDE: tl.constexpr, C3: tl.constexpr,  # C3: the next block's conv1's channels (0: not chained)
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N2: tl.constexpr, GDC: tl.constexpr = False):
    tl.static_assert(SC_STRIDE == 0 or not FP8, "a fused downsample: bf16/fp32 only, as fuse_shortcut")
    pid = tl.program_id(0)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)  # output pixels (n, oh, ow), the same for both convolutions
    offs_c = tl.arange(0, COUT)  # every channel of conv2's output: conv3's K
    m_ok, c_ok = offs_m < M, offs_c < COUT
    steps = KH * tl.cdiv(KW * CIN, BLOCK_K)
    if GDC:  # conv2's weights into L2 while the kernel before runs, shared among the programs (conv.py's kernel)
        K = KH * KW * CIN
        _prefetch_weights(w_ptr, 0, K, K, COUT, 0, pid, tl.num_programs(0), BLOCK_K, COUT, W_KMAJOR)
    wait_for_prior_kernel(GDC)

    acc = _window_gemm(x_ptr, w_ptr, x_ptr, offs_m, offs_c, m_ok, c_ok, 0, steps, H, W, CIN, OH, OW, COUT, 0, 0, 0,
                       a_inv, KH, KW, STRIDE, PAD, PRECISION, FP8, W_KMAJOR, 0, K_ALIGN, BLOCK_M, COUT, BLOCK_K, 1,
                       x_ptr, False)
    bias, scale = _channel_operands(bias_ptr, scale_ptr, offs_c, c_ok, FP8)
    if FP8:
        acc = acc * scale[None, :]
    mid = tl.maximum(acc + bias[None, :], 0.0)  # conv2's output, rounded as it would have been stored
    if FP8:
        mid = to_e4m3(tl.clamp(mid * mid_inv, -448.0, 448.0))
    else:
        mid = tf32_round(mid.to(x_ptr.dtype.element_ty), PRECISION)

    K2 = COUT + SC_CIN  # conv3's K: conv2's channels, then the block input's (the downsample's weights after)
    if SC_STRIDE > 0:  # each output pixel's pixel in the block's input
        if SC_STRIDE == 1:
            shortcut = offs_m * SC_CIN
        else:
            ow = offs_m % OW
            oh = (offs_m // OW) % OH
            shortcut = (((offs_m // (OW * OH)) * SC_H + oh * SC_STRIDE) * SC_W + ow * SC_STRIDE) * SC_CIN
    if C3 > 0:  # the next block's conv1, whose K is this block's output: one more product per slice
        offs_c3 = tl.arange(0, C3)
        c3_ok = offs_c3 < C3
        acc3 = tl.zeros((BLOCK_M, C3), dtype=tl.float32)
    for n0 in range(0, COUT2, BLOCK_N2):  # conv3, BLOCK_N2 output channels at a time, each with its epilogue
        offs_n = n0 + tl.arange(0, BLOCK_N2)
        n_ok = offs_n < COUT2
        acc2 = dot_fp32(mid, _weight_rows(w2_ptr, offs_c, offs_n, c_ok, n_ok, K2, COUT2, W_KMAJOR), None, PRECISION)
        if SC_STRIDE > 0:  # plus the downsample: the block input's channels, BLOCK_K at a time
            for k0 in range(0, SC_CIN, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                k_ok = kk < SC_CIN
                a = tl.load(res_ptr + shortcut[:, None] + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                acc2 = tl.dot(a, _weight_rows(w2_ptr, COUT + kk, offs_n, k_ok, n_ok, K2, COUT2, W_KMAJOR), acc2,
                              input_precision=PRECISION)
        bias2, scale2 = _channel_operands(bias2_ptr, scale2_ptr, offs_n, n_ok, FP8)
        out = _epilogue(acc2, offs_m, offs_n, M, COUT2, bias2, scale2, 0.0, res_ptr, res_scale, y_ptr, out2_inv,
                        SC_STRIDE == 0, True, FP8, PRECISION)
        if C3 > 0:  # the slice as stored, into the next conv1 (in FP8 as e4m3 in its input scale, as it would read it)
            if FP8:  # stored in e4m3 already (in y's scale), it is rescaled all the same: the dot then multiplies a
                # value of its own, not the stored one (which on sm90 gave results that changed from call to call:
                # results/.../checks/fp8-e4m3-boundaries/)
                rescale = a3_inv / out2_inv if y_ptr.dtype.element_ty.is_fp8() else a3_inv
                out = to_e4m3(tl.clamp(out.to(tl.float32) * rescale, -448.0, 448.0))
            acc3 = dot_fp32(out, _weight_rows(w3_ptr, offs_n, offs_c3, n_ok, c3_ok, COUT2, C3, W_KMAJOR), acc3,
                            PRECISION)
    if C3 > 0:
        bias3, scale3 = _channel_operands(bias3_ptr, scale3_ptr, offs_c3, c3_ok, FP8)
        _epilogue(acc3, offs_m, offs_c3, M, C3, bias3, scale3, 0.0, y3_ptr, 1.0, y3_ptr, out3_inv, False, True, FP8,
                  PRECISION)


@triton.jit
def _weight_rows(w_ptr, rows, offs_n, rows_ok, n_ok, K, COUT, W_KMAJOR: tl.constexpr):
    """The tile w[rows, offs_n] of weights [K, COUT], or of their K-major transpose [COUT, K]."""
    if W_KMAJOR:
        offsets = offs_n[None, :] * K + rows[:, None]
    else:
        offsets = rows[:, None] * COUT + offs_n[None, :]
    return tl.load(w_ptr + offsets, mask=rows_ok[:, None] & n_ok[None, :], other=0.0)


def pairable(p: PackedConv, tail: PackedConv) -> bool:
    """Whether one kernel runs `p` and then `tail` on its output: `tail` a 1x1 stride-1 convolution (a downsample
    fused in or not), `p` a plain convolution whose channels fit one tile row (a power of two, 16 to 256), both
    packed alike."""
    return ((tail.kh, tail.kw, tail.stride, tail.pad) == (1, 1, 1, 0)
            and 16 <= p.cout <= 256 and p.cout & (p.cout - 1) == 0
            and not p.shortcut_stride and p.kmajor == tail.kmajor and p.fp8 == tail.fp8)


def pays(x: torch.Tensor, p: PackedConv, tail: PackedConv) -> bool:
    """Whether the pair runs by default (pairs=auto) on the block's input `x`: enough output pixels to give every SM
    a tile, at most PAIR_MAX_CHANNELS, in the 16- and 8-bit cells, the ones measured; with a downsample fused into
    `tail`, only where the block's input has no more channels than `p`: each slice of conv3 reads them again."""
    n, h, w, c = x.shape
    oh, ow = p.output_size(h, w)
    return (n * oh * ow >= PAIR_MIN_PIXELS and p.cout <= PAIR_MAX_CHANNELS and x.element_size() <= 2
            and (not tail.shortcut_stride or c <= p.cout))


def chainable(tail: PackedConv, nxt: PackedConv) -> bool:
    """Whether the pair ending in `tail` can also run `nxt`, the next block's conv1, on its output: a 1x1 stride-1
    convolution of 16 to 128 channels (a power of two: one tile row beside conv3's), packed alike."""
    return ((nxt.kh, nxt.kw, nxt.stride, nxt.pad, nxt.shortcut_stride) == (1, 1, 1, 0, 0)
            and 16 <= nxt.cout <= 128 and nxt.cout & (nxt.cout - 1) == 0 and nxt.kmajor == tail.kmajor
            and nxt.fp8 == tail.fp8)


def chain_pays(tail: PackedConv, nxt: PackedConv) -> bool:
    """Whether a pair runs the next block's conv1 by default (chain=auto): measured on the H100 at batch 256
    (`results/.../checks/pairs/chain/`), a chain into layer1's 64-channel conv1 saved 94 us in bf16 and 142 in
    fp8, but one into layer2's 128-channel conv1s, or after a fused downsample, cost 130-320 us (a 64 x 128 fp32 tile
    more a thread: fewer programs per SM)."""
    return nxt.cout <= 64 and not tail.shortcut_stride


def conv_pair(x: torch.Tensor, p: PackedConv, tail: PackedConv, residual: torch.Tensor | None = None,
              precision: str = "ieee", tune: bool = True, pdl: bool = False, shortcut: torch.Tensor | None = None,
              chain: PackedConv | None = None,
              residual_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """relu(tail(relu(p(x))) + residual) in one launch, NHWC in and out: as conv2d(conv2d(x, p), tail,
    residual=residual), p's output rounded to its stored type but never stored (pairable(p, tail) must hold). With
    a downsample fused into `tail`, the block's input comes as `shortcut` instead of a residual, and a residual in
    e4m3 with its `residual_scale`, as in conv2d.
    `chain`: the next block's conv1 (chainable(tail, chain)), run in the same launch on the output as stored.
    Returns the output and the chained convolution's output (None without `chain`)."""
    if not pairable(p, tail) or (chain is not None and not chainable(tail, chain)):
        raise ValueError(f"conv_pair takes a convolution of 16 to 256 channels (a power of two), a 1x1 stride-1 one "
                         f"and optionally a 1x1 stride-1 one of 16 to 128 channels, packed alike; not {p.kh}x{p.kw} "
                         f"-> {p.cout}, {tail.kh}x{tail.kw} stride {tail.stride}"
                         + (f", {chain.kh}x{chain.kw} stride {chain.stride} -> {chain.cout}" if chain else ""))
    if bool(tail.shortcut_stride) != (shortcut is not None) or (residual is None) == (shortcut is None):
        raise ValueError("conv_pair takes the block's input as `shortcut` where a downsample is fused into its 1x1, "
                         "else a `residual`")
    check_residual_scale(residual, residual_scale)
    n, h, w, cin = x.shape
    oh, ow = p.output_size(h, w)
    m, cout2 = n * oh * ow, tail.cout
    y = torch.empty((n, oh, ow, cout2), device=x.device, dtype=tail.output_dtype or x.dtype)
    y3 = (torch.empty((n, oh, ow, chain.cout), device=x.device, dtype=chain.output_dtype or y.dtype)
          if chain is not None else None)
    row = p.kw * cin

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]),)

    sc_h, sc_w, sc_cin = shortcut.shape[1:] if shortcut is not None else (0, 0, 0)
    nxt = chain or tail  # without a chain, its pointers are conv3's (unused)
    args = (x, p.weight, p.bias, tail.weight, tail.bias, shortcut if shortcut is not None else residual, y, m, h, w,
            cin, oh, ow, cout2, sc_h, sc_w, sc_cin,
            p.scale if p.fp8 else p.bias, p.input_inv, p.output_inv or 1.0,  # bias: the unused scale pointers
            tail.scale if tail.fp8 else tail.bias, tail.output_inv or 1.0, residual_scale or 1.0,
            nxt.weight, nxt.bias, y3 if chain is not None else y, nxt.scale if nxt.fp8 else nxt.bias, nxt.input_inv,
            nxt.output_inv or 1.0,
            p.cout, p.kh, p.kw, p.stride, p.pad, precision, p.fp8, p.kmajor, math.gcd(row, 128), tail.shortcut_stride,
            chain.cout if chain is not None else 0)
    if INTERPRET:  # the largest tiles the problem fills (conv.py's `_fixed`)
        fixed = dict(BLOCK_M=32 if m <= 32 else 64, BLOCK_K=min(128, max(16, triton.next_power_of_2(row))),
                     BLOCK_N2=min(128, triton.next_power_of_2(cout2)), num_warps=4, num_stages=2)
    else:
        fixed = dict(BLOCK_M=64, BLOCK_K=64 if x.element_size() < 4 else 32, BLOCK_N2=64,
                     num_warps=8 if p.cout >= 256 else 4, num_stages=3)
    launch(conv_pair_kernel, grid, args, tune, fixed, pdl)
    return y, y3
