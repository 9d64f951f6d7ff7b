"""The Triton convolution gradients (kernels/triton/conv_backward.py) against PyTorch's autograd, on odd shapes,
under the interpreter on the CPU (the kernels themselves, real Triton)."""
import os
import subprocess
import sys
import weakref

import pytest
import torch
import torch.nn.functional as F

from kernels.triton.batch_norm import REDUCTION_CONFIGS
from kernels.triton.conv import CONFIGS as CONV_CONFIGS
from kernels.triton.conv_backward import WEIGHT_GRAD_CONFIGS, conv2d_input_grad, conv2d_weight_grad

# (kernel, stride, padding, input channels, output channels, input size): every convolution kind of a ResNet (the
# stem's 7x7/2 over 3 channels, 3x3/1 and 3x3/2, 1x1/1 and the downsample's 1x1/2) at sizes that leave edges:
# channel counts off the tiles, inputs the stride does not divide; and few channels over many pixels, which the
# reduction cuts into slices (kernels/triton/split.py), the last one short. The data gradient's phases (a stride
# wider than the kernel, whose last phase no tap lands on; an even kernel over an odd input).
CASES = [(7, 2, 3, 3, 20, 13), (3, 1, 1, 37, 19, 7), (3, 2, 1, 18, 33, 9), (1, 1, 0, 40, 24, 5), (1, 2, 0, 21, 35, 8),
         (1, 1, 0, 5, 6, 23), (3, 4, 0, 5, 6, 10), (2, 2, 0, 4, 5, 9)]


def autograd(x, weight, stride, pad):
    x, weight = x.double().requires_grad_(), weight.double().requires_grad_()
    y = F.conv2d(x, weight, stride=stride, padding=pad)
    dy = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y.backward(dy)
    return dy, x.grad, weight.grad


