"""The Triton rung's kernels against PyTorch, on the CPU through Triton's interpreter (CI has no GPU).

Everything runs in fp32 with strict ("ieee") dot precision, so the tolerances are tight: a wrong index, mask or
batch-norm fold shows up as a large error, not as rounding.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere in this process

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torchvision  # noqa: E402

from core.model import build_model  # noqa: E402
from kernels.triton.conv import _fixed, _split_buffers, conv2d, fuse_shortcut, pack_conv  # noqa: E402
from kernels.triton.pair import chain_pays, chainable, conv_pair, pays  # noqa: E402
from kernels.triton.pool import global_avg_pool, max_pool2d  # noqa: E402
from kernels.triton.stem import pack_stem, stem  # noqa: E402
from kernels.triton.resnet import pack_block, run_block  # noqa: E402
from core.cell import Cell, Store  # noqa: E402
from tiers.triton import TIER  # noqa: E402


def nhwc(t):
    return t.permute(0, 2, 3, 1).contiguous()


def nchw(t):
    return t.permute(0, 3, 1, 2)


def close(a, b, tol=1e-4):
    """Max abs error relative to the reference's magnitude."""
    err = (a - b).abs().max().item() / b.abs().max().item()
    assert err < tol, f"relative max error {err:.2e}"


# (batch, cin, cout, h, w, kernel, stride, pad, residual, relu): odd sizes everywhere; several cases span more than one
# tile in M (> 64 pixels), N (> 128 channels) and K (window row > 128 elements) under the interpreter's config.
CONV_CASES = [
    (3, 3, 17, 13, 10, 7, 2, 3, False, True),  # the stem's shape: 3 input channels, 7x7/s2/p3
    (3, 50, 130, 5, 7, 3, 1, 1, True, True),  # 3x3/s1: two K steps per window row, two channel tiles
    (3, 5, 7, 9, 11, 3, 2, 1, False, True),  # 3x3/s2 over an odd image
    (3, 19, 33, 7, 9, 1, 1, 0, True, False),  # 1x1: a GEMM, residual without ReLU
    (3, 19, 33, 7, 8, 1, 2, 0, False, False),  # 1x1/s2: the downsample shortcut
    (2, 40, 24, 5, 6, 1, 1, 1, True, True),  # 1x1/s1 padded: its window is not its own pixel
    (2, 4, 9, 8, 12, 3, 2, 1, True, True),  # 3x3/s2 over 4 channels: space-to-depth fills all 16 channels
    (1, 256, 40, 3, 3, 3, 1, 1, True, True),  # layer4's 3x3 at batch 1 in miniature: one output tile, K split in 8
    (1, 1024, 33, 1, 1, 1, 1, 0, False, False),  # the classifier at batch 1: a long K split in 4
]


@pytest.mark.parametrize("n,cin,cout,h,w,k,stride,pad,residual,relu", CONV_CASES)
def test_conv(n, cin, cout, h, w, k, stride, pad, residual, relu):
    torch.manual_seed(0)
    x, weight, bias = torch.randn(n, cin, h, w), torch.randn(cout, cin, k, k), torch.randn(cout)
    ref = F.conv2d(x, weight, bias, stride, pad)
    res = torch.randn_like(ref) if residual else None
    if residual:
        ref = ref + res
    if relu:
        ref = F.relu(ref)
    out = conv2d(nhwc(x), pack_conv(weight, stride, pad, bias=bias), nhwc(res) if residual else None, relu)
    close(nchw(out), ref)
    # K-major weights (the TF32 layout) compute the same function
    out = conv2d(nhwc(x), pack_conv(weight, stride, pad, bias=bias, kmajor=True), nhwc(res) if residual else None,
                 relu)
    close(nchw(out), ref)
    # e4m3 (per-channel weight scales, the input's calibrated scale): within e4m3's rounding of 3 mantissa bits
    out = conv2d(nhwc(x), pack_conv(weight, stride, pad, bias=bias, input_amax=x.abs().max().item()),
                 nhwc(res) if residual else None, relu)
    close(nchw(out), ref, tol=0.15)
    # e4m3 in and out, as between a block's convolutions: the input stored in its scale, the output in its own (one
    # more rounding to 3 mantissa bits, up to 1/16 of each output value, on top of the inputs')
    in_amax, out_amax = x.abs().max().item(), ref.abs().max().item()
    x8 = (nhwc(x) * (448 / in_amax)).to(torch.float8_e4m3fn)
    out = conv2d(x8, pack_conv(weight, stride, pad, bias=bias, input_amax=in_amax, output_amax=out_amax),
                 nhwc(res) if residual else None, relu)
    assert out.dtype == torch.float8_e4m3fn
    close(nchw(out.float() * (out_amax / 448)), ref, tol=0.25)


