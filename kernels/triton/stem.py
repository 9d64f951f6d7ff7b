"""ResNet's stem (7x7 stride-2 convolution over 3 channels, batch-norm, ReLU, then a 3x3 stride-2 max-pool) as one
convolution kernel whose epilogue pools: the convolution's output, four times the pool's, never reaches HBM.

Two layouts make the 7x7 convolution a wide GEMM (cuDNN's tiled stem, cpp/cudnn/src/net.cpp, uses the same):
- the input in tiles of 4x4 pixels, 48 channels each (`space_to_depth`, one pass over the small input, which also
  writes a tile of zeros around the image: the padding, so the kernel's loads need no mask);
- the output in cells of 2x2 pixels, 256 channels each: channel c of the pixel (2i + u, 2j + v) of cell (i, j).
Cell (i, j) reads input rows 4i - 3 .. 4i + 5, all inside tiles i - 1 .. i + 1: the stem is a 3x3 stride-1
convolution over the tiles, 256 channels wide (`tiled_filter`: each (u, v) block of the filter is the 7x7 one
placed at offset (2u + 1, 2v + 1) in a 12x12 window). Each A tile serves 256 outputs, not 64 as in a plain implicit
GEMM of the 7x7, whose A loads made it L2-bound; each K step now reloads the weights' tile instead, for 64 cells
(docs/notes/handwritten-toward-the-limit.md: what limits it on the H100).

The pool in cells: pool output (i, j) is the max over convolution rows 2i - 1 .. 2i + 1 and columns 2j - 1 .. 2j + 1,
that is cell (i, j) whole, the right column (v = 1) of cell (i, j - 1), and convolution row 2i - 1 over columns
2j - 1 .. 2j + 1: the lower row (u = 1) of cell (i - 1, j) and the corner of cell (i - 1, j - 1). A program's tile is
ROWS rows of BLOCK_W cells, so the left neighbour is the cell before in the tile (its first column only feeds its
second: the tiles of a row overlap by one cell). The row above is the tile's row before, or for the tile's first
row the last row of the program's previous tile: each program walks down a band of rows, carrying that row's
contribution (`carry`) from one tile to the next; bands overlap by one row, which the band computes but does not
emit. Every value is a ReLU output, at least 0, so 0 stands for the padding and for cells past the image.
The shifts by one cell and by one row of cells are `tl.gather`s along the tile's pixels (through shared memory).

What it costs: the tiled filter is mostly zeros (the 7x7 window inside 12x12), so the GEMM multiplies 2.9x what
the 7x7 does. Tensor cores pay that back: on the H100 at batch 256 in bf16 the stem took 0.61 ms against 0.71 for
the convolution over 2x2-pixel tiles (16 channels, a 4x4 window: 1.3x the multiplies) and a separate max-pool. In
strict fp32 every multiply is an FMA: there the stem stays that convolution and `max_pool2d` (`fused=False`).
Through TMA (`TMA`: one descriptor box per operand and K step, no address arithmetic in the K loop) the bf16 kernel
ran 561 -> 533 us in the network at batch 256 on the H100; TF32 ran slower that way (results/.../checks/stem-tma/).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.triton.conv import (SMEM_BYTES, PackedConv, _window_gemm, conv2d, fold_batch_norm, pack_conv, tf32_round)
from kernels.triton.pool import max_pool2d
from kernels.triton.pdl import wait_for_prior_kernel
from kernels.triton.tuning import INTERPRET, autotune, launch

TILE = 4  # input pixels per tile side; the output cell is TILE // 2 = 2 pixels a side (the stride)
WINDOW, STRIDE, PAD = 7, 2, 3  # the stem convolution this packing stands for
# The filter's output columns come in groups of GROUP channels x 4 pixels (g, u, v, c): a program's channels are
# whole groups, its GEMM columns one contiguous run of the packed weights.
GROUP: tl.constexpr = tl.constexpr(32)
SPACE_TO_DEPTH_CHANNELS = 16  # the unfused stem's 2x2 tiles of 3 channels, zero-padded: 32-byte (16-bit) or 64-byte pixels


def _config(rows, width, channels, band_tiles, bk, stages, warps, tma=False):
    return triton.Config({"ROWS": rows, "BLOCK_W": width, "BLOCK_C": channels, "BAND_TILES": band_tiles,
                          "BLOCK_K": bk, "TMA": tma}, num_stages=stages, num_warps=warps)


def _descriptor_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global memory for the TMA descriptors a program builds (`tl.make_tensor_descriptor`), from torch's allocator
    (so a CUDA graph's capture takes it from the graph's pool)."""
    return torch.empty(size, device="cuda", dtype=torch.int8)