@pytest.mark.parametrize("k,stride,pad,cin,cout,size", CASES)
def test_both_gradients_are_autograds_in_strict_fp32(k, stride, pad, cin, cout, size):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, cin, size, size, generator=g)
    weight = torch.randn(cout, cin, k, k, generator=g) / (cin * k * k) ** 0.5
    dy, dx_ref, dw_ref = autograd(x, weight, stride, pad)

    def nhwc(t):
        return t.float().permute(0, 2, 3, 1).contiguous()

    dw = conv2d_weight_grad(nhwc(x), nhwc(dy), k, k, stride, pad)
    flat = torch.full((3 + dw.numel(),), float("nan"))  # the gradient written into its slice of a flat buffer
    into = flat[3:].view(dw.shape)
    assert conv2d_weight_grad(nhwc(x), nhwc(dy), k, k, stride, pad, out=into) is into and torch.equal(into, dw)
    dx = conv2d_input_grad(nhwc(dy), weight, stride, pad, (size, size), tune=False).permute(0, 3, 1, 2)
    for got, ref in ((dw, dw_ref), (dx, dx_ref)):
        assert got.shape == ref.shape
        err = ((got.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-5, err


@pytest.mark.parametrize("k,stride,pad,cin,cout,size", [(3, 1, 1, 37, 19, 7), (1, 1, 0, 40, 24, 5),
                                                         (3, 2, 1, 18, 33, 9), (3, 1, 1, 5, 6, 6)])
def test_the_norm_prologue_is_the_convolution_of_the_stored_normalised_activation(k, stride, pad, cin, cout, size):
    """conv2d's `norm` (the batch norm before it applied and ReLU'd on the load, MLPerf's norm-conv): the output and
    the epilogue's moments of conv(relu(x * scale + shift)) with x the batch norm's input, against the same
    convolution of the normalised tensor stored first; the weight gradient recomputing it the same way (by taps,
    and with the taps in the tile over 5 channels) against the stored tensor's; the padding stays zero (a shift
    above zero must not leak into it); a shift swapped between channels changes the output."""
    from kernels.triton.conv import conv2d, conv2d_stats, pack_weights

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, size, size, cin, generator=g)  # NHWC, the batch norm's input
    scale, shift = torch.rand(cin, generator=g) + 0.5, torch.randn(cin, generator=g).abs() + 0.1
    norm = torch.stack([scale, shift])
    weight = torch.randn(cout, cin, k, k, generator=g) / (cin * k * k) ** 0.5
    packed = pack_weights(weight, stride, pad, dtype=torch.float32)
    stored = torch.relu(x * scale + shift)
    want = conv2d(stored, packed, relu=False, tune=False)
    got = conv2d(x, packed, relu=False, tune=False, norm=norm)
    reference = F.conv2d(stored.permute(0, 3, 1, 2).double(), weight.double(), stride=stride, padding=pad)
    assert ((got.permute(0, 3, 1, 2).double() - reference).norm() / reference.norm()).item() < 1e-5
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    (y, stats), (y_want, stats_want) = conv2d_stats(x, packed, tune=False, norm=norm), conv2d_stats(stored, packed,
                                                                                                    tune=False)
    assert torch.allclose(y, y_want, rtol=1e-5, atol=1e-5) and stats.rows == stats_want.rows
    written = -(-y.shape[0] * y.shape[1] * y.shape[2] // stats.rows)  # the slices a row of tiles wrote
    assert all(torch.allclose(a[:written], b[:written], rtol=1e-4, atol=1e-4)
               for a, b in zip(stats[:2], stats_want[:2]))
    dy = torch.randn(want.shape, generator=g)
    dw = conv2d_weight_grad(x, dy, k, k, stride, pad, tune=False, norm=norm)
    assert torch.allclose(dw, conv2d_weight_grad(stored, dy, k, k, stride, pad, tune=False), rtol=1e-5, atol=1e-5)
    wrong = torch.stack([scale, shift.roll(1)])
    assert not torch.allclose(conv2d(x, packed, relu=False, tune=False, norm=wrong), want, rtol=1e-3, atol=1e-3)
    assert not torch.allclose(conv2d_weight_grad(x, dy, k, k, stride, pad, tune=False, norm=wrong), dw, rtol=1e-3,
                              atol=1e-3)
    for wrong_shape in (lambda: conv2d(x, packed, relu=False, tune=False, norm=norm[:, :-1]),
                        lambda: conv2d_weight_grad(x, dy, k, k, stride, pad, norm=norm[:, :-1])):
        with pytest.raises(ValueError, match="scale and shift as fp32"):
            wrong_shape()


def test_weight_gradient_over_many_slices_is_autograds_and_repeats(monkeypatch):
    """With a GPU's count of programs, a 1x1 over few channels and many pixels is cut into 106 slices: their sum
    (16 at a time, the last block short) against fp64 autograd, and the same bits on a second call."""
    from kernels.triton import split

    monkeypatch.setattr(split, "_target_programs", lambda device: 200)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 130, 130, generator=g)
    weight = torch.randn(6, 5, 1, 1, generator=g)
    dy, _, dw_ref = autograd(x, weight, 1, 0)
    nhwc_x, nhwc_dy = (t.float().permute(0, 2, 3, 1).contiguous() for t in (x, dy))
    assert split.row_slices(2 * 130 * 130, 1, 64, x.device)[0] == 106
    dw = conv2d_weight_grad(nhwc_x, nhwc_dy, 1, 1, 1, 0)
    assert ((dw.double() - dw_ref).norm() / dw_ref.norm()).item() < 1e-5
    assert torch.equal(dw, conv2d_weight_grad(nhwc_x, nhwc_dy, 1, 1, 1, 0))


@pytest.mark.parametrize("n,size,channels,programs,finalize_slices", [
    (3, 5, 37, 4, 128), (2, 7, 64, 4, 128), (1, 2, 5, 4, 128), (3, 19, 5, 4, 128), (1, 120, 5, 200, 128),
    (1, 120, 5, 200, 7)])
def test_batch_norm_in_training_is_autograds_both_ways(n, size, channels, programs, finalize_slices, monkeypatch):
    """Forward (the batch's moments, biased, the affine map, and the running statistics' update) and backward (dx,
    dgamma, dbeta, written into the tensors given) against F.batch_norm in training mode, in fp64, on channel
    counts off the tiles, a batch of 4 values per channel, and many rows over few channels (cut into slices, the
    last one short; with a GPU's count of programs, 90 slices: more than two of the finalize kernels' tiles; and
    those merged 13 at a time into 7 before the finalize, the last group short)."""
    from kernels.triton import batch_norm, split

    monkeypatch.setattr(split, "_target_programs", lambda device: programs)
    monkeypatch.setattr(batch_norm, "FINALIZE_SLICES", finalize_slices)
    if programs > 4:
        assert batch_norm._slices(torch.empty(n, size, size, channels), tune=False)[0] > 2 * batch_norm.BLOCK_S

    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, channels, size, size, generator=g) * 3 + 2  # a mean the moments must not cancel
    gamma, beta = torch.rand(channels, generator=g) + 0.5, torch.randn(channels, generator=g)
    dy = torch.randn(x.shape, generator=g)
    xd, gd, bd = (t.double().requires_grad_() for t in (x, gamma, beta))
    run_mean, run_var = torch.randn(channels, generator=g), torch.rand(channels, generator=g) + 0.5
    ref_mean, ref_var = run_mean.double(), run_var.double()
    ref = F.batch_norm(xd, ref_mean, ref_var, gd, bd, training=True, momentum=0.1, eps=1e-5)
    ref.backward(dy.double())

    def nhwc(t):
        return t.permute(0, 2, 3, 1).contiguous()

    batches = torch.tensor(4)
    y, mean, invstd = batch_norm.forward(nhwc(x), gamma, beta, eps=1e-5, running=(run_mean, run_var, batches),
                                            momentum=0.1)
    into = torch.full((2, channels), float("nan"))
    dx, dgamma, dbeta = batch_norm.backward(nhwc(dy), nhwc(x), mean, invstd, gamma, dgamma=into[0], dbeta=into[1])
    assert dgamma.data_ptr() == into[0].data_ptr() and dbeta.data_ptr() == into[1].data_ptr()
    assert batches.item() == 5
    for got, want in ((y.permute(0, 3, 1, 2), ref), (dx.permute(0, 3, 1, 2), xd.grad), (dgamma, gd.grad),
                      (dbeta, bd.grad), (run_mean, ref_mean), (run_var, ref_var)):
        err = ((got.double() - want.detach()).norm() / want.detach().norm()).item()
        assert err < 1e-5, err