# (batch, the convolution's cin, kernel and padding (stride 1), the shortcut's cin and stride, cout, output h, w)
SHORTCUT_CASES = [
    (3, 8, 1, 0, 24, 2, 33, 5, 4),  # a bottleneck's conv3 with its stride-2 downsample: K tiles partly masked
    (2, 5, 3, 1, 7, 1, 9, 6, 5),  # a basic block's 3x3 with a stride-1 shortcut that changes the channels
    (1, 256, 1, 0, 512, 2, 40, 2, 2),  # batch 1: K split in 2, one slice spanning the convolution and the shortcut
]


@pytest.mark.parametrize("n,cin,k,pad,sc_cin,sc_stride,cout,oh,ow", SHORTCUT_CASES)
def test_conv_with_its_downsample_fused_in(n, cin, k, pad, sc_cin, sc_stride, cout, oh, ow):
    """relu(conv(x) + downsample(block input)) as one GEMM (fuse_shortcut) against the two F.conv2d, in both weight
    layouts; FP8 refuses it, and conv2d refuses a fused convolution without its shortcut input."""
    torch.manual_seed(0)
    x, block_input = torch.randn(n, cin, oh, ow), torch.randn(n, sc_cin, oh * sc_stride, ow * sc_stride)
    weight, bias = torch.randn(cout, cin, k, k), torch.randn(cout)
    down, down_bias = torch.randn(cout, sc_cin, 1, 1), torch.randn(cout)
    ref = F.relu(F.conv2d(x, weight, bias, 1, pad) + F.conv2d(block_input, down, down_bias, sc_stride))
    if n == 1:
        assert _fixed(m=oh * ow, cout=cout, kh=k, row=k * cin, elem=4, shortcut=sc_cin)["SPLIT_K"] == 2
    for kmajor in (False, True):
        fused = fuse_shortcut(pack_conv(weight, 1, pad, bias=bias, kmajor=kmajor),
                              pack_conv(down, sc_stride, 0, bias=down_bias, kmajor=kmajor))
        close(nchw(conv2d(nhwc(x), fused, shortcut=nhwc(block_input))), ref)
    with pytest.raises(ValueError, match="takes the block's input as `shortcut`"):
        conv2d(nhwc(x), fused)
    with pytest.raises(ValueError, match="outside FP8"):
        fuse_shortcut(pack_conv(weight, 1, pad, bias=bias, input_amax=1.0),
                      pack_conv(down, sc_stride, 0, bias=down_bias, input_amax=1.0))


def test_split_k_adds_its_slices_the_same_each_launch_and_leaves_its_counters_at_zero():
    torch.manual_seed(0)
    x, weight, bias = torch.randn(1, 256, 3, 3), torch.randn(40, 256, 3, 3), torch.randn(40)
    assert _fixed(m=9, cout=40, kh=3, row=3 * 256, elem=4)["SPLIT_K"] == 8  # this test's subject
    packed = pack_conv(weight, 1, 1, bias=bias)
    first = conv2d(nhwc(x), packed)
    close(nchw(first), F.relu(F.conv2d(x, weight, bias, 1, 1)))
    assert _split_buffers(x.device)[1].eq(0).all()  # every tile's counter reset by its last slice
    assert conv2d(nhwc(x), packed).equal(first)  # a second launch counts from zero and adds in the same order


