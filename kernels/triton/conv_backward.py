"""The two gradients of a convolution over NHWC tensors, for a training step written in Triton (issue 60). Each is
a GEMM over the windows the forward's implicit GEMM walks (kernels/triton/conv.py).

- **Data gradient**, dx = the transposed convolution of dy. For a stride-1 convolution it is the forward
  convolution of dy with the weights flipped in space and their channel axes swapped, padded by KH-1-pad: the
  forward kernel runs it. A strided convolution's dx is cut into its stride x stride phases (the input pixels
  (i * stride + a, j * stride + b)): on each, dx is a stride-1 convolution of dy with the kernel taps that land
  there (a 3x3 at stride 2: 1x1, 1x2, 2x1 and 2x2 sub-kernels), run by the forward kernel and copied into the
  phase's pixels. That is dy's work once, where spreading dy onto the input's grid (zeros between) did stride**2
  times as much. Pixels no window reached, or no tap lands on (a 1x1's odd rows), get zero gradient.
- **Weight gradient**, dW[r, s, c, k] = sum over output pixels p of x[window(p) + (r, s), c] * dy[p, k]: for each
  kernel tap (r, s), a GEMM [CIN x P] @ [P x COUT] whose reduction runs over the N*OH*OW output pixels.
  conv2d_weight_grad_kernel gathers x's rows at the tap's offset as the forward gathers its windows (zeros in the
  padding) and accumulates in fp32. Over fewer than 16 input channels (the stem's 3) a tile's rows run over
  (r, s, c) together instead, so that dy is read once per 64 of the KH*KW*CIN rows, not once per tap.

The weight gradient's reduction over the output pixels is cut into slices so that the GPU fills (split.py), its
tile autotuned as the forward's is (kernels/triton/tuning.py).
tests/test_triton_backward.py holds both against PyTorch's autograd."""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.triton.conv import BatchNormSaved, TileStats, check_norm, conv2d, conv2d_stats, norm_relu, pack_weights
from kernels.triton.split import row_slices
from kernels.triton.tuning import autotune, launch

MIN_TILE = 16  # tl.dot's smallest side


def _weight_grad_config(block_c, block_k, block_p, warps, stages):
    return triton.Config({"BLOCK_C": block_c, "BLOCK_K": block_k, "BLOCK_P": block_p}, num_warps=warps,
                         num_stages=stages)


# dW tiles from the fixed first version's 64 x 64 over 32 pixels up to 128 x 256 over 64, pipelined: each pixel block
# is a [BLOCK_C x BLOCK_P] @ [BLOCK_P x BLOCK_K] dot, so wider tiles reuse each loaded row more. Every tap reads both
# operands again (from L2), so a tile's FLOPs per byte, C*K/(C+K), bound it (docs/notes/triton-training.md).
WEIGHT_GRAD_CONFIGS = [_weight_grad_config(c, k, bp, w, st) for c, k, bp, w, st in (
    (64, 64, 32, 4, 3), (64, 64, 64, 4, 3), (128, 64, 64, 8, 3), (64, 128, 64, 8, 3), (128, 128, 32, 8, 3),
    (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 32, 8, 4), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3))]
# The slices are cut as if for this square tile, whichever tile runs, so that the grid's slice axis and the partials'
# buffer do not depend on the configuration while the widest tiles still fill the GPU.
SLICE_TILE = 128
# The partials' sum: elements per program (with 16 slices at once, 16 KB of loads in flight; torch.sum over the slice
# axis, into the permuted layout, reached a fraction of the bandwidth: docs/notes/triton-training.md).
SUM_BLOCK = 256
# A slice's rows are a multiple of the largest BLOCK_P, so that every configuration walks them whole.
SLICE_ROWS = max(c.kwargs["BLOCK_P"] for c in WEIGHT_GRAD_CONFIGS)


def _prune_weight_grad(configs, args, **_):
    """Drop tiles wider than dW's own axes (the stem's 147 rows keep 128; 64 output channels keep 64)."""
    rows, cout = (max(MIN_TILE, triton.next_power_of_2(args[k])) for k in ("TILE_ROWS", "COUT"))
    kept = [c for c in configs if c.kwargs["BLOCK_C"] <= rows and c.kwargs["BLOCK_K"] <= cout]
    return kept or configs[:1]