@pytest.mark.parametrize("size,channels", [(9, 37), (8, 5), (13, 3)])
def test_the_pools_backward_is_autograds_and_ties_go_to_the_first_maximum(size, channels):
    """The stem's max-pool (3x3/s2, pad 1) forward and backward, and the global average pool's backward, against
    autograd; inputs rounded to few values so that windows hold ties, where PyTorch's first maximum takes it all."""
    from kernels.triton import pool_backward

    g = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 4, (2, channels, size, size), generator=g).float()  # many ties
    xd = x.double().requires_grad_()
    ref = F.max_pool2d(xd, 3, 2, 1)
    dy = torch.randn(ref.shape, generator=g)
    ref.backward(dy.double())

    def nhwc(t):
        return t.permute(0, 2, 3, 1).contiguous()

    y, pos = pool_backward.max_pool_forward(nhwc(x))
    dx = pool_backward.max_pool_backward(nhwc(dy), pos, (size, size))
    assert torch.equal(y.permute(0, 3, 1, 2).double(), ref.detach())
    assert torch.allclose(dx.permute(0, 3, 1, 2).double(), xd.grad, atol=1e-6)

    pooled = xd.detach().clone().requires_grad_()
    pooled.mean((2, 3)).backward(dy[:, :, 0, 0].double())
    avg = pool_backward.global_avg_pool_backward(dy[:, :, 0, 0].contiguous(), (size, size))
    assert torch.allclose(avg.permute(0, 3, 1, 2).double(), pooled.grad, atol=1e-7)