def test_fp8_network_passes_fp8_parity_and_a_wrong_input_fails_it():
    """The fp8 cell's ResNet (e4m3 convolutions calibrated on the input) within the fp8 tolerance of eager fp32
    (docs/notes/fp8-parity.md); the same network given another input fails it. Activations in fp32 here: the
    interpreter has no bf16 arithmetic."""
    from core.model import make_input
    from core.parity import TOLERANCES, against_another_input, compare
    from core.recipes import calibration_amax
    from kernels.triton.resnet import TritonResNet

    model = build_model("resnet18").eval()
    x = make_input(8, 32)
    with torch.no_grad():
        ref = model(x)
        net = TritonResNet(model, torch.float32, "cpu", "tf32", tune=False, fp8_amax=calibration_amax(model, x))
        assert all(p.fp8 and p.kmajor for convs, down in net.blocks for p in convs + ([down] if down else []))
        assert not net.stem.conv.fp8 and not net.fc.fp8  # the first and last layers stay in the activations' type
        assert net.stem.fused  # its max-pool fused in wherever tensor cores multiply (TF32 here)
        # e4m3 out of every block's convolutions, the block's output in the next conv1's input scale; the last
        # block's output (the pool's input) and the downsample's in the activations' type
        outputs = [[p.output_dtype for p in convs] for convs, _ in net.blocks]
        assert outputs[:-1] == [[torch.float8_e4m3fn] * 2] * 7 and outputs[-1] == [torch.float8_e4m3fn, torch.float32]
        assert all(convs[-1].output_inv == following[0][0].input_inv
                   for (convs, _), following in zip(net.blocks, net.blocks[1:]))
        assert all(down.output_dtype == torch.float32 for _, down in net.blocks if down)
        other = model(make_input(8, 32, seed=1))  # the reference of another input, as parity takes it
        fp8 = against_another_input(compare(net(x), ref, "fp8"), other, ref, "fp8")
        wrong = against_another_input(compare(net(make_input(8, 32, seed=2)), ref, "fp8"), other, ref, "fp8")
    assert fp8["ok"] and fp8["rel_err"] > TOLERANCES["bf16"]["rel_err"], fp8  # bf16's tolerance would not do
    assert not wrong["ok"], wrong


@pytest.mark.gpu
def test_the_fp8_network_with_e4m3_block_outputs_and_chains_repeats_its_bits():
    """Issue 58 on the GPU: the fp8 ResNet-50 (every block's output in e4m3, pairs and chains on) gives the same
    logits bit for bit on every call, planned or through Triton's own launches. A chained
    pair once multiplied the very e4m3 tile its epilogue stored, and its results changed from call to call on sm90
    (`results/nvidia-h100-80gb-hbm3/checks/fp8-e4m3-boundaries/` before f1fe746); its operand is converted now."""
    from core.model import make_input
    from core.recipes import calibration_amax, calibration_input
    from kernels.triton.resnet import TritonResNet

    model = build_model("resnet50").eval().cuda()
    x = make_input(32, 224).cuda()
    amax = calibration_amax(model, calibration_input(32, 224).cuda())

    def network(planned: bool) -> TritonResNet:
        # Untuned, and dependent launches both ways: forced chains have shapes no table holds, and each kernel
        # variant compiles anew on a fresh machine (the fp8 cell's first result takes about 66 s); the ladder's
        # `repeatable` check covers the tuned configurations.
        return TritonResNet(model, torch.bfloat16, x.device, "tf32", False, amax, planned=planned, pdl=True,
                            pairs="on", chains="on")

    with torch.no_grad():
        net = network(planned=True)
        assert [p.output_dtype for convs, _ in net.blocks for p in convs[-1:]].count(torch.float8_e4m3fn) == 15
        assert sum(net.chained(packed[0][-1], following[0][0]) for packed, following in zip(net.blocks,
                                                                                          net.blocks[1:])) > 0
        calls = [net(x) for _ in range(4)]  # the first records the plan, the others replay it
        own = [network(planned=False)(x) for _ in range(2)]
    assert all(torch.equal(calls[0], out) for out in calls[1:] + own)