triton.set_allocator(_descriptor_scratch)


# 64 cells wide (a 56-cell row of a 224 image in one tile). A program's tile is BLOCK_M = ROWS x 64 cells by 4 x
# BLOCK_C columns. Each K step loads both operands from L2 (the weights' 221 KB do not stay on the chip between
# tiles): per cell, A / (4 BLOCK_C) + B / BLOCK_M bytes. One row of all 64 channels at 4 warps holds 255 registers,
# two programs an SM (ptxas, sm90), so one's epilogue runs beside the other's K loop; two rows of 32 channels hold the
# same and load a fifth less. Bands of 29 rows (a 224 image's 56 in two) down to one tile (more programs for batch 1).
# TMA (one row a tile): both operands' K tiles copied by the tensor memory accelerator, a whole box per instruction,
# so the K loop computes no addresses and masks nothing (a box past the tiles' tensor is zero-filled).
CONFIGS = [_config(rows, width, channels, band, bk, stages, warps, tma)
           for rows, width, channels, band, bk, stages, warps, tma in (
               (1, 64, 64, 29, 16, 4, 4, False), (1, 64, 64, 29, 16, 3, 4, False), (1, 64, 64, 29, 32, 3, 4, False),
               (2, 64, 32, 29, 16, 4, 4, False), (2, 64, 64, 15, 16, 4, 8, False), (1, 64, 64, 8, 16, 4, 4, False),
               (2, 32, 64, 1, 32, 3, 4, False), (2, 32, 32, 1, 32, 3, 4, False), (2, 32, 32, 1, 16, 4, 4, False),
               (1, 64, 64, 29, 16, 5, 4, True), (1, 64, 64, 29, 16, 4, 4, True), (1, 64, 64, 8, 16, 4, 4, True))]