def test_cross_entropy_and_its_gradient_are_autograds():
    from kernels.triton.cross_entropy import cross_entropy

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 1000, generator=g) * 4
    labels = torch.tensor([0, 999, 7, 7, 512])
    zd = logits.double().requires_grad_()
    ref = F.cross_entropy(zd, labels)
    ref.backward()
    loss, grad = cross_entropy(logits, labels)
    assert abs(loss.item() - ref.item()) < 1e-5 * ref.item()
    assert torch.allclose(grad.double(), zd.grad, atol=1e-7)


def test_one_sgd_launch_updates_every_parameter_as_torch_optim_sgd_does():
    """Three steps over two parameters held as views of one flat buffer, against torch.optim.SGD with momentum 0.9
    and weight decay 1e-4 (the ladder's, core/train.py): the first step's buffer is the gradient itself."""
    from kernels.triton.sgd import sgd_step

    g = torch.Generator().manual_seed(0)
    flat, grads, buf = torch.randn(1500, generator=g), torch.zeros(1500), torch.zeros(1500)
    params = [torch.nn.Parameter(flat[:1000].clone().view(10, 100)), torch.nn.Parameter(flat[1000:].clone())]
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-4)
    for step in range(3):
        grads.copy_(torch.randn(1500, generator=g))
        params[0].grad, params[1].grad = grads[:1000].view(10, 100).clone(), grads[1000:].clone()
        optimizer.step()
        sgd_step(flat, grads, buf, lr=torch.tensor([0.1]), momentum=0.9, weight_decay=1e-4)
    assert torch.allclose(flat, torch.cat([params[0].detach().flatten(), params[1].detach()]), atol=1e-6)


def test_a_blocks_end_bn_add_relu_is_autograds_both_ways():
    """y = relu(bn(x) + residual), a bottleneck's end: forward, and backward through the ReLU (its mask from y) to
    x, gamma, beta and the residual, against autograd in fp64."""
    from kernels.triton import batch_norm

    g = torch.Generator().manual_seed(0)
    x, residual = torch.randn(2, 37, 6, 6, generator=g), torch.randn(2, 37, 6, 6, generator=g)
    gamma, beta = torch.rand(37, generator=g) + 0.5, torch.randn(37, generator=g) * 0.5
    dy = torch.randn(x.shape, generator=g)
    xd, rd, gd, bd = (t.double().requires_grad_() for t in (x, residual, gamma, beta))
    ref = torch.relu(F.batch_norm(xd, None, None, gd, bd, training=True, eps=1e-5) + rd)
    ref.backward(dy.double())

    def nhwc(t):
        return t.permute(0, 2, 3, 1).contiguous()

    def nchw(t):
        return t.permute(0, 3, 1, 2)

    y, mean, invstd = batch_norm.forward(nhwc(x), gamma, beta, residual=nhwc(residual), relu=True)
    dx, dgamma, dbeta, dres = batch_norm.backward(nhwc(dy), nhwc(x), mean, invstd, gamma, y=y, residual=True)
    assert (y >= 0).all() and (y == 0).any()  # the ReLU cut something
    for got, want in ((nchw(y), ref), (nchw(dx), xd.grad), (dgamma, gd.grad), (dbeta, bd.grad), (nchw(dres), rd.grad)):
        err = ((got.double() - want.detach()).norm() / want.detach().norm()).item()
        assert err < 1e-5, err


@pytest.mark.parametrize("reductions", ["epilogue", "apart"])
@pytest.mark.parametrize("kind,stride,inplanes", [("bottleneck", 2, 20), ("bottleneck", 1, 32), ("basic", 2, 20),
                                                  ("basic", 1, 32)])