def test_micro_checks_each_fp8_layer_as_the_fp8_cell_runs_it_and_a_wrong_scale_fails():
    """`micro --tier triton --dtype fp8`'s layers: e4m3 kernels (the stem in the activations' type, as in the fp8
    cell) each within a few percent of the layer in fp32, far inside fp8's network tolerance; a weight scale 3x off
    fails. Activations in fp32: the interpreter has no bf16 arithmetic."""
    from core.layers import distinct_layers
    from tiers.triton import LayerCase

    torch.manual_seed(0)
    layers = {layer.path: layer for layer in distinct_layers("resnet50", 32)}
    for path in ("conv1", "layer1.0.conv1", "layer1.0.conv2", "layer1.0.conv3", "layer2.0.downsample.0"):
        case = LayerCase(layers[path], 2, "fp8", True, "cpu", activations=torch.float32)
        conv = case.packed.conv if path == "conv1" else case.packed  # (the stem's packing holds its convolution)
        assert case.kernel == ("float32" if path == "conv1" else "e4m3") and conv.fp8 == (path != "conv1")
        # as in the cell, every block convolution reads e4m3 but the first block's conv1 and downsample (the stem's
        # output: fp32 here), and writes e4m3 but the downsample
        reads_stem = path in ("conv1", "layer1.0.conv1")
        assert case.ours.args[0].dtype == (torch.float32 if reads_stem else torch.float8_e4m3fn)
        assert (conv.output_dtype == torch.float8_e4m3fn) == path.startswith("layer1.0.")
        # seen: 0.06-0.08, and 0.16 for conv2, whose e4m3 output adds the rounding its consumer's input would have
        assert case.parity["ok"] and case.parity["rel_err"] < 0.2, (path, case.parity)
    case.packed.scale.mul_(3)
    assert not case.check()["ok"]


# (batch, cin, the 3x3's channels (a power of two), the 1x1's channels, h, w, the downsample's stride (0: none)):
# outputs of more than one pixel tile (> 64), conv3's channels in more than one slice (> 128) or in a slice they do
# not fill; a block's first, its downsample fused in, at stride 1 (layer1's) and 2
PAIR_CASES = [(3, 24, 16, 72, 7, 9, 0), (2, 20, 32, 160, 5, 4, 0), (2, 24, 16, 72, 7, 9, 1), (2, 24, 16, 40, 9, 7, 2)]