@autotune(WEIGHT_GRAD_CONFIGS, key=["P", "CIN", "COUT", "TAPS", "TILE_ROWS", "STRIDE", "PRECISION"],
          prune=_prune_weight_grad)
@triton.jit
def conv2d_weight_grad_kernel(x_ptr, dy_ptr, dw_ptr, norm_ptr, P, H, W, CIN, OH, OW, COUT, STRIDE, PAD, ROWS, TAPS,
                              TILE_ROWS, KW: tl.constexpr, TAPS_IN_TILE: tl.constexpr, PRECISION: tl.constexpr,
                              NORM: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
                              BLOCK_P: tl.constexpr):
    """One [BLOCK_C x BLOCK_K] tile of dW, reduced over one slice of ROWS output pixels: the slice's partial dW,
    stored [slices, KH, KW, CIN, COUT], COUT fastest. The tile's rows are input channels of one tap (program axis
    2: the slice * TAPS + the tap r * KW + s), or, with TAPS_IN_TILE, rows of the flattened (r, s, c) axis, so
    that a convolution over a few channels (the stem's 3) reads dy once per tile of its KH*KW*CIN rows instead of
    once per tap (TAPS is then 1). TILE_ROWS: the rows of dW one program-axis-2 index owns (CIN, or KH*KW*CIN).
    NORM: x is a batch norm's input, taken through its affine map and ReLU on the load as the forward's norm
    prologue takes it (norm_ptr: scale, then shift, fp32 [2, CIN]; kernels/triton/conv.py norm_relu)."""
    tap = tl.program_id(2) % TAPS
    start = tl.program_id(2) // TAPS * ROWS
    end = tl.minimum(start + ROWS, P)
    offs_c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    c_ok, k_ok = offs_c < TILE_ROWS, offs_k < COUT
    if TAPS_IN_TILE:  # offs_c indexes (r, s, c), c fastest: the layout dW is stored in
        r, s, c = offs_c // (KW * CIN), offs_c // CIN % KW, offs_c % CIN
    else:
        r, s, c = tap // KW, tap % KW, offs_c
    acc = tl.zeros((BLOCK_C, BLOCK_K), dtype=tl.float32)
    for p0 in range(start, end, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        p_ok = offs_p < end
        n, pixel = offs_p // (OH * OW), offs_p % (OH * OW)
        if TAPS_IN_TILE:  # each row its own tap: the input pixel per (row, output pixel)
            ih = (pixel // OW)[None, :] * STRIDE + r[:, None] - PAD
            iw = (pixel % OW)[None, :] * STRIDE + s[:, None] - PAD
            x_mask = p_ok[None, :] & c_ok[:, None] & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            xt = tl.load(x_ptr + ((n[None, :] * H + ih) * W + iw) * CIN + c[:, None], mask=x_mask, other=0.0)
        else:  # one tap for the tile: the input pixel this tap of the output pixel's window reads
            ih = (pixel // OW) * STRIDE + r - PAD
            iw = (pixel % OW) * STRIDE + s - PAD
            inside = p_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            rows = ((n * H + ih) * W + iw) * CIN
            x_mask = inside[None, :] & c_ok[:, None]
            xt = tl.load(x_ptr + rows[None, :] + c[:, None], mask=x_mask, other=0.0)
        if NORM:  # the activation the forward never stored, recomputed
            xt = norm_relu(xt, x_mask, norm_ptr, c, c_ok, CIN, 0)
        dyt = tl.load(dy_ptr + offs_p[:, None] * COUT + offs_k[None, :], mask=p_ok[:, None] & k_ok[None, :],
                      other=0.0)
        acc += tl.dot(xt, dyt, input_precision=PRECISION)
    out = (tl.program_id(2) * TILE_ROWS + offs_c[:, None]) * COUT + offs_k[None, :]
    tl.store(dw_ptr + out, acc, mask=c_ok[:, None] & k_ok[None, :])


@triton.jit
def _sum_slices_kernel(part_ptr, dw_ptr, SLICES, N, COUT, CIN, TAPS, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr):
    """dW = the sum of the slices' partials (`part`: [SLICES, KH*KW*CIN*COUT], (r, s, c, k) with k fastest), stored in
    torch's [COUT, CIN, KH, KW] layout. BLOCK_S slices are loaded at once, so that a program keeps that many loads in
    flight where a convolution has hundreds of slices; they are added in a fixed order (a fixed tree in each block of
    slices, the blocks in turn), so the bits are the same every call."""
    offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = offs < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for s0 in range(0, SLICES, BLOCK_S):
        slices = s0 + tl.arange(0, BLOCK_S)
        acc += tl.sum(tl.load(part_ptr + slices[:, None].to(tl.int64) * N + offs[None, :],
                              mask=(slices < SLICES)[:, None] & ok[None, :], other=0.0), axis=0)
    k, row = offs % COUT, offs // COUT  # row: (r, s, c), c fastest
    tl.store(dw_ptr + k * (CIN * TAPS) + (row % CIN) * TAPS + row // CIN, acc, mask=ok)


def conv2d_weight_grad(x: torch.Tensor, dy: torch.Tensor, kh: int, kw: int, stride: int, pad: int,
                       precision: str = "ieee", tune: bool = True, out: torch.Tensor | None = None,
                       norm: torch.Tensor | None = None) -> torch.Tensor:
    """dW of a convolution, in torch's [COUT, CIN, KH, KW] layout and fp32: `x` its NHWC input, `dy` the NHWC
    gradient of its output (both contiguous, one dtype); written into `out` (a contiguous [COUT, CIN, KH, KW],
    such as a view of a flat gradient buffer) where given. `norm`: x is a batch norm's input and the convolution
    read relu(x * scale + shift) (conv.conv2d's norm prologue), norm its scale and shift, fp32 [2, CIN]."""
    n, h, w, cin = x.shape
    _, oh, ow, cout = dy.shape
    taps_in_tile = cin < MIN_TILE  # one tap's channels would leave most of a tile's rows empty
    tile_rows, tap_programs = (kh * kw * cin, 1) if taps_in_tile else (cin, kh * kw)
    tiles = triton.cdiv(tile_rows, _tile(tile_rows, SLICE_TILE)) * triton.cdiv(cout, _tile(cout, SLICE_TILE))
    tiles *= tap_programs
    slices, rows = row_slices(n * oh * ow, tiles, SLICE_ROWS, x.device)
    dw = torch.empty((slices, kh, kw, cin, cout), device=x.device, dtype=torch.float32)

    def grid(meta):
        return triton.cdiv(tile_rows, meta["BLOCK_C"]), triton.cdiv(cout, meta["BLOCK_K"]), slices * tap_programs

    check_norm(norm, cin)
    args = (x, dy, dw, dw if norm is None else norm, n * oh * ow, h, w, cin, oh, ow, cout, stride, pad, rows,
            tap_programs, tile_rows, kw, taps_in_tile, precision, norm is not None)  # dw: the unused norm pointer
    launch(conv2d_weight_grad_kernel, grid, args, tune, dict(BLOCK_C=_tile(tile_rows), BLOCK_K=_tile(cout),
                                                              BLOCK_P=32, num_warps=4, num_stages=3))
    if out is None:
        out = torch.empty((cout, cin, kh, kw), device=x.device, dtype=torch.float32)
    assert out.is_contiguous(), "the weight gradient is written in torch's contiguous [COUT, CIN, KH, KW] layout"
    size = kh * kw * cin * cout
    _sum_slices_kernel[(triton.cdiv(size, SUM_BLOCK),)](dw, out, slices, size, cout, cin, kh * kw, BLOCK_S=16,
                                                        BLOCK_N=SUM_BLOCK)
    return out


def _tile(channels: int, widest: int = 64) -> int:
    """A tile side for one axis of dW: `widest`, or the power of two that holds a narrower axis (at least
    MIN_TILE)."""
    return min(widest, max(MIN_TILE, triton.next_power_of_2(channels)))


def conv2d_input_grad(dy: torch.Tensor, weight: torch.Tensor, stride: int, pad: int, input_hw: tuple[int, int],
                      precision: str = "ieee", tune: bool = True, add: torch.Tensor | None = None) -> torch.Tensor:
    """dx of a convolution, NHWC in dy's dtype: `dy` the NHWC gradient of its output, `weight` its [COUT, CIN, KH,
    KW] weights, `input_hw` its input's height and width. `add`: another gradient of the same input (a block's
    shortcut), summed into dx: in the epilogue in fp32 and rounded once at stride 1, after the phases otherwise."""
    kh, kw = weight.shape[2:]
    if stride == 1:  # the forward convolution of dy with the weights flipped and their channel axes swapped
        return conv2d(dy, _flipped(weight, pad, dy.dtype), residual=add, relu=False, precision=precision, tune=tune)
    n = dy.shape[0]
    h, w = input_hw
    swapped = weight.transpose(0, 1)  # [CIN, COUT, KH, KW]
    rows, cols = _phases(kh, stride, pad, h), _phases(kw, stride, pad, w)
    # Phases no tap of the kernel lands on (a 1x1's odd rows and columns) stay zero: one memset of dx, where a fill
    # of each such strided region took about 45 us (H200, a downsample's, epilogue-stats/ census)
    untouched = not all(p.taps for p in rows + cols)
    dx = (dy.new_zeros if untouched else dy.new_empty)((n, h, w, weight.shape[1]))
    for r in rows:
        for c in cols:
            region = dx[:, r.phase::stride, c.phase::stride]
            if not (r.taps and c.taps):
                continue
            p = max(r.taps, c.taps) - 1  # the kernel takes one padding for both axes
            # Slices, not index lists: a list index would copy from the host, which a CUDA graph cannot capture.
            taps = swapped[:, :, r.first::stride, c.first::stride].flip(2, 3)
            part = conv2d(dy, pack_weights(taps, pad=p, dtype=dy.dtype), relu=False, precision=precision, tune=tune)
            top, left = r.q + p - (r.taps - 1), c.q + p - (c.taps - 1)  # where row and column 0 are
            nr, nc = max(0, min(r.count, part.shape[1] - top)), max(0, min(c.count, part.shape[2] - left))
            region[:, :nr, :nc] = part[:, top:top + nr, left:left + nc]
            region[:, nr:].zero_()  # rows past dy's reach (the forward's windows never read them)
            region[:, :, nc:].zero_()
    return dx if add is None else dx.add_(add)


def conv2d_input_grad_sums(dy: torch.Tensor, weight: torch.Tensor, stride: int, pad: int,
                           input_hw: tuple[int, int], bn: BatchNormSaved | None, precision: str = "ieee",
                           tune: bool = True, add: torch.Tensor | None = None) -> tuple[torch.Tensor, TileStats | None]:
    """conv2d_input_grad where dx is the gradient of a batch norm's (ReLU'd) output, `bn` what that batch norm
    saved: dx, and the sums its backward needs from the epilogue (conv.conv2d_stats), at stride 1; None without
    `bn`, or where the phases assemble dx (strided), whose parts are not dx."""
    if bn is None or stride > 1:
        return conv2d_input_grad(dy, weight, stride, pad, input_hw, precision, tune, add), None
    return conv2d_stats(dy, _flipped(weight, pad, dy.dtype), residual=add, bn=bn, precision=precision, tune=tune)


def _flipped(weight: torch.Tensor, pad: int, dtype: torch.dtype):
    """A stride-1 convolution's data gradient as a forward convolution: the weights flipped in space, their channel
    axes swapped, padded by KH-1-pad."""
    return pack_weights(weight.transpose(0, 1).flip(2, 3), pad=weight.shape[2] - 1 - pad, dtype=dtype)


class _Phase(NamedTuple):
    """The input rows i * stride + phase of a strided convolution's data gradient, along one axis: there dx is a
    stride-1 cross-correlation of dy with the `taps` kernel rows first, first + stride, ... (applied last to first),
    whose output row i + q + pad - (taps - 1) is input row i's, under the padding `pad` it runs with; `count` such
    rows."""
    phase: int
    first: int
    taps: int
    q: int
    count: int


def _phases(k: int, stride: int, pad: int, size: int) -> list[_Phase]:
    """One axis of a strided convolution's data gradient cut into its `stride` phases (the sub-pixel decomposition):
    input row ih = i * stride + a takes kernel rows r0, r0 + stride, ... (r0 = (a + pad) mod stride) from output
    rows i + q, i + q - 1, ... (q = (a + pad - r0) / stride). The work is then dy's once over, not the stride**2
    times of a zero-interleaved dy."""
    phases = []
    for a in range(stride):
        r0 = (a + pad) % stride
        phases.append(_Phase(a, r0, len(range(r0, k, stride)), (a + pad - r0) // stride,
                             (size - a + stride - 1) // stride))
    return phases