def test_a_blocks_training_step_is_autograds(kind, stride, inplanes, reductions, monkeypatch):
    """A torchvision Bottleneck or BasicBlock in training mode (with a downsample, and without: the identity
    shortcut), forward and backward through the Triton kernels, against autograd in fp64: the output, the input's
    gradient and every parameter's; with the batch norms' reductions in the convolutions' epilogues, and apart
    (each way a shape's tuning may choose: tuning.choose)."""
    import copy

    from torchvision.models.resnet import BasicBlock, Bottleneck

    from kernels.triton import tuning
    from kernels.triton.train_block import Grad, block_backward, block_forward, main_path

    monkeypatch.setattr(tuning, "choose", lambda key, options, tune: reductions)

    torch.manual_seed(0)
    down = (torch.nn.Sequential(torch.nn.Conv2d(inplanes, 32, 1, stride, bias=False), torch.nn.BatchNorm2d(32))
            if stride != 1 or inplanes != 32 else None)
    block = (Bottleneck(inplanes, 8, stride, down) if kind == "bottleneck" else BasicBlock(inplanes, 32, stride,
                                                                                              down)).train()
    for m in block.modules():  # BN's own init (1, 0) would hide a swapped scale and shift
        if isinstance(m, torch.nn.BatchNorm2d):
            torch.nn.init.uniform_(m.weight, 0.5, 1.5)
            torch.nn.init.normal_(m.bias, 0, 0.5)
    x, dy = torch.randn(2, inplanes, 7, 7), torch.randn(2, 32, (7 - 1) // stride + 1, (7 - 1) // stride + 1)
    ref_block = copy.deepcopy(block).double()
    xd = x.double().requires_grad_()
    ref = ref_block(xd)
    ref.backward(dy.double())

    def nhwc(t):
        return t.permute(0, 2, 3, 1).contiguous()

    out, saved = block_forward(block, nhwc(x), tune=False)
    kept = [weakref.ref(s.conv_out) for s in saved]  # each batch norm's input: held by its Saved alone
    assert [s.out is None for s in saved] == [False] * len(main_path(block)) + [True] * bool(down)
    dx, grads = block_backward(block, saved, Grad(nhwc(dy)), tune=False)
    dx = dx.d
    assert saved == [None] * len(kept) and all(ref() is None for ref in kept)  # freed by the backward
    pairs = [(out.permute(0, 3, 1, 2), ref), (dx.permute(0, 3, 1, 2), xd.grad)]
    pairs += [(grads[p], q.grad) for p, q in zip(block.parameters(), ref_block.parameters())]
    assert len(grads) == len(list(block.parameters()))
    for got, want in pairs:
        err = ((got.double() - want.detach()).norm() / want.detach().norm()).item()
        assert err < 1e-5, err


def small_resnet(block_kind: str) -> torch.nn.Module:
    """torchvision's ResNet with one block per stage and narrow stages (8, 16, 16, 32 channels; bottlenecks 4x
    wider at their ends): every layer kind of ResNet-18/50 (stem, max-pool, identity and downsample blocks, the
    average pool, the classifier) at a size the interpreter steps through in seconds."""
    from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet

    block = BasicBlock if block_kind == "basic" else Bottleneck
    torch.manual_seed(0)
    model = ResNet(block, [1, 1, 1, 1], num_classes=10)
    model.conv1, model.bn1, model.inplanes = torch.nn.Conv2d(3, 8, 7, 2, 3, bias=False), torch.nn.BatchNorm2d(8), 8
    for i, (planes, stride) in enumerate(((8, 1), (16, 2), (16, 2), (32, 2)), start=1):
        setattr(model, f"layer{i}", model._make_layer(block, planes, 1, stride=stride))
    model.fc = torch.nn.Linear(32 * block.expansion, 10)
    for m in model.modules():  # away from BN's own init (1, 0), which would hide a swapped scale and shift
        if isinstance(m, torch.nn.BatchNorm2d):
            torch.nn.init.uniform_(m.weight, 0.5, 1.5)
            torch.nn.init.normal_(m.bias, 0, 0.5)
    return model.train()


def test_two_training_steps_are_eager_steps():
    """The triton rung's training step (its build_train: kernels/triton/train_resnet.py), twice (the second with
    momentum) from the same weights on the same batch, against core.train's eager step in fp64: each step's loss,
    every parameter tensor's update and every running statistic within 4x of eager's own fp32 step's error (or
    2e-5). Basic blocks: the bottleneck's composition is held to autograd block by block above, at a fifth of the
    time. A training mutant (a gradient hook, core/mutations.py) reaches the step as it reaches autograd's. The
    first step runs under the profiler with the census's layer scopes."""
    import contextlib
    import copy

    from core import train
    from core.cell import Cell, Store
    from core.mutations import TRAINING
    from tiers import get_tier

    model = small_resnet("basic")
    initial = {k: v.clone() for k, v in train.state_of(model).items()}
    ref, eager = copy.deepcopy(model).double(), copy.deepcopy(model)
    x, labels = torch.randn(4, 3, 32, 32), torch.tensor([1, 7, 3, 0])
    cell = Cell(tier="triton", model="resnet18", batch=4, res=32, device="cpu", task="train")
    ref_step, eager_step = (train.make_step(m, m, cell, num_classes=10, lr=0.02) for m in (ref, eager))
    rate = torch.tensor(0.02)  # a schedule's rate, as train-to-accuracy hands it over
    step = get_tier("triton").build_train(model, x, cell, Store(), lr=rate)
    for i in range(2):
        want = ref_step(x.double(), labels).item()
        with torch.profiler.profile() if i == 0 else contextlib.nullcontext() as prof, \
                step.layer_scopes() if i == 0 else contextlib.nullcontext():
            got = step.forward(x, labels).item()
        assert abs(got - want) <= max(4 * abs(eager_step(x, labels).item() - want), 1e-6 * want)
        if i == 0:  # state(): the live tensors
            first = {k: v.clone() for k, v in step.state().items()}
            # the census's layer groups: each part of the step in its module's range, the backward's twice over
            names = [e.name for e in prof.events()]
            assert {"layer:conv1+bn1+relu+maxpool", "layer:layer4.0", "layer:avgpool+fc", "layer:loss",
                    "layer:optimizer", "triton_step_backward"} <= set(names)
            assert names.count("layer:layer1.0") == names.count("layer:conv1+bn1+relu+maxpool") == 2
    ours, theirs, fp64 = step.state(), train.state_of(eager), train.state_of(ref)
    assert ours.keys() == fp64.keys()

    def err(state, name):  # parameters by their update, running statistics by their value
        start = initial[name].double() if name.startswith("param.") else 0
        want = fp64[name].double() - start
        return ((state[name].double() - start - want).norm() / want.norm()).item()

    worse = {name: (err(ours, name), err(theirs, name)) for name in fp64}
    assert all(mine <= max(4 * eager32, 2e-5) for mine, eager32 in worse.values()), worse
    assert step.stats["memory"]["saved_for_backward_bytes"] > 0

    mutated = small_resnet("basic")
    next(m for m in TRAINING if m.name == "weight-grads-x0.7").change(mutated)
    wrong = get_tier("triton").build_train(mutated, x, cell, Store(), lr=rate)
    wrong.forward(x, labels)
    gains = {name: train._gain(value - initial[name], first[name] - initial[name])
             for name, value in wrong.state().items() if name.startswith("param.")}
    assert abs(gains["param.layer2.0.conv1.weight"] - 0.7) < 0.01 and abs(gains["param.bn1.weight"] - 1) < 1e-3

    # the GPU build's warm step (where kernels compile and tune) leaves no trace: weights, running statistics and
    # momentum as they were, so that the next step is the first
    from kernels.triton.train_resnet import TritonTrainStep

    fresh = small_resnet("basic")
    before = {k: v.clone() for k, v in train.state_of(fresh).items()}
    warmed = TritonTrainStep(fresh, torch.float32, torch.tensor([0.02]), train.MOMENTUM, train.WEIGHT_DECAY)
    warmed.warm(x, labels)
    assert warmed.steps == 1 and not warmed.momentum_buffer.any()
    assert all(torch.equal(v, before[k]) for k, v in train.state_of(fresh).items())


def test_every_training_kernels_configuration_compiles_for_hopper():
    """The autotuner's configurations of the weight gradient (by taps, and with the taps in the tile), of the
    batch norm's reductions and affine pass, of the convolution with the step's epilogue statistics and of fp8
    inference's convolution and chained pair, and the finalize and slice-sum kernels, which the interpreter never
    compiles: each through Triton's compiler and ptxas for sm90 (tests/hopper_compile.py)."""
    from core.paths import REPO

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "tests.hopper_compile"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("ok conv2d_weight_grad_kernel") == 2 * len(WEIGHT_GRAD_CONFIGS) + 3  # + norm's
    assert proc.stdout.count("ok conv2d_nhwc_kernel") == len(CONV_CONFIGS) + 3 + 3 + 3  # + norm prologue's, fp8's
    assert proc.stdout.count("ok conv_pair_kernel") == 2
    assert (proc.stdout.count("ok _moments_kernel") == proc.stdout.count("ok _grad_sums_kernel")
            == proc.stdout.count("ok _channel_affine_kernel") == len(REDUCTION_CONFIGS))
    assert all(proc.stdout.count(f"ok {kernel}") == 1 for kernel in
               ("_moments_finalize_kernel", "_grad_finalize_kernel", "_sum_slices_kernel"))
    assert proc.stdout.count("ok _merge_slices_kernel") == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_training_steps_packing_on_the_device_gives_the_inference_packings_bits(dtype):
    """conv.pack_weights (a training step's, where the weights live) against pack_conv (host, fp64): one rounding
    either way, the same bits."""
    from kernels.triton.conv import pack_conv, pack_weights

    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(7, 5, 3, 3, generator=g), torch.randn(7, generator=g)
    for b in (None, bias):
        ours, host = pack_weights(weight, 2, 1, bias=b, dtype=dtype), pack_conv(weight, 2, 1, bias=b, dtype=dtype)
        assert torch.equal(ours.weight, host.weight) and torch.equal(ours.bias, host.bias)
        assert (ours.kh, ours.kw, ours.stride, ours.pad, ours.cout) == (host.kh, host.kw, host.stride, host.pad,
                                                                        host.cout)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_captured_training_step_replays_the_steps_bits(dtype):
    """--cuda-graph on (tiers/triton.py build_train, TritonTrainStep.capture): three replays of the captured step,
    from the same weights, give the uncaptured step's losses, parameters, momentum-driven updates and running
    statistics bit for bit: the warm-up steps before the capture leave no trace, and the first replay is a first
    step."""
    from core.cell import Cell, Store
    from core.model import build_model
    from tiers import get_tier

    x = torch.randn(8, 3, 64, 64, generator=torch.Generator().manual_seed(0)).cuda()
    runs = []
    for graph in (False, True):
        cell = Cell(tier="triton", model="resnet50", batch=8, res=64, dtype=dtype, device="cuda", task="train",
                    cuda_graph=graph, options=(("autotune", "off"),))
        step = get_tier("triton").build_train(build_model("resnet50").train(), x, cell, Store())
        losses = [step.forward(x).clone() for _ in range(3)]  # copied as the worker's parity steps copy them
        runs.append((torch.stack(losses), {k: v.clone() for k, v in step.state().items()}))
    (plain_losses, plain), (graph_losses, captured) = runs
    assert torch.equal(plain_losses, graph_losses)
    assert all(torch.equal(plain[k], captured[k]) for k in plain), [k for k in plain
                                                                     if not torch.equal(plain[k], captured[k])]



def test_the_training_micro_checks_each_pass_against_pytorchs_and_a_wrong_one_shows(monkeypatch):
    """`micro --tier triton --task train`'s rows (tiers/triton.py train_micro) under the interpreter, for a 1x1 at
    stride 1, a strided 3x3 and a 1x1 downsample at odd sizes: each pass of a convolution with its batch norm
    (forward, data and weight gradients, the batch norm's forward and backward, and the statistics' two ways: from
    the epilogues or apart) agrees with PyTorch's in fp32, and a pass made wrong (the weight gradient doubled; the
    data gradient's epilogue sums without the ReLU's gate; the norm prologue without its shift) shows in its own
    rows' errors. The stem has no data-gradient rows (the step computes none); strided layers no epilogue sums (the
    phases are not dx); a conv2 or conv3 has MLPerf's norm-conv both ways (its input a batch norm's ReLU)."""
    from core.layers import Layer
    from kernels.triton import conv, conv_backward
    from tiers.triton import train_micro

    layers = [Layer("layer1.0.conv1", (6, 8, 1, 1), 1, 0, (5, 5), "relu", 1),
              Layer("layer2.0.conv2", (12, 8, 3, 3), 2, 1, (9, 9), "relu", 1),
              Layer("layer2.0.downsample.0", (16, 8, 1, 1), 2, 0, (7, 7), "none", 1)]
    rows = train_micro(layers, 2, "fp32", "cpu", baselines=False, bench=lambda fn: 0.0)
    every = ("forward", "stats epi", "stats apart", "dgrad", "dgrad+bn epi", "dgrad+bn apart", "wgrad", "bn forward",
             "bn backward")
    strided = [p for p in every if not p.startswith("dgrad+bn")]
    norm_conv = ["norm apart", "norm prologue", "wgrad norm"]  # a conv2's input is a batch norm's ReLU: norm-conv
    assert [(r["layer"], r["pass"]) for r in rows] == [(layers[0].path, p) for p in every] + [
        (layers[1].path, p) for p in strided + norm_conv] + [(layers[2].path, p) for p in strided]
    assert all(r["rel_err"] < 1e-5 for r in rows), [(r["layer"], r["pass"], r["rel_err"]) for r in rows]
    stem = train_micro([Layer("conv1", (8, 3, 7, 7), 2, 3, (11, 11), "relu", 1)], 2, "fp32", "cpu", baselines=False,
                       bench=lambda fn: 0.0)
    assert [r["pass"] for r in stem] == ["forward", "stats epi", "stats apart", "wgrad", "bn forward", "bn backward"]

    right = conv_backward.conv2d_weight_grad
    monkeypatch.setattr(conv_backward, "conv2d_weight_grad", lambda *a, **k: 2 * right(*a, **k))
    rows = train_micro(layers[:2], 2, "fp32", "cpu", baselines=False, bench=lambda fn: 0.0)
    assert {r["pass"] for r in rows if r["rel_err"] > 0.5} == {"wgrad", "wgrad norm"}
    monkeypatch.undo()

    def ungated(dy, w, bn, **k):  # the gate read as all ones: dy's sums without the ReLU
        return conv.conv2d_stats(dy, w, bn=bn._replace(gate=torch.ones_like(bn.gate)), **k)

    monkeypatch.setattr(conv_backward, "conv2d_stats", ungated)
    rows = train_micro(layers[:1], 2, "fp32", "cpu", baselines=False, bench=lambda fn: 0.0)
    assert [r["pass"] for r in rows if r["rel_err"] > 1e-3] == ["dgrad+bn epi"]
    monkeypatch.undo()

    stats = conv.conv2d_stats

    def shift_dropped(x, p, norm=None, **k):  # the prologue's affine map without its shift
        return stats(x, p, norm=None if norm is None else norm * torch.tensor([[1.0], [0.0]]), **k)

    monkeypatch.setattr(conv, "conv2d_stats", shift_dropped)
    rows = train_micro(layers[1:2], 2, "fp32", "cpu", baselines=False, bench=lambda fn: 0.0)
    assert [r["pass"] for r in rows if r["rel_err"] > 1e-3] == ["norm prologue"]