@pytest.mark.parametrize("n,cin,mid,cout,h,w,sc_stride", PAIR_CASES)
def test_3x3_and_the_1x1_after_it_as_one_kernel(n, cin, mid, cout, h, w, sc_stride):
    """conv_pair against F.conv2d's bottleneck tail (3x3 + ReLU, 1x1 + residual or downsample + ReLU), alone and
    with the next block's conv1 chained, in both weight layouts; in FP8 the same as the kernels apart (conv2's
    output rounded to e4m3 in conv3's scale either way, the block's output in conv1's); a 1x1 that is strided, and
    a fused downsample without the block's input, are refused."""
    torch.manual_seed(0)
    stride = max(sc_stride, 1)
    x, w2, b2 = torch.randn(n, cin, h, w), torch.randn(mid, cin, 3, 3) / cin ** 0.5, torch.randn(mid)
    w3, b3 = torch.randn(cout, mid, 1, 1) / mid ** 0.5, torch.randn(cout)
    mid_ref = F.relu(F.conv2d(x, w2, b2, stride, 1))
    if sc_stride:  # the block's input (x here: conv1 is not part of the pair), its downsample fused into conv3
        down, down_bias = torch.randn(cout, cin, 1, 1) / cin ** 0.5, torch.randn(cout)
        ref = F.relu(F.conv2d(mid_ref, w3, b3) + F.conv2d(x, down, down_bias, sc_stride))
    else:
        res = torch.randn(n, cout, *mid_ref.shape[2:])
        ref = F.relu(F.conv2d(mid_ref, w3, b3) + res)
    # the next block's conv1, chained: run on the output as stored
    w4, b4 = torch.randn(16, cout, 1, 1) / cout ** 0.5, torch.randn(16)
    ref_next = F.relu(F.conv2d(ref, w4, b4))
    for kmajor in (False, True):
        conv2, conv3 = pack_conv(w2, stride, 1, bias=b2, kmajor=kmajor), pack_conv(w3, bias=b3, kmajor=kmajor)
        conv4 = pack_conv(w4, bias=b4, kmajor=kmajor)
        if sc_stride:
            conv3 = fuse_shortcut(conv3, pack_conv(down, sc_stride, 0, bias=down_bias, kmajor=kmajor))
        side = {"shortcut": nhwc(x)} if sc_stride else {"residual": nhwc(res)}
        out, none = conv_pair(nhwc(x), conv2, conv3, **side)
        close(nchw(out), ref)
        assert none is None
        out, following = conv_pair(nhwc(x), conv2, conv3, chain=conv4, **side)
        close(nchw(out), ref)
        close(nchw(following), ref_next)
    if sc_stride:
        with pytest.raises(ValueError, match="as `shortcut`"):
            conv_pair(nhwc(x), conv2, conv3, residual=nhwc(x))
        return
    mid_amax, out_amax, res_amax = mid_ref.abs().max().item(), ref.abs().max().item(), res.abs().max().item()
    conv2 = pack_conv(w2, 1, 1, bias=b2, input_amax=x.abs().max().item(), output_amax=mid_amax)
    conv4 = pack_conv(w4, bias=b4, input_amax=out_amax, output_amax=ref_next.abs().max().item())
    # the residual as a block's input is stored in FP8: e4m3, in its scale; the block's output in e4m3 in the next
    # conv1's input scale (chained, that conv1 reads it as stored), or, the network's last, in the activations' type
    res_scale = res_amax / 448
    res_e4m3 = (nhwc(res) / res_scale).to(torch.float8_e4m3fn)
    for output_amax in (out_amax, None):
        conv3 = pack_conv(w3, bias=b3, input_amax=mid_amax, output_amax=output_amax)
        apart = conv2d(conv2d(nhwc(x), conv2), conv3, residual=res_e4m3, residual_scale=res_scale)
        apart_next = conv2d(apart, conv4)
        out, following = conv_pair(nhwc(x), conv2, conv3, residual=res_e4m3, residual_scale=res_scale, chain=conv4)
        assert out.dtype == (torch.float8_e4m3fn if output_amax else torch.float32)
        assert following.dtype == torch.float8_e4m3fn  # conv1 feeds its block's conv2 in e4m3, as apart
        close(out.float(), apart.float(), 1e-5)
        close(following.float(), apart_next.float(), 1e-5)
        # and e4m3's rounding, not a wrong index or scale: 0.08 with the output in fp32 here, 0.12 in e4m3, by the
        # norm (the cell's measure), as the interpreter rounds some values at a binade's top down a binade
        # (triton-lang/triton#8322): 127.9 to 64, not 128
        stored = nchw(apart.float() * (out_amax / 448 if output_amax else 1))
        assert ((stored - ref).norm() / ref.norm()).item() < 0.15
    with pytest.raises(ValueError, match="residual_scale"):  # an e4m3 residual read without its scale
        conv2d(conv2d(nhwc(x), conv2), conv3, residual=res_e4m3)
    with pytest.raises(ValueError, match="1x1 stride-1"):
        conv_pair(nhwc(x), pack_conv(w2, 1, 1, bias=b2), pack_conv(w3, 2, bias=b3), residual=nhwc(res))


