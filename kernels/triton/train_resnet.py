"""One training step of a torchvision ResNet in Triton kernels (issue 60): core/train.py's step (batch norm on the
batch's statistics with the running ones updated, cross-entropy, backward, SGD with momentum and weight decay),
every convolution, normalisation, pool, loss and update a kernel of kernels/triton.

Memory plan (what lives across the step, counted in `memory()`):
- fp32 master weights, their gradients and the momentum: three flat buffers, every parameter a view of its slice,
  so that one SGD launch updates the network (kernels/triton/sgd.py);
- for the backward, per convolution + batch norm (train_block.Saved): the convolution's input (the previous
  output: one tensor, counted once), the batch norm's input, its output where a ReLU reads its sign as the mask
  (not a downsample's) and its moments; the max-pool's positions (int8); the pooled features. The backward drops
  each block's once it has run through it (train_block.block_backward), so the step's peak is where the backward
  starts, as autograd's is.

Each gradient is written by its kernel into its slice of the flat buffer (copied there only where a gradient hook
changed it), and the running statistics are updated by the batch norm's finalize kernel. Still done by torch around
the kernels: packing each convolution's weights for the implicit GEMM every step (a permute and, in bf16, a cast,
on the device: conv.pack_weights), the NHWC copy of an NCHW input, and the classifier's bias gradient.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from kernels.triton import batch_norm
from kernels.triton.conv import conv2d, pack_weights
from kernels.triton.conv_backward import conv2d_input_grad, conv2d_weight_grad
from kernels.triton.cross_entropy import cross_entropy
from kernels.triton.pool import global_avg_pool
from kernels.triton.pool_backward import global_avg_pool_backward, max_pool_backward, max_pool_forward
from kernels.triton.sgd import sgd_step
from kernels.triton.train_block import (Grad, Saved, block_backward, block_forward, conv_bn, conv_bn_backward,
                                        output_saved)


STEM_PATH, HEAD_PATH = "conv1+bn1+relu+maxpool", "avgpool+fc"  # their modules, as the census names a fused kernel


class TritonTrainStep:
    """step(x, labels) -> the batch's loss (a 0-d fp32 tensor, not synchronised), the model's parameters and
    running statistics updated in place. `model`: a torchvision ResNet in train mode with fp32 parameters on the
    step's device; `dtype`: the activations' type (fp32, or bf16 over the fp32 master weights); `lr`: a one-element
    fp32 tensor on the device, read by the update kernel every step."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, lr: torch.Tensor, momentum: float,
                 weight_decay: float, tune: bool = True) -> None:
        self.model, self.dtype, self.lr, self.tune = model, dtype, lr, tune
        self.momentum, self.weight_decay = momentum, weight_decay
        params = list(model.parameters())
        device = params[0].device
        total = sum(p.numel() for p in params)
        self.weights = torch.empty(total, device=device, dtype=torch.float32)
        self.grads = torch.zeros_like(self.weights)
        self.momentum_buffer = torch.zeros_like(self.weights)
        self.grad_of: dict[torch.nn.Parameter, torch.Tensor] = {}
        at = 0
        for p in params:  # each parameter becomes a view of its slice
            n = p.numel()
            self.weights[at:at + n].copy_(p.detach().flatten())
            p.data = self.weights[at:at + n].view_as(p)
            self.grad_of[p] = self.grads[at:at + n].view_as(p)
            at += n
        self.blocks = [(f"{name}.{i}", block) for name in ("layer1", "layer2", "layer3", "layer4")
                       for i, block in enumerate(getattr(model, name))]
        self.scoped: str | None = None  # layer_scopes' prefix: profiler ranges for the census
        self.steps = 0
        self.saved_bytes = 0

    def __call__(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        m, tune, scope = self.model, self.tune, self._scope
        with scope(STEM_PATH):
            x = x.permute(0, 2, 3, 1).to(self.dtype).contiguous()  # NHWC: a view of a channels_last fp32 input
            h, stem = conv_bn(x, m.conv1, m.bn1, tune)
            h, positions = max_pool_forward(h)
        saved_blocks = []
        for path, block in self.blocks:
            with scope(path):
                h, saved = block_forward(block, h, tune)
            saved_blocks.append(saved)
        with scope(HEAD_PATH):
            features = global_avg_pool(h, tune=tune)  # [N, C]
            fc = pack_weights(m.fc.weight[:, :, None, None], bias=m.fc.bias, dtype=self.dtype)
            n, c = features.shape
            logits = conv2d(features.view(n, 1, 1, c), fc, relu=False, tune=tune).view(n, -1)
        with scope("loss"):
            loss, dlogits = cross_entropy(logits, labels)
        if not self.steps:
            self.saved_bytes = _bytes([positions, features, stem, *(s for saved in saved_blocks for s in saved)])

        grads: dict = {}
        with self._range("triton_step_backward"):
            with scope(HEAD_PATH):
                dlogits4 = dlogits.view(n, 1, 1, -1)
                grads[m.fc.weight] = self.grad_of[m.fc.weight]
                conv2d_weight_grad(features.view(n, 1, 1, c), dlogits4, 1, 1, 1, 0, tune=tune,
                                   out=grads[m.fc.weight][:, :, None, None])
                grads[m.fc.bias] = batch_norm.channel_sum(dlogits, tune)
                dfeatures = conv2d_input_grad(dlogits4, m.fc.weight.detach()[:, :, None, None], 1, 0, (1, 1),
                                              tune=tune)
                dh = Grad(global_avg_pool_backward(dfeatures.view(n, c), h.shape[1:3]))
            for i in reversed(range(len(self.blocks))):
                (path, block), saved = self.blocks[i], saved_blocks.pop()
                # the block before's last batch norm reads this block's input gradient (layer1.0's: the max-pool)
                consumer = output_saved(self.blocks[i - 1][1], saved_blocks[-1]) if saved_blocks else None
                with scope(path):  # the block's saved tensors leave the list here, and go as block_backward runs
                    dh, block_grads = block_backward(block, saved, dh, tune, into=self.grad_of, consumer=consumer)
                grads.update(block_grads)
            with scope(STEM_PATH):
                dstem = max_pool_backward(dh.d, positions, stem.out.shape[1:3])
                conv_bn_backward(Grad(dstem), stem, tune, grads, input_grad=False, into=self.grad_of)

        with scope("optimizer"):
            for p, g in grads.items():
                for hook in (p._backward_hooks or {}).values():  # its gradient hooks, as autograd runs them (the
                    changed = hook(g)                               # training mutants: core/mutations.py)
                    g = g if changed is None else changed
                if g is not self.grad_of[p]:  # not written in place by its kernel, or a hook made a new one
                    self.grad_of[p].copy_(g)
            sgd_step(self.weights, self.grads, self.momentum_buffer, self.lr, self.momentum, self.weight_decay)
        self.steps += 1
        return loss

    @contextlib.contextmanager
    def layer_scopes(self, prefix: str) -> Iterator[None]:
        """While it lasts, each part of the step runs inside a profiler range named `prefix` + the module path it
        computes ('layer1.0'; the stem's and the head's modules joined by '+'; 'loss', 'optimizer'), the
        backward's inside a range whose name ends in '_backward': the census's layer groups and phases."""
        self.scoped = prefix
        try:
            yield
        finally:
            self.scoped = None

    def _range(self, name: str):
        return torch.profiler.record_function(name) if self.scoped else contextlib.nullcontext()

    def _scope(self, path: str):
        return self._range(f"{self.scoped}{path}")

    def warm(self, x: torch.Tensor, labels: torch.Tensor, steps: int = 1) -> None:
        """`steps` steps on `x` and `labels` that compile (and, with tuning, tune) every kernel of the step; then
        the weights, momentum and running statistics are put back as they were, so that the next step is the
        first."""
        live = (self.weights, self.momentum_buffer, *self.model.buffers())
        state = [t.clone() for t in live]
        for _ in range(steps):
            self(x, labels)
        for tensor, saved in zip(live, state):
            tensor.copy_(saved)

    def capture(self, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The step on `x` and `labels` as a CUDA graph, and the loss tensor each replay writes: two warm steps on a
        side stream first (every shape compiled, the caches filled, as capture requires), then the capture, which
        runs nothing: the first replay is the first step. Replays read `x` and `labels` (copy new batches into
        them) and the rate tensor."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.warm(x, labels, steps=2)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            loss = self(x, labels)
        return graph, loss

    def memory(self) -> dict[str, int]:
        """Bytes of what the step keeps: weights, gradients, momentum, and (after the first step) what the forward
        saves for the backward."""
        flat = self.weights.numel() * self.weights.element_size()
        return {"weights_bytes": flat, "gradient_bytes": flat, "optimizer_state_bytes": flat,
                "saved_for_backward_bytes": self.saved_bytes}


def _bytes(saved: list) -> int:
    """The distinct tensors' bytes (a convolution's input is the output saved before it)."""
    tensors = {}
    for item in saved:
        for t in ((item.inp, item.conv_out, item.mean, item.invstd, item.out)
                  if isinstance(item, Saved) else (item,)):
            if t is not None:
                tensors[t.data_ptr()] = t.numel() * t.element_size()
    return sum(tensors.values())
