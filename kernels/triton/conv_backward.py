"""The two gradients of a convolution over NHWC tensors, for a training step written in Triton (issue 60). Each is
a GEMM over the windows the forward's implicit GEMM walks (kernels/triton/conv.py).

- **Data gradient**, dx = the transposed convolution of dy. For a stride-1 convolution it is the forward
  convolution of dy with the weights flipped in space and their channel axes swapped, padded by KH-1-pad: the
  forward kernel runs it. A strided convolution's dy is first spread onto the input's grid (each output pixel
  where its window started, zeros between), after which the same holds; rows the forward's windows never reached
  (when the stride does not divide the padded input) get zero gradient.
- **Weight gradient**, dW[r, s, c, k] = sum over output pixels p of x[window(p) + (r, s), c] * dy[p, k]: for each
  kernel tap (r, s), a GEMM [CIN x P] @ [P x COUT] whose reduction runs over the N*OH*OW output pixels.
  conv2d_weight_grad_kernel gathers x's rows at the tap's offset as the forward gathers its windows (zeros in the
  padding) and accumulates in fp32. Over fewer than 16 input channels (the stem's 3) a tile's rows run over
  (r, s, c) together instead, so that dy is read once per 64 of the KH*KW*CIN rows, not once per tap.

The weight gradient's reduction over the output pixels is cut into slices so that the GPU fills (split.py), its
tile autotuned as the forward's is (kernels/triton/tuning.py). Still a first version, correct before fast: the
strided 3x3's data gradient materialises the spread dy (4x its bytes and its work at stride 2; a strided 1x1
needs no spread: its dx is dy times W^T on the pixels it reads).
tests/test_triton_backward.py holds both against PyTorch's autograd."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.conv import conv2d, pack_weights
from kernels.triton.split import row_slices
from kernels.triton.tuning import autotune, launch

MIN_TILE = 16  # tl.dot's smallest side


def _weight_grad_config(block_c, block_k, block_p, warps, stages):
    return triton.Config({"BLOCK_C": block_c, "BLOCK_K": block_k, "BLOCK_P": block_p}, num_warps=warps,
                         num_stages=stages)


# dW tiles from the fixed first version's 64 x 64 over 32 pixels up to 128 x 128 over 64, pipelined: each pixel block
# is a [BLOCK_C x BLOCK_P] @ [BLOCK_P x BLOCK_K] dot, so wider tiles reuse each loaded row more.
WEIGHT_GRAD_CONFIGS = [_weight_grad_config(c, k, bp, w, st) for c, k, bp, w, st in (
    (64, 64, 32, 4, 3), (64, 64, 64, 4, 3), (128, 64, 64, 8, 3), (64, 128, 64, 8, 3), (128, 128, 32, 8, 3),
    (128, 128, 64, 8, 3), (128, 128, 64, 8, 4))]
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
def conv2d_weight_grad_kernel(x_ptr, dy_ptr, dw_ptr, P, H, W, CIN, OH, OW, COUT, STRIDE, PAD, ROWS, TAPS,
                              TILE_ROWS, KW: tl.constexpr, TAPS_IN_TILE: tl.constexpr, PRECISION: tl.constexpr,
                              BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr):
    """One [BLOCK_C x BLOCK_K] tile of dW, reduced over one slice of ROWS output pixels: the slice's partial dW,
    stored [slices, KH, KW, CIN, COUT], COUT fastest. The tile's rows are input channels of one tap (program axis
    2: the slice * TAPS + the tap r * KW + s), or, with TAPS_IN_TILE, rows of the flattened (r, s, c) axis, so
    that a convolution over a few channels (the stem's 3) reads dy once per tile of its KH*KW*CIN rows instead of
    once per tap (TAPS is then 1). TILE_ROWS: the rows of dW one program-axis-2 index owns (CIN, or KH*KW*CIN)."""
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
            inside = p_ok[None, :] & c_ok[:, None] & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            xt = tl.load(x_ptr + ((n[None, :] * H + ih) * W + iw) * CIN + c[:, None], mask=inside, other=0.0)
        else:  # one tap for the tile: the input pixel this tap of the output pixel's window reads
            ih = (pixel // OW) * STRIDE + r - PAD
            iw = (pixel % OW) * STRIDE + s - PAD
            inside = p_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            rows = ((n * H + ih) * W + iw) * CIN
            xt = tl.load(x_ptr + rows[None, :] + c[:, None], mask=inside[None, :] & c_ok[:, None], other=0.0)
        dyt = tl.load(dy_ptr + offs_p[:, None] * COUT + offs_k[None, :], mask=p_ok[:, None] & k_ok[None, :],
                      other=0.0)
        acc += tl.dot(xt, dyt, input_precision=PRECISION)
    out = (tl.program_id(2) * TILE_ROWS + offs_c[:, None]) * COUT + offs_k[None, :]
    tl.store(dw_ptr + out, acc, mask=c_ok[:, None] & k_ok[None, :])


def conv2d_weight_grad(x: torch.Tensor, dy: torch.Tensor, kh: int, kw: int, stride: int, pad: int,
                       precision: str = "ieee", tune: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
    """dW of a convolution, in torch's [COUT, CIN, KH, KW] layout and fp32: `x` its NHWC input, `dy` the NHWC
    gradient of its output (both contiguous, one dtype); written into `out` (a contiguous [COUT, CIN, KH, KW],
    such as a view of a flat gradient buffer) where given. The slices are cut for 64 x 64 tiles, whichever tile the
    tuning picks: the grid's slice axis and the partials' buffer do not depend on the configuration."""
    n, h, w, cin = x.shape
    _, oh, ow, cout = dy.shape
    taps_in_tile = cin < MIN_TILE  # one tap's channels would leave most of a tile's rows empty
    tile_rows, tap_programs = (kh * kw * cin, 1) if taps_in_tile else (cin, kh * kw)
    block_c, block_k = _tile(tile_rows), _tile(cout)
    tiles = triton.cdiv(tile_rows, block_c) * triton.cdiv(cout, block_k) * tap_programs
    slices, rows = row_slices(n * oh * ow, tiles, SLICE_ROWS, x.device)
    dw = torch.empty((slices, kh, kw, cin, cout), device=x.device, dtype=torch.float32)

    def grid(meta):
        return triton.cdiv(tile_rows, meta["BLOCK_C"]), triton.cdiv(cout, meta["BLOCK_K"]), slices * tap_programs

    args = (x, dy, dw, n * oh * ow, h, w, cin, oh, ow, cout, stride, pad, rows, tap_programs, tile_rows, kw,
            taps_in_tile, precision)
    launch(conv2d_weight_grad_kernel, grid, args, tune, dict(BLOCK_C=block_c, BLOCK_K=block_k, BLOCK_P=32,
                                                              num_warps=4, num_stages=3))
    # the slices in a fixed order (the same bits every call), summed straight into the gradient's layout
    if out is None:
        return dw.sum(0).permute(3, 2, 0, 1)
    torch.sum(dw, 0, out=out.permute(2, 3, 1, 0))
    return out


def _tile(channels: int) -> int:
    """A tile side for one axis of dW: 64, or the power of two that holds a narrower axis (at least MIN_TILE)."""
    return min(64, max(MIN_TILE, triton.next_power_of_2(channels)))


def conv2d_input_grad(dy: torch.Tensor, weight: torch.Tensor, stride: int, pad: int, input_hw: tuple[int, int],
                      precision: str = "ieee", tune: bool = True, add: torch.Tensor | None = None) -> torch.Tensor:
    """dx of a convolution, NHWC in dy's dtype: `dy` the NHWC gradient of its output, `weight` its [COUT, CIN, KH,
    KW] weights, `input_hw` its input's height and width. `add`: another gradient of the same input (a block's
    shortcut), summed into dx in the epilogue in fp32 and rounded once, with no pass of its own."""
    n, oh, ow, cout = dy.shape
    kh, kw = weight.shape[2:]
    h, w = input_hw
    if stride > 1 and (kh, kw, pad) == (1, 1, 0) and add is None:
        # A downsample reads every stride-th pixel and nothing else: its dx there is dy times W^T, zero elsewhere (a
        # quarter of the spread path's work at stride 2).
        dx = dy.new_zeros((n, h, w, weight.shape[1]))
        dx[:, ::stride, ::stride] = conv2d(dy, pack_weights(weight.transpose(0, 1), dtype=dy.dtype), relu=False,
                                           precision=precision, tune=tune)
        return dx
    if stride > 1:  # onto the (padded) input's grid of window starts: the rest, the edge's included, stays zero
        spread = dy.new_zeros((n, h + 2 * pad - kh + 1, w + 2 * pad - kw + 1, cout))
        spread[:, ::stride, ::stride] = dy
        dy = spread
    flipped = weight.transpose(0, 1).flip(2, 3)
    packed = pack_weights(flipped, pad=kh - 1 - pad, dtype=dy.dtype)
    return conv2d(dy, packed, residual=add, relu=False, precision=precision, tune=tune)