def test_the_pair_runs_by_default_in_16_and_8_bit_cells_where_every_sm_gets_a_tile_of_at_most_128_channels():
    conv2, conv3 = pack_conv(torch.randn(64, 64, 3, 3), 1, 1), pack_conv(torch.randn(256, 64, 1, 1))
    assert pays(torch.empty(32, 56, 56, 256, dtype=torch.bfloat16), conv2, conv3)  # batch 32's layer1
    assert not pays(torch.empty(1, 56, 56, 256, dtype=torch.bfloat16), conv2, conv3)  # batch 1's: 49 tiles
    assert not pays(torch.empty(32, 56, 56, 256), conv2, conv3)  # fp32 / tf32: not measured
    layer3 = pack_conv(torch.randn(256, 256, 3, 3), 1, 1), pack_conv(torch.randn(1024, 256, 1, 1))
    assert not pays(torch.empty(256, 14, 14, 1024, dtype=torch.bfloat16), *layer3)
    # a block's first, its downsample fused into conv3: layer1.0 reads 64 channels of its input again, layer2.0 256
    first = fuse_shortcut(conv3, pack_conv(torch.randn(256, 64, 1, 1)))
    assert pays(torch.empty(256, 56, 56, 64, dtype=torch.bfloat16), conv2, first)
    layer2 = pack_conv(torch.randn(128, 128, 3, 3), 2, 1), pack_conv(torch.randn(512, 128, 1, 1))
    second = fuse_shortcut(layer2[1], pack_conv(torch.randn(512, 256, 1, 1), 2))
    assert not pays(torch.empty(256, 56, 56, 256, dtype=torch.bfloat16), layer2[0], second)
    assert pays(torch.empty(256, 28, 28, 512, dtype=torch.bfloat16), *layer2)
    # the next block's conv1 chained into a pair: a 1x1 of at most 128 channels (layer3's 256 are not)
    assert chainable(conv3, pack_conv(torch.randn(64, 256, 1, 1)))
    assert not chainable(conv3, pack_conv(torch.randn(256, 256, 1, 1)))
    assert not chainable(conv3, pack_conv(torch.randn(64, 256, 3, 3), 1, 1))
    # and by default where it was measured faster: a 64-channel conv1 after a pair without a downsample
    assert chain_pays(conv3, pack_conv(torch.randn(64, 256, 1, 1)))
    assert not chain_pays(conv3, pack_conv(torch.randn(128, 256, 1, 1)))
    assert not chain_pays(first, pack_conv(torch.randn(64, 256, 1, 1)))


def test_linear():
    torch.manual_seed(0)
    x, fc = torch.randn(3, 37), torch.nn.Linear(37, 29)
    out = conv2d(x[:, None, None, :], pack_conv(fc.weight[:, :, None, None], bias=fc.bias), relu=False)
    close(out.view(3, 29), F.linear(x, fc.weight, fc.bias).detach())


# The interpreter's untuned configuration (two rows a tile, 16 cells wide, bands of 7 rows), the GPU's (one row a
# tile, of one channel group) and the same through TMA: at 64 pixels a side, 16 x 16 pool outputs, each row in two
# tiles, each image in three bands.
STEM_TILINGS = [None, dict(ROWS=1, BLOCK_W=16, BLOCK_C=32, BAND_TILES=5, BLOCK_K=32, num_warps=4, num_stages=2),
                dict(ROWS=1, BLOCK_W=16, BLOCK_C=32, BAND_TILES=5, BLOCK_K=16, TMA=True, num_warps=4, num_stages=2)]


@pytest.mark.parametrize("fused,untuned", [(True, t) for t in STEM_TILINGS] + [(False, None)])
@pytest.mark.parametrize("h,w", [(64, 64), (30, 26)])  # 30 x 26: odd convolution outputs, a cell half outside
def test_stem_with_its_max_pool(h, w, fused, untuned):
    """The stem (convolution, batch-norm, ReLU) and its 3x3 max-pool, fused into one kernel or not, against
    PyTorch's, in both weight layouts; the batch-norm folded; a convolution that is not the stem's refused."""
    torch.manual_seed(0)
    conv, bn = torch.nn.Conv2d(3, 64, 7, 2, 3, bias=False), randomise_bn(torch.nn.BatchNorm2d(64))
    x = torch.randn(2, 3, h, w)
    with torch.no_grad():
        ref = F.max_pool2d(F.relu(bn(conv(x))), 3, 2, 1)
    for kmajor in (False, True):
        packed = pack_stem(conv.weight, 2, 3, bn, dtype=torch.float32, kmajor=kmajor, fused=fused)
        close(nchw(stem(nhwc(x), packed, tune=False, untuned=untuned)), ref)
    with pytest.raises(ValueError, match="the stem packs a 7x7 stride-2 convolution"):
        pack_stem(torch.randn(64, 3, 5, 5), 2, 2)