def _prune(configs, args, **_):
    """Drop configurations whose pipeline overflows shared memory (K tiles halved for 4-byte types, as conv.py's,
    to no less than 16) or whose channels do not divide the stem's; TMA only with one row a tile and K tiles that
    divide a tap's channels."""
    elem, c, cin = args["z_ptr"].element_size(), args["C"], args["CIN"]
    kept = {}
    for cfg in configs:
        rows, width, channels, band, bk, tma = (cfg.kwargs[k] for k in ("ROWS", "BLOCK_W", "BLOCK_C", "BAND_TILES",
                                                                        "BLOCK_K", "TMA"))
        bk = max(16, bk // 2) if elem == 4 else bk
        if (c % channels == 0 and cfg.num_stages * (rows * width + 4 * channels) * bk * elem <= SMEM_BYTES
                and (not tma or (rows == 1 and cin % bk == 0))):
            kept.setdefault((rows, width, channels, band, bk, cfg.num_stages, cfg.num_warps, tma),
                            _config(rows, width, channels, band, bk, cfg.num_stages, cfg.num_warps, tma))
    return list(kept.values()) or [_config(1, 16, GROUP.value, 4, 16, 2, 4)]


def _fixed(cells_w: int, elem: int) -> dict:
    """The untuned configuration; the interpreter's is small enough that a 64-pixel test image spans several tiles
    of a row and several bands."""
    if INTERPRET:
        return dict(ROWS=2, BLOCK_W=16, BLOCK_C=64, BAND_TILES=4, BLOCK_K=64, num_warps=4, num_stages=2)
    return dict(ROWS=1, BLOCK_W=64 if cells_w > 16 else 16, BLOCK_C=64, BAND_TILES=29, BLOCK_K=16, num_warps=4,
                num_stages=4)


@triton.jit
def _tiled_gemm(tiles, weights, first_tile, n0, ZW, CIN: tl.constexpr, PRECISION: tl.constexpr,
                W_KMAJOR: tl.constexpr, BLOCK_M: tl.constexpr, N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The fp32 tile [BLOCK_M cells from z's row `first_tile` on, N columns from n0] of the 3x3 convolution over
    the tiles, through TMA: K step s is tap (dy, dx) = divmod(s // per_tap, 3), channels (s % per_tap) * BLOCK_K
    on; the weights' rows are (dy, dx, channel), so its K tile starts at row s * BLOCK_K. Rows of z before or past
    it read as zeros, and belong only to cells that are not emitted."""
    per_tap: tl.constexpr = CIN // BLOCK_K
    acc = tl.zeros((BLOCK_M, N), dtype=tl.float32)
    for step in range(9 * per_tap):
        tap = step // per_tap
        a = tiles.load([first_tile + (tap // 3) * ZW + tap % 3, (step % per_tap) * BLOCK_K])
        if W_KMAJOR:
            b = weights.load([n0, step * BLOCK_K]).T
        else:
            b = weights.load([step * BLOCK_K, n0])
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@autotune(CONFIGS, key=["BATCH", "CH", "CW", "PRECISION"], prune=_prune)
@triton.jit(do_not_specialize=["BATCH", "ZH", "ZW", "CH", "CW", "OH", "OW"])
def stem_pool_kernel(
        z_ptr, w_ptr, bias_ptr, y_ptr,  # z [N, ZH, ZW, CIN]: the tiles, a zero tile around; w [K, 4C] (K-major:
        BATCH, ZH, ZW, CH, CW,  # [4C, K]); bias [4C]; y [N, CH, CW, C]: the pool's output (a pixel per cell)
        OH, OW,  # the convolution's output size (a cell's pixels past it do not exist)
        CIN: tl.constexpr, C: tl.constexpr, PRECISION: tl.constexpr, W_KMAJOR: tl.constexpr, K_ALIGN: tl.constexpr,
        ROWS: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr, BAND_TILES: tl.constexpr,
        BLOCK_K: tl.constexpr, TMA: tl.constexpr = False, GDC: tl.constexpr = False):
    BLOCK_M: tl.constexpr = ROWS * BLOCK_W
    out_ty: tl.constexpr = y_ptr.dtype.element_ty
    N4: tl.constexpr = 4 * BLOCK_C  # the tile's GEMM columns: BLOCK_C channels x 4 pixels
    GROUPS: tl.constexpr = BLOCK_C // GROUP
    # A program: one band of an image's rows, one chunk of its columns, BLOCK_C of its channels. Each band emits
    # BAND_TILES * ROWS - 1 rows and computes the row above them too; each chunk emits BLOCK_W - 1 columns and
    # computes the one left of them.
    emit_rows: tl.constexpr = BAND_TILES * ROWS - 1
    bands, chunks = tl.cdiv(CH, emit_rows), tl.cdiv(CW, BLOCK_W - 1)
    pid = tl.program_id(0)
    channels, pid = pid % (C // BLOCK_C), pid // (C // BLOCK_C)
    band, chunk, img = pid % bands, (pid // bands) % chunks, pid // (bands * chunks)
    first_row = band * emit_rows
    offs = tl.arange(0, BLOCK_M)
    r, t = offs // BLOCK_W, offs % BLOCK_W
    first_col = chunk * (BLOCK_W - 1) - 1  # the chunk's first cell column (computed, not emitted)
    j = first_col + t
    col_ok = (j >= 0) & (j < CW)
    emit_col = col_ok & (t > 0)
    offs_n = channels * N4 + tl.arange(0, N4)  # packed by channel group: the tile's columns are contiguous
    offs_c = channels * BLOCK_C + tl.arange(0, BLOCK_C)
    bias = tl.load(bias_ptr + offs_n)
    if TMA:  # the tiles as rows of CIN channels (a cell's window row: three of them in a row); the weights [K, 4C]
        tiles = tl.make_tensor_descriptor(z_ptr, [BATCH * ZH * ZW, CIN], [CIN, 1], [BLOCK_W, BLOCK_K])
        if W_KMAJOR:
            weights = tl.make_tensor_descriptor(w_ptr, [4 * C, 9 * CIN], [9 * CIN, 1], [N4, BLOCK_K])
        else:
            weights = tl.make_tensor_descriptor(w_ptr, [9 * CIN, 4 * C], [4 * C, 1], [BLOCK_K, N4])
    wait_for_prior_kernel(GDC)

    shift_left = tl.broadcast_to(tl.maximum(offs - 1, 0)[:, None], (BLOCK_M, BLOCK_C))
    shift_up = tl.broadcast_to(tl.maximum(offs - BLOCK_W, 0)[:, None], (BLOCK_M, BLOCK_C))
    from_carry = tl.broadcast_to(t[:, None], (BLOCK_M, BLOCK_C))
    last_row = tl.broadcast_to(((ROWS - 1) * BLOCK_W + tl.arange(0, BLOCK_W))[:, None], (BLOCK_W, BLOCK_C))
    # `carry`: for the tile's first row i, convolution row 2i - 1 over columns 2j - 1 .. 2j + 1, by column. Zero
    # before the first tile: the padding above the image in the first band; in the others, the first tile's row is
    # the band's extra row, computed but not emitted.
    carry = tl.zeros((BLOCK_W, BLOCK_C), dtype=out_ty)
    for tile in range(BAND_TILES):
        tile_row = first_row - 1 + tile * ROWS  # the tile's first cell row
        i = tile_row + r
        cell_ok = col_ok & (i >= 0) & (i < CH)
        # (the zero tiles around z are the padding: cell (i, j)'s window starts at z's tile (i, j), unmasked)
        if TMA:  # one row a tile: its cells are one run of z's rows, from the first cell's window's first tile
            acc = _tiled_gemm(tiles, weights, (img * ZH + tile_row) * ZW + first_col, channels * N4, ZW, CIN,
                              PRECISION, W_KMAJOR, BLOCK_W, N4, BLOCK_K)
        else:
            offs_m = tl.where(cell_ok, (img * CH + i) * CW + j, 0)
            acc = _window_gemm(z_ptr, w_ptr, w_ptr, offs_m, offs_n, cell_ok, offs_n < 4 * C, 0,
                               3 * tl.cdiv(3 * CIN, BLOCK_K), ZH, ZW, CIN, CH, CW, 4 * C, 0, 0, 0, 1.0, 3, 3, 1, 0,
                               PRECISION, False, W_KMAJOR, 0, K_ALIGN, BLOCK_M, N4, BLOCK_K, 1, w_ptr, False)
        # bias and ReLU, rounded as the convolution would store them (max commutes with rounding); each cell's four
        # pixels (u, v) split apart (reshapes, a permutation and splits: no data moves), those past the image zeroed
        q = tl.reshape(tf32_round(tl.maximum(acc + bias[None, :], 0.0).to(out_ty), PRECISION),
                       (BLOCK_M, GROUPS, 2, 2, GROUP))
        q = tl.reshape(tl.permute(q, (0, 1, 4, 2, 3)), (BLOCK_M, BLOCK_C, 2, 2))  # [BLOCK_M, BLOCK_C, u, v]
        col0, col1 = tl.split(q)  # [BLOCK_M, BLOCK_C, u] at v = 0 and v = 1
        p00, p10 = tl.split(col0)
        p01, p11 = tl.split(col1)
        lower_ok, right_ok = cell_ok & (2 * i + 1 < OH), cell_ok & (2 * j + 1 < OW)
        p00 = tl.where(cell_ok[:, None], p00, 0.0).to(out_ty)  # (tl.where and tl.maximum take 16-bit types to
        p10 = tl.where(lower_ok[:, None], p10, 0.0).to(out_ty)  # fp32: rounded back, exactly, for the gathers)
        p01 = tl.where(right_ok[:, None], p01, 0.0).to(out_ty)
        corner = tl.where((lower_ok & right_ok)[:, None], p11, 0.0).to(out_ty)  # for the cell below and right
        right = tl.maximum(p01, corner).to(out_ty)  # v = 1: for the cell to the right
        lower = tl.maximum(p10, corner).to(out_ty)  # u = 1: for the cell below
        whole = tl.maximum(tl.maximum(p00, p10), right).to(out_ty)
        # this cell's lower convolution row over columns 2j - 1 .. 2j + 1, for the cell below
        row_below = tl.maximum(lower, tl.gather(corner, shift_left, 0)).to(out_ty)
        if ROWS == 1:  # the tile is one row: the row above is the carry, and this row the next carry
            above = carry
        else:
            above = tl.where((r == 0)[:, None], tl.gather(carry, from_carry, 0), tl.gather(row_below, shift_up, 0))
        pooled = tl.maximum(tl.maximum(whole, tl.gather(right, shift_left, 0)), above)
        emit = emit_col & cell_ok & (i >= first_row) & (i < first_row + emit_rows)
        y_offs = ((img * CH + i) * CW + j)[:, None] * C + offs_c[None, :]
        tl.store(y_ptr + y_offs, pooled, mask=emit[:, None])
        carry = row_below if ROWS == 1 else tl.gather(row_below, last_row, 0)


@autotune([triton.Config({"BLOCK_PIXELS": 64}, num_warps=4), triton.Config({"BLOCK_PIXELS": 256}, num_warps=8)],
          key=["PIXELS", "CIN"])
@triton.jit
def space_to_depth_kernel(x_ptr, z_ptr, PIXELS, H, W, ZH, ZW, CIN: tl.constexpr, CZ: tl.constexpr, F: tl.constexpr,
                          PAD: tl.constexpr, PRECISION: tl.constexpr, BLOCK_PIXELS: tl.constexpr,
                          GDC: tl.constexpr = False):
    # z[n, a, b, (p * F + q) * CIN + c] = x[n, F * a + p - PAD, F * b + q - PAD, c]; zero outside x and past F * F * CIN
    # channels. A tile of BLOCK_PIXELS z pixels x CZ channels: the divisions once per pixel, the tap once per channel,
    # and each pixel's CZ channels stored as one contiguous run.
    wait_for_prior_kernel(GDC)
    pixel = tl.program_id(0) * BLOCK_PIXELS + tl.arange(0, BLOCK_PIXELS)
    b = pixel % ZW
    a = (pixel // ZW) % ZH
    img = pixel // (ZW * ZH)
    ch = tl.arange(0, triton.next_power_of_2(CZ))
    tap = ch // CIN
    ih = F * a[:, None] + (tap // F)[None, :] - PAD
    iw = F * b[:, None] + (tap % F)[None, :] - PAD
    store_ok = (pixel < PIXELS)[:, None] & (ch < CZ)[None, :]
    ok = store_ok & (tap < F * F)[None, :] & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
    v = tl.load(x_ptr + ((img[:, None] * H + ih) * W + iw) * CIN + (ch % CIN)[None, :], mask=ok, other=0.0)
    tl.store(z_ptr + pixel[:, None] * CZ + ch[None, :], tf32_round(v, PRECISION), mask=store_ok)


def space_to_depth(x: torch.Tensor, tile: int, pad: int, size: tuple[int, int], channels: int, tune: bool = True,
                   pdl: bool = False, precision: str = "ieee") -> torch.Tensor:
    """NHWC `x` [N, H, W, C] -> [N, *size, channels]: each pixel of the result one tile x tile block of x's pixels,
    the first block starting `pad` pixels before x's corner, zero outside x (and past tile * tile * C channels); under
    TF32 (`precision`) rounded to it, as the stem's products read it."""
    n, h, w, c = x.shape
    z = torch.empty((n, *size, channels), device=x.device, dtype=x.dtype)
    pixels = n * size[0] * size[1]

    def grid(meta):
        return (triton.cdiv(pixels, meta["BLOCK_PIXELS"]),)

    launch(space_to_depth_kernel, grid, (x, z, pixels, h, w, *size, c, channels, tile, pad, precision), tune,
           dict(BLOCK_PIXELS=64, num_warps=4, num_stages=2), pdl)
    return z


def tiled_filter(w: torch.Tensor) -> torch.Tensor:
    """The stem's filter [C, CIN, 7, 7] as the 3x3 convolution over 4x4-pixel tiles that writes 2x2-pixel cells:
    [4C, 16 CIN, 3, 3], output channel ((g * 2 + u) * 2 + v) * GROUP + c for channel g * GROUP + c of pixel (u, v),
    input channel (p * 4 + q) * CIN + cin. Tap (dy, p) of output row u is filter row 4 (dy - 1) + p - 2u + 3: the
    filter placed at offset (2u + 1) in a 12-row window."""
    c, cin = w.shape[:2]
    blocks = []
    for u in range(2):
        for v in range(2):
            window = torch.zeros(c, cin, 3 * TILE, 3 * TILE, dtype=w.dtype)
            window[:, :, 2 * u + 1:2 * u + 1 + WINDOW, 2 * v + 1:2 * v + 1 + WINDOW] = w
            # [c, cin, (dy, p), (dx, q)] -> [c, (p, q, cin), dy, dx]
            blocks.append(window.view(c, cin, 3, TILE, 3, TILE).permute(0, 3, 5, 1, 2, 4).reshape(
                c, TILE * TILE * cin, 3, 3))
    # [(u, v), (g, c)] -> [(g, u, v, c)]
    groups = GROUP.value
    return torch.stack(blocks).view(4, c // groups, groups, -1, 3, 3).transpose(0, 1).reshape(4 * c, -1, 3, 3)


def space_to_depth_filter(w: torch.Tensor) -> torch.Tensor:
    """The stem's filter [C, CIN, 7, 7] as the 4x4 stride-1 convolution over 2x2-pixel tiles (the unfused stem):
    [C, SPACE_TO_DEPTH_CHANNELS, 4, 4], tap (a, b) of channel (u * 2 + v) * CIN + cin being tap (2a + u, 2b + v) of channel
    cin, zero past the 7x7 window and in the padding channels."""
    c, cin = w.shape[:2]
    w = torch.nn.functional.pad(w, (0, 1, 0, 1))  # 8x8
    w = w.view(c, cin, 4, 2, 4, 2).permute(0, 3, 5, 1, 2, 4).reshape(c, 4 * cin, 4, 4)
    return torch.nn.functional.pad(w, (0, 0, 0, 0, 0, SPACE_TO_DEPTH_CHANNELS - 4 * cin))


def stem_fuses(dtype: torch.dtype, precision: str) -> bool:
    """Whether the stem runs fused with its max-pool: wherever tensor cores multiply (all but strict fp32)."""
    return dtype != torch.float32 or precision != "ieee"


@dataclass
class PackedStem:
    """The stem's convolution with its batch-norm folded in: fused with its max-pool, the tiled 3x3 convolution
    (`tiled_filter`: [K, 4C], K = 9 * 16 CIN rows (dy, dx, p, q, cin)); else the 4x4 convolution over 2x2-pixel
    tiles (`space_to_depth_filter`), its max-pool a kernel of its own."""

    conv: PackedConv
    channels: int  # C
    fused: bool


def pack_stem(weight, stride=STRIDE, pad=PAD, bn=None, bias=None, dtype=torch.float32, device="cpu",
              kmajor=False, fused=True, tf32=False) -> PackedStem:
    """The stem's convolution ([C, CIN, 7, 7] `weight`, stride 2, padding 3) for `stem`, as pack_conv packs one
    (batch-norm folded in fp64, rounded once to `dtype`, K-major for TF32), its filter tiled (`fused`) or over 2x2-pixel tiles."""
    if (tuple(weight.shape[2:]) != (WINDOW, WINDOW) or (stride, pad) != (STRIDE, PAD)
            or 4 * weight.shape[1] > SPACE_TO_DEPTH_CHANNELS or weight.shape[0] % GROUP.value):
        raise ValueError(f"the stem packs a 7x7 stride-2 convolution padded by 3 over at most 4 channels, into a "
                         f"multiple of {GROUP.value}; not {tuple(weight.shape)} with stride {stride}, padding {pad}")
    w, b = fold_batch_norm(weight, bn, bias)
    if fused:
        b = b.view(-1, 1, GROUP.value).expand(-1, 4, -1).reshape(-1)  # as tiled_filter's columns
    conv = pack_conv(tiled_filter(w) if fused else space_to_depth_filter(w), 1, 0, bias=b, dtype=dtype,
                     device=device, kmajor=kmajor, tf32=tf32)
    return PackedStem(conv, w.shape[0], fused)


def stem(x: torch.Tensor, p: PackedStem, precision: str = "ieee", tune: bool = True, pdl: bool = False,
         untuned: dict | None = None) -> torch.Tensor:
    """max_pool(relu(bn(conv1(x))), 3, 2, 1) on NHWC `x` [N, H, W, CIN] -> NHWC [N, ceil(OH / 2), ceil(OW / 2), C].
    Fused: the input in 4x4 tiles, then one kernel (`untuned`: the configuration it runs where none is tuned, by
    default `_fixed`'s). Else: the input in 2x2 tiles, the convolution (conv.py), the max-pool (pool.py)."""
    n, h, w, cin = x.shape
    oh, ow = (h + 2 * PAD - WINDOW) // STRIDE + 1, (w + 2 * PAD - WINDOW) // STRIDE + 1
    if not p.fused:  # the 4x4 window over 2x2 tiles: OH + 3 of them, from PAD pixels before the image
        z = space_to_depth(x, 2, PAD, (oh + 3, ow + 3), SPACE_TO_DEPTH_CHANNELS, tune, pdl, precision)
        return max_pool2d(conv2d(z, p.conv, precision=precision, tune=tune, pdl=pdl), tune=tune, pdl=pdl)
    z = space_to_depth(x, TILE, TILE, (triton.cdiv(h, TILE) + 2, triton.cdiv(w, TILE) + 2), TILE * TILE * cin, tune,
                       pdl, precision)  # a zero tile around: the 3x3's padding, which the kernel's loads then need not mask
    zh, zw, c = z.shape[1], z.shape[2], p.channels
    ch, cw = triton.cdiv(oh, 2), triton.cdiv(ow, 2)  # = the pool's output size
    y = torch.empty((n, ch, cw, c), device=x.device, dtype=x.dtype)

    def grid(meta):  # as the kernel numbers its programs: channel blocks x bands x chunks for each image
        return (n * c // meta["BLOCK_C"] * triton.cdiv(ch, meta["BAND_TILES"] * meta["ROWS"] - 1)
                * triton.cdiv(cw, meta["BLOCK_W"] - 1),)

    args = (z, p.conv.weight, p.conv.bias, y, n, zh, zw, ch, cw, oh, ow, TILE * TILE * cin, c, precision,
            p.conv.kmajor, math.gcd(3 * TILE * TILE * cin, 128))
    launch(stem_pool_kernel, grid, args, tune, untuned or _fixed(cw, x.element_size()), pdl)
    return y
