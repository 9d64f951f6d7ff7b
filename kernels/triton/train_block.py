"""A ResNet block's training forward and backward composed from the Triton kernels (issue 60): the step from
which the network's is built, block by block. The forward keeps what the backward reads (each convolution's input,
each batch norm's input, batch moments and output, whose sign is its ReLU's mask); the backward runs the block in
reverse, the shortcut's gradient added to the main path's at the block's input.

torchvision's Bottleneck (ResNet v1.5: the stride on the 3x3): out = relu(bn3(conv3(relu(bn2(conv2(relu(bn1(
conv1(x))))))) + shortcut(x)), shortcut = bn(conv1x1/stride(x)) where the block changes shape, else x.
BasicBlock: out = relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x)), the stride on conv1.
Convolutions without bias, as torchvision's. The two gradients at the block's input meet in conv1's data
gradient's epilogue (as the cuDNN rung does), not in a pass of their own. A batch norm's reductions can come from
the epilogues of the convolutions beside it: its forward's moments from the convolution that feeds it, its
backward's sums from the data gradient that produces its output's gradient (a stride-1 one: a strided data
gradient is assembled from phases). Whether they do is the tuning's choice per shape: an epilogue's reduction
slows its convolution, by more than the reduction's own pass costs at some shapes (docs/notes/triton-training.md).
The backward drops each convolution's saved tensors once it is done with them, as autograd frees saved variables,
so that memory falls through the backward instead of peaking at its end with every activation still held."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from kernels.triton import batch_norm, tuning
from kernels.triton.conv import BatchNormSaved, TileStats, conv2d, conv2d_stats, pack_weights
from kernels.triton.conv_backward import conv2d_input_grad_sums, conv2d_weight_grad


def _conv(x: torch.Tensor, weight: torch.Tensor, stride: int, pad: int,
          tune: bool) -> tuple[torch.Tensor, TileStats | None]:
    """The convolution, and its output's partial moments for the batch norm after it from its epilogue, or None
    (the batch norm's moments kernel reads the output), whichever the tuning chose for the shape."""
    packed = pack_weights(weight, stride, pad, dtype=x.dtype)
    key = _stats_key("moments", x.shape, weight.shape, x.dtype, weight.dtype, stride, pad)
    return conv_moments(x, packed, tune, _in_epilogue(key, functools.partial(conv_mean, x, packed, tune), tune))


def conv_moments(x: torch.Tensor, packed, tune: bool, in_epilogue: bool) -> tuple[torch.Tensor, TileStats | None]:
    """The convolution of `x` by `packed` (no ReLU), and its output's partial moments from its epilogue, or None."""
    if in_epilogue:
        return conv2d_stats(x, packed, tune=tune)
    return conv2d(x, packed, relu=False, tune=tune), None


def conv_mean(x: torch.Tensor, packed, tune: bool, in_epilogue: bool) -> torch.Tensor:
    """conv_moments, then its output's statistics (the mean alone: nothing else changes): one of the two ways the
    tuning times (and the training micro's "stats epi" / "stats apart" rows); the output."""
    y, partial = conv_moments(x, packed, tune, in_epilogue)
    batch_norm.statistics(y, tune, moments=partial)
    return y


def data_grad_bn_backward(dc: torch.Tensor, weight: torch.Tensor, pad: int, hw, summed: BatchNormSaved,
                          gamma: torch.Tensor, add: torch.Tensor | None, tune: bool,
                          in_epilogue: bool) -> torch.Tensor:
    """A stride-1 data gradient, then the backward of the batch norm (which saved `summed`; its weight `gamma`)
    whose output's gradient it is, that batch norm's sums from the data gradient's epilogue or from its sums
    kernel: one of the two ways the tuning times (and the training micro's "dgrad+bn" rows); that backward's dx."""
    dx, sums = conv2d_input_grad_sums(dc, weight, 1, pad, hw, summed if in_epilogue else None, tune=tune, add=add)
    return batch_norm.backward(dx, summed.x, summed.mean, summed.invstd, gamma, y=summed.gate, tune=tune,
                               sums=sums)[0]


@functools.cache
def _stats_key(kind: str, x_shape: torch.Size, weight_shape: torch.Size, x_dtype: torch.dtype,
               weight_dtype: torch.dtype, stride: int, pad: int) -> str:
    """The tuning tables' key for the choice of where a batch norm's `kind` of reduction runs beside the
    convolution of `weight_shape` that reads `x_shape`: in its epilogue or in a kernel of its own (tuning.choose).
    Cached: the step asks once per convolution and step."""
    cout, cin, kh, kw = weight_shape
    n, h, w, _ = x_shape
    dtypes = ",".join(str(t).removeprefix("torch.") for t in (x_dtype, weight_dtype))
    return f"stats_epilogue|{kind},{n},{h},{w},{cin},{cout},{kh},{kw},{stride},{pad}|{dtypes}"


@dataclass
class Saved:
    """What one convolution + batch norm of the forward leaves for the backward, and whose they are."""
    conv: torch.nn.Conv2d
    bn: torch.nn.BatchNorm2d
    relu: bool  # whether a ReLU followed the batch norm (its mask: the output's sign)
    inp: torch.Tensor  # the convolution's input
    conv_out: torch.Tensor  # the batch norm's input
    mean: torch.Tensor
    invstd: torch.Tensor
    out: torch.Tensor | None  # the output after the ReLU (its sign is the mask); None without a ReLU (a downsample's,
    #                           which only the block's add reads: not kept through the step)


def conv_bn(x, conv, bn, tune, residual=None, relu=True, deferred=False) -> tuple[torch.Tensor, Saved]:
    """relu(bn(conv(x)) [+ residual]) on the batch's statistics, and what its backward needs; the batch norm's
    running statistics updated, as PyTorch's forward in training mode does. `deferred` (no ReLU): the batch norm's
    map left for its reader to apply, returned as a batch_norm.Normalized instead of a tensor."""
    c, moments = _conv(x, conv.weight.detach(), conv.stride[0], conv.padding[0], tune)
    stats = batch_norm.statistics(c, tune, bn.weight.detach().float(), bn.bias.detach().float(), bn.eps,
                                  (bn.running_mean, bn.running_var, bn.num_batches_tracked), bn.momentum, moments)
    y = batch_norm.Normalized(c, stats.scale, stats.shift) if deferred else \
        batch_norm.apply(c, stats, residual, relu, tune)
    return y, Saved(conv, bn, relu, x, c, stats.mean, stats.invstd, y if relu else None)


def main_path(block) -> list[tuple]:
    """The residual branch's (convolution, batch norm) pairs in order: two in a BasicBlock, three in a
    Bottleneck."""
    return [(getattr(block, f"conv{i}"), getattr(block, f"bn{i}")) for i in (1, 2, 3) if hasattr(block, f"conv{i}")]


def output_saved(block, saved: list[Saved]) -> Saved:
    """Of a block's saved list (block_forward's), the batch norm whose (ReLU'd) output is the block's output."""
    return saved[len(main_path(block)) - 1]


def block_forward(block, x: torch.Tensor, tune: bool = True) -> tuple[torch.Tensor, list[Saved]]:
    """The block's output (NHWC, x's type) and what its backward needs (the main path's in order, then the
    downsample's); `block` a torchvision BasicBlock or Bottleneck."""
    # a downsample's batch norm is applied by the last one's pass, which adds it: its output is never written
    shortcut, down = conv_bn(x, *block.downsample, tune, relu=False, deferred=True) if block.downsample else (x, None)
    saved, h = [], x
    path = main_path(block)
    for i, (conv, bn) in enumerate(path):
        h, s = conv_bn(h, conv, bn, tune, residual=shortcut if i == len(path) - 1 else None)
        saved.append(s)
    return h, saved + ([down] if down else [])


class Grad(NamedTuple):
    """A gradient flowing back through the step (NHWC), and the partial sums the batch norm that reads it needs
    where its producer wrote them (conv_backward.conv2d_input_grad_sums), else None."""
    d: torch.Tensor
    sums: TileStats | None = None


def bn_saved(saved: Saved | None) -> BatchNormSaved | None:
    """What a data gradient's epilogue reads to sum its output for `saved`'s batch norm (which has a ReLU)."""
    return None if saved is None else BatchNormSaved(saved.conv_out, saved.out, saved.mean, saved.invstd)


def conv_bn_backward(dy: Grad, saved: Saved, tune, grads: dict, residual=False, input_grad=True, add=None,
                     into: dict | None = None, consumer: Saved | None = None):
    """Through one batch norm (and its ReLU) and convolution: fills `grads` by parameter, returns the gradient at
    the convolution's input (a Grad; None without `input_grad`), with `add` summed into it, and the residual's
    gradient, where asked, after it. `consumer`: the batch norm whose output that input is (its gradient's sums
    then come from the data gradient's epilogue). `into`: where each parameter's gradient is written (a view of the
    step's flat buffer), if anywhere."""
    conv, bn = saved.conv, saved.bn
    into = into or {}
    out = batch_norm.backward(dy.d, saved.conv_out, saved.mean, saved.invstd, bn.weight.detach().float(),
                              y=saved.out if saved.relu else None, residual=residual, tune=tune,
                              dgamma=into.get(bn.weight), dbeta=into.get(bn.bias), sums=dy.sums)
    dc, grads[bn.weight], grads[bn.bias] = out[:3]
    kh, kw = conv.kernel_size
    stride, pad = conv.stride[0], conv.padding[0]
    grads[conv.weight] = conv2d_weight_grad(saved.inp, dc, kh, kw, stride, pad, tune=tune,
                                            out=into.get(conv.weight))
    if not input_grad:
        return (None, out[3]) if residual else None
    weight, hw = conv.weight.detach(), saved.inp.shape[1:3]
    summed = bn_saved(consumer)
    if summed is not None and stride == 1 and not _sums_in_epilogue(dc, weight, pad, hw, summed, consumer, add, tune):
        summed = None
    dx = Grad(*conv2d_input_grad_sums(dc, weight, stride, pad, hw, summed, tune=tune, add=add))
    return (dx, out[3]) if residual else dx


def _sums_in_epilogue(dc, weight, pad, hw, summed: BatchNormSaved, consumer: Saved, add, tune) -> bool:
    """Whether the stride-1 data gradient of `weight` (its output: the gradient of `consumer`'s batch norm, which
    saved `summed`) also writes that batch norm's gradient sums, or its backward's sums kernel reads them: whichever
    the tuning chose for the shape (data_grad_bn_backward, timed both ways)."""
    gamma = consumer.bn.weight.detach().float()
    key = _stats_key("grad_sums", dc.shape, weight.shape, dc.dtype, weight.dtype, 1, pad)
    return _in_epilogue(key, functools.partial(data_grad_bn_backward, dc, weight, pad, hw, summed, gamma, add, tune),
                        tune)


def _in_epilogue(key: str, run: Callable[[bool], object], tune: bool) -> bool:
    """Whether the shape of `key` runs its batch norm's reduction in the convolution's epilogue: the tuning's choice
    between `run(True)` and `run(False)` (tuning.choose; untuned, the epilogue)."""
    return tuning.choose(key, {"epilogue": lambda: run(True), "apart": lambda: run(False)}, tune) == "epilogue"


def block_backward(block, saved: list[Saved], dy: Grad, tune: bool = True, into: dict | None = None,
                   consumer: Saved | None = None):
    """The gradient at the block's input (a Grad) and each parameter's (fp32, torch's layouts), by parameter,
    written into `into`'s tensors where it has one (conv_bn_backward). `consumer`: the batch norm whose output the
    block's input is (the block before's last), whose gradient's sums conv1's data gradient then writes. Each entry
    of `saved` is set to None once its backward is done: with the caller's reference gone, its tensors are freed
    then."""
    grads: dict = {}
    last = len(main_path(block)) - 1

    def through(i, d, **kw):
        out = conv_bn_backward(d, saved[i], tune, grads, into=into, **kw)
        saved[i] = None
        return out

    d, d_shortcut = through(last, dy, residual=True, consumer=saved[last - 1])
    if block.downsample:  # first, so that conv1's data gradient can add it in its epilogue
        d_shortcut = through(last + 1, Grad(d_shortcut)).d
    for i in reversed(range(last)):
        d = through(i, d, add=d_shortcut if i == 0 else None, consumer=saved[i - 1] if i else consumer)
    return d, grads