def test_max_pool():
    x = torch.randn(3, 13, 9, 11)
    assert torch.equal(nchw(max_pool2d(nhwc(x))), F.max_pool2d(x, 3, 2, 1))


def test_global_avg_pool():
    x = torch.randn(3, 13, 7, 5)
    close(global_avg_pool(nhwc(x)), F.adaptive_avg_pool2d(x, 1).flatten(1), 1e-6)


def randomise_bn(module, seed=0):
    """Random batch-norm statistics and affine terms (torchvision's defaults fold to the identity)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                for t, lo, hi in ((m.weight, 0.5, 1.5), (m.bias, -0.2, 0.2), (m.running_mean, -0.2, 0.2),
                                  (m.running_var, 0.5, 2.0)):
                    t.copy_(torch.empty(t.shape).uniform_(lo, hi, generator=g))
    return module.eval()


@pytest.mark.parametrize("downsample", [False, True])
def test_bottleneck(downsample):
    torch.manual_seed(0)
    planes = 8
    if downsample:  # stride 2 and a channel change: the shortcut is a 1x1/s2 conv + BN
        inplanes, stride = 24, 2
        down = torch.nn.Sequential(torch.nn.Conv2d(inplanes, planes * 4, 1, stride, bias=False),
                                   torch.nn.BatchNorm2d(planes * 4))
    else:
        inplanes, stride, down = planes * 4, 1, None
    block = randomise_bn(torchvision.models.resnet.Bottleneck(inplanes, planes, stride, down))
    x = torch.randn(3, inplanes, 9, 7)
    with torch.no_grad():
        ref = block(x)
    convs, shortcut = pack_block(block, torch.float32, "cpu")
    assert shortcut is None and convs[-1].shortcut_stride == (stride if downsample else 0)  # fused in, if any
    out, following = run_block(nhwc(x), (convs, shortcut))
    close(nchw(out), ref)
    assert following is None  # no chain asked for


# resnet50 with its conv2 + conv3 pairs (pairs=on, chain=on; by default the fp32 cells run them apart): thirteen
# blocks paired (layer4's 512-channel 3x3s are not), each one launch shorter, and six of them run the next block's
# conv1 too (those of layer1 and layer2 but the last: layer3's conv1s have 256 channels). Its unpaired blocks
# (layer4's, and the downsample blocks with their shortcut fused) run the bottleneck as pairs=off would: a
# separate resnet50 case with pairs off cost a minute of CI for no path of its own.
@pytest.mark.parametrize("model,channels_last,pairs", [("resnet18", False, "auto"), ("resnet50", True, "on")])
def test_tier_forward(model, channels_last, pairs):
    """The whole rung as the worker drives it, against eager, on a tiny image."""
    assert TIER.availability("cpu") is None
    net = build_model(model)
    x = torch.randn(1, 3, 32, 32)
    example = x.to(memory_format=torch.channels_last) if channels_last else x
    built = TIER.build(net, example, Cell(tier="triton", model=model, batch=1, res=32, device="cpu",
                                          channels_last=channels_last, options=(("chain", pairs), ("pairs", pairs))),
                       Store())
    with torch.no_grad():
        ref = net(x)
    out = built.forward(example)
    close(out, ref)
    assert out.argmax(1).equal(ref.argmax(1))
    assert built.stats["autotune"] == "interpreter"
    # the stem's three launches in strict fp32 (tiles, convolution, max-pool), the average pool, the classifier;
    # each block's convolutions, the downsample fused in
    blocks = {"resnet50": 16 * 3, "resnet18": 8 * 2}[model]
    assert built.stats["launches_per_forward"] == 5 + blocks - (13 + 6 if pairs == "on" else 0)


@pytest.mark.quick
def test_a_shapes_way_of_running_comes_from_the_tables_else_the_first(monkeypatch):
    """tuning.choose: the tables' choice for the key; without one and with nothing timed (tuning off, or where
    timing is not allowed: the interpreter, the prepare stage), the first way; no way runs unless it is timed."""
    from kernels.triton import tuning

    ran = []
    ways = {"epilogue": lambda: ran.append("epilogue"), "apart": lambda: ran.append("apart")}
    key = "stats_epilogue|moments,2,7,7,8,16,3,3,1,1|bfloat16,float32"
    monkeypatch.setitem(tuning.TABLE, key, {"choice": "apart"})
    monkeypatch.setattr(tuning, "NO_AUTOTUNE", True)
    assert tuning.choose(key, ways, tune=True) == "apart"
    assert tuning.choose(key, ways, tune=False) == "epilogue"
    assert tuning.choose(key.replace("moments", "grad_sums"), ways, tune=True) == "epilogue"
    assert not ran and key.replace("moments", "grad_sums") not in tuning.TUNED


@pytest.mark.quick
def test_every_shipped_tuning_key_has_the_shape_its_kernel_builds():
    """A shipped table's key is the kernel, its key arguments' values and its tensor arguments' dtypes
    (kernels/triton/tuning.py table_key). A kernel that gains a key or a pointer argument changes every key it
    builds, and a table left as it was would silently stop serving: each key here must have as many values as
    the kernel's key and as many dtypes as it has pointer arguments. (A choice between ways of running a shape,
    tuning.choose's, has a key of its own making.)"""
    import importlib
    import json
    import pkgutil

    import kernels.triton
    from tests.conftest import REPO

    kernels_by_name = {}
    for module in pkgutil.iter_modules(kernels.triton.__path__):
        for name, obj in vars(importlib.import_module(f"kernels.triton.{module.name}")).items():
            if hasattr(obj, "keys") and hasattr(obj, "fn"):  # an autotuned Triton kernel
                kernels_by_name[name] = obj
    wrong = []
    for table in sorted((REPO / "kernels" / "tunings").glob("*/triton.json")):
        for key, entry in json.loads(table.read_text())["configs"].items():
            name, values, dtypes = key.split("|")
            if "choice" in entry:  # tuning.choose's: which way a shape runs, named in its own key
                continue
            kernel = kernels_by_name[name]
            pointers = [a for a in kernel.fn.arg_names if a.endswith("_ptr")]
            if len(values.split(",")) != len(kernel.keys) or len(dtypes.split(",")) != len(pointers):
                wrong.append(f"{table.parent.name}: {key}")
    assert kernels_by_name and not wrong, wrong[:5]


@pytest.mark.quick
def test_each_element_size_gets_k_tiles_of_the_same_row_bytes_and_fp8_also_doubled_ones():
    """The convolution's configs are pruned per problem: fp32 halves the K tile (the same shared memory as bf16's),
    e4m3 keeps it and adds the doubled one (128-byte rows, half the promotions of its sums to fp32), all within
    the window row (a 64-channel 1x1 takes no tile beyond 64)."""
    from kernels.triton.conv import CONFIGS, _prune

    def k_tiles(dtype, cin):
        args = {"x_ptr": torch.empty(1, dtype=dtype), "KW": 1, "KH": 1, "CIN": cin, "M": 100352, "COUT": 256,
                "SC_CIN": 0}
        return sorted({c.kwargs["BLOCK_K"] for c in _prune(CONFIGS, args) if c.kwargs["SPLIT_K"] == 1})

    bf16 = k_tiles(torch.bfloat16, 256)
    assert bf16 == [64, 128]
    assert k_tiles(torch.float32, 256) == [k // 2 for k in bf16]
    assert k_tiles(torch.float8_e4m3fn, 256) == sorted(set(bf16) | {2 * k for k in bf16})
    assert k_tiles(torch.float8_e4m3fn, 64) == [64]
