"""Rung `triton`: the ResNet computed by our own Triton kernels (kernels/triton/), convolutions included.

Build folds batch-norm into the weights, packs them for the implicit-GEMM kernel and runs one forward, which
compiles every kernel for this cell's shapes with its configuration from the tuning tables (the one shipped for
this GPU model unless `--retune`, and the run's own), autotuning the shapes they lack; the time spent
benchmarking configurations is this rung's JIT overhead, reported in build stats with where the configurations
came from. Option autotune=off runs one heuristic config per kernel instead (fast builds, for parity checks).
"""
from __future__ import annotations

import contextlib
import copy
import os
import time
from functools import partial
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from core import train
from core.cell import DTYPES, Built, Cell, Store, layout_name
from core.layers import SCOPE, distinct_layers, group_of
from core.model import num_classes
from core.parity import TOLERANCES
from core.recipes import calibration_amax, calibration_input
from core.placement import memory_format, set_math_mode, torch_dtype
from tiers.base import PythonTier

MODELS = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "wide_resnet50_2")


def triton_version() -> str:
    import triton  # optional: availability() says why it is missing

    return triton.__version__


def _precision(dtype: str) -> str:
    # tl.dot's input precision matters only for fp32 operands: strict "ieee" for fp32, TF32 tensor cores for tf32.
    # 16-bit and 8-bit operands take Triton's default ("tf32"), which runs them on the tensor cores as they are.
    return "ieee" if dtype == "fp32" else "tf32"


FP8_RECIPE = {"weights": "e4m3, one scale per output channel (batch-norm folded first)",
              "activations": "one calibrated scale per tensor; e4m3 in memory, between a block's convolutions and "
                             "between blocks (the residual path too, scaled back in the epilogue that adds it); bf16 "
                             "out of the stem, the downsamples and the last block, rounded to e4m3 in the dot that "
                             "reads them",
              "calibration": "each convolution input's amax over the calibration input (core/recipes.py: not the "
                             "parity input; train-to-accuracy: training images), in an eager strict fp32 forward",
              "sums": "e4m3 products summed by the tensor cores within a K step, into fp32 after each "
                      "(kernels/triton/conv.py dot_fp32)",
              "bf16 layers": "the stem and the classifier, as FP8 recipes keep the first and last layers"}


def calibrate(model: torch.nn.Module, example: torch.Tensor, store: Store) -> dict[str, float]:
    """The fp8 cell's calibration pass: each convolution's input amax over the images the run hands it
    (`store.calibration`: train-to-accuracy's training images), else over the calibration input of the example's
    shape, which is not the input parity is checked on (core/recipes.py)."""
    x = (load_file(str(store.calibration))["x"] if store.calibration else
         calibration_input(example.shape[0], example.shape[-1])).to(example.device)
    return calibration_amax(copy.deepcopy(model).to(example.device), x)


def untuned(stage: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """`stage` with any shape missing from the tuning tables run in its untuned configuration, not autotuned: the
    stage check's few images are shapes no table holds, and it judges what the kernels compute, not their speed."""
    from kernels.triton import tuning  # as in build

    def run(x: torch.Tensor) -> torch.Tensor:
        saved, tuning.NO_AUTOTUNE = tuning.NO_AUTOTUNE, True
        try:
            return stage(x)
        finally:
            tuning.NO_AUTOTUNE = saved
    return run



@contextlib.contextmanager
def _tuned(store: Store, tune: bool, example: torch.Tensor, warm: str) -> Iterator[dict]:
    """Around a build's warm `warm` (a forward, or a training step): with tuning on, the tuning tables read first
    into the launches' lookup (kernels/triton/tuning.py: the ones shipped for this GPU model, none under --retune,
    then the run's own); yields the build stats it fills on leaving, what tuning and compiling cost there; saves
    what was autotuned to the run's tuning file."""
    from kernels.triton import tuning  # as in build

    tuned_file = store.cache / "tuned.json" if store.cache else None
    tables = tuning.load_tables(store.tunings, tuned_file) if tune else []
    before, start, stats = dict(tuning.STATS), time.perf_counter(), {}
    yield stats
    if example.is_cuda:
        torch.cuda.synchronize()
    if tuned_file and tuning.TUNED:
        tuning.save_tuned(tuned_file, {"gpu": torch.cuda.get_device_name() if example.is_cuda else "cpu",
                                       "triton": triton_version()})
    stats.update({
        # the interpreter never autotunes
        "autotune": "interpreter" if tuning.INTERPRET else ("on" if tune else "off"),
        "interpreted": tuning.INTERPRET,  # the timings are the interpreter's (harness/run/record.py `interpreted`)
        "tuning_tables": tables,  # tuning tables read: shipped for this GPU model, and the run's own
        "table_hits": tuning.STATS["table_hits"] - before["table_hits"],  # launches configured from a table
        "autotune_s": round(tuning.STATS["seconds"] - before["seconds"], 3),
        "autotune_benchmarks": tuning.STATS["benchmarks"] - before["benchmarks"],  # 0 = nothing autotuned here
        f"warm_{warm}_s": round(time.perf_counter() - start, 3),  # JIT compilation + autotuning
        f"launches_per_{warm}": tuning.STATS["launches"] - before["launches"],  # in the warm pass
    })


class TritonTier(PythonTier):
    name = "triton"
    dtypes = DTYPES  # fp8 too
    hand_written = True
    cannot_train = None  # the step: kernels/triton/train_resnet.py
    train_dtypes = ("fp32", "bf16")  # bf16: activations, over fp32 master weights, as the other rungs' autocast
    # options of the inference forward only: the training step launches each kernel through Triton's own path
    inference_only = ("launch", "pdl", "pairs", "chain")
    summary = "hand-written Triton kernels: implicit-GEMM NHWC convolutions with fused BN/residual/ReLU, autotuned"
    models = MODELS
    cuda_graph = True
    cuda_graph_train = True  # the whole step captured after two warm-up steps, the state put back (train_resnet)
    # The options (their measurements: the README's option list and the checks it links):
    # launch: each kernel through Triton's own launch path (jit; the CPU's default), or a forward recorded once and
    # replayed through the compiled kernels' launchers, its buffers kept (plan: kernels/triton/plan.py).
    # pdl: every kernel a programmatic dependent launch, each convolution prefetching its weights into L2 before it
    # waits (kernels/triton/pdl.py; from Hopper on); the GPU's default outside strict fp32, where it was slower.
    # pairs: a bottleneck's 3x3 convolution and the 1x1 after it as one kernel, its output kept on the chip
    # (kernels/triton/pair.py): where it pays (auto), in every block without a downsample (on), or nowhere (off).
    # chain: a pair also runs the next block's conv1 on its output, which that conv1 then never reads back: where it
    # pays (auto), wherever it can (on), or nowhere (off).
    options = {"autotune": ("on", "off"), "launch": ("jit", "plan"), "pdl": ("off", "on"),
               "pairs": ("auto", "on", "off"), "chain": ("auto", "on", "off")}
    caches = ("triton",)
    warm_in_prepare = True  # compiles the kernels of the tables' configurations; never autotunes there
    batch_change = True
    has_micro = True
    has_micro_train = True

    def parity_recipe(self, cell: Cell) -> str | None:
        # a downsample is summed into its block's last convolution (fuse_shortcut), except in fp8
        return "folded" if cell.dtype == "fp8" else "folded-fused-shortcut"

    def option_default(self, key: str, cell: Cell) -> str | None:
        gpu = cell.device == "cuda"
        if cell.task == "train" and key in ("launch", "pdl"):
            return self.options[key][0]
        if key == "launch":  # the interpreter (the CPU) compiles nothing to replay
            return "plan" if gpu else "jit"
        if key == "pdl":  # nor has it dependent launches; strict fp32 measured slower with them (batch 32: 9%)
            return "on" if gpu and cell.dtype != "fp32" else "off"
        return super().option_default(key, cell)

    def availability(self, device: str) -> str | None:
        if device == "cpu":
            return None if os.environ.get("TRITON_INTERPRET") == "1" else "Triton needs a GPU or TRITON_INTERPRET=1"
        try:
            import triton  # noqa: F401  (optional: availability() says why)
        except ImportError as e:
            return f"triton is not importable: {e}"
        return None

    # Option values the interpreter (the CPU) cannot run, and why.
    gpu_only = {("launch", "plan"): "replays compiled kernels, which the interpreter (the CPU) does not make",
                ("pdl", "on"): "is a GPU's programmatic dependent launch, which the interpreter (the CPU) does not "
                               "have"}

    def supports(self, cell: Cell) -> str | None:
        if cell.task == "train":
            if cell.dtype not in self.train_dtypes:
                return f"the Triton training step runs {' and '.join(self.train_dtypes)}, not {cell.dtype}"
            if given := [k for k in self.inference_only if cell.option(k, None) is not None]:
                return f"{', '.join(given)}: options of the inference forward; the training step has none of them"
        if cell.device != "cuda":
            for (key, value), why in self.gpu_only.items():
                if self.setting(cell, key) == value:
                    return f"{key}={value} {why}"
        return super().supports(cell)

    def build(self, model, example, cell: Cell, store: Store) -> Built:
        # Triton itself: imported only where it runs (availability says why not)
        from kernels.triton.resnet import TritonResNet

        tune = self.setting(cell, "autotune") == "on"
        fp8 = calibrate(model, example, store) if cell.dtype == "fp8" else None
        # Programmatic dependent launch exists from Hopper (compute capability 9.0) on; before it, pdl=on runs off.
        pdl = self.setting(cell, "pdl") == "on" and torch.cuda.get_device_capability(example.device)[0] >= 9
        net = TritonResNet(model, torch_dtype(cell.dtype), example.device, _precision(cell.dtype), tune, fp8,
                           planned=self.setting(cell, "launch") == "plan", pdl=pdl, pairs=self.setting(cell, "pairs"),
                           chains=self.setting(cell, "chain"))
        with torch.no_grad(), _tuned(store, tune, example, "forward") as stats:
            net(example)  # compiles every kernel variant; configurations from the tables, else autotuned
        stats.update({
            "launch": "plan" if net.planned else "jit",  # Triton's launch path, or a recorded forward replayed
            "pdl": "on" if pdl else "off",  # programmatic dependent launches, as run
            "pairs": self.setting(cell, "pairs"),  # as set; launches_per_forward counts the kernels that ran
            "chain": self.setting(cell, "chain"),
            **({"fp8": FP8_RECIPE} if fp8 else {}),
        })
        return Built(forward=net, stats=stats, layer_scopes=lambda: net.layer_scopes(SCOPE),
                     stages=lambda: [(name, untuned(stage)) for name, stage in net.stages(torch_dtype(cell.dtype))])

    def build_train(self, model, example, cell: Cell, store: Store, lr=None) -> Built:
        """core/train.py's step in Triton kernels (kernels/triton/train_resnet.py): in fp32 strict, in bf16 with
        bf16 activations over fp32 master weights."""
        from kernels.triton.train_resnet import TritonTrainStep  # Triton itself: imported only where it runs

        net = train.place_for_training(model, cell)
        rate = torch.tensor([train.LEARNING_RATE if lr is None else float(lr)], device=cell.device)
        tune = self.setting(cell, "autotune") == "on"
        step = TritonTrainStep(net, torch_dtype(cell.dtype), rate, train.MOMENTUM, train.WEIGHT_DECAY, tune=tune)
        targets = train.labels(cell.batch + 1, num_classes(net), cell.device)
        labels = targets[: example.shape[0]]

        def set_rate() -> None:
            if torch.is_tensor(lr):  # a schedule's rate, set in place before each step (train-to-accuracy)
                rate.copy_(lr.reshape(1), non_blocking=True)

        # On the GPU every kernel is compiled and tuned here, in warm steps whose updates are undone (the
        # interpreter compiles and tunes nothing: its first step is its own).
        with _tuned(store, tune, example, "step") as stats:
            if cell.cuda_graph:  # the whole step one graph, over the example's buffer (which the worker passes)
                graph, loss = step.capture(example, labels)
            elif example.is_cuda:
                step.warm(example, labels)
        if step.steps:  # what the forward saves is known from the first step on
            stats["memory"] = step.memory()
        if cell.cuda_graph:
            def replay(x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
                set_rate()
                if x is not example:
                    example.copy_(x)
                if y is not None:
                    labels.copy_(y)
                graph.replay()
                return loss

            return Built(forward=replay, state=lambda: train.state_of(net), captured=True,
                         stats={**stats, "cuda_graph": True})

        def forward(x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
            set_rate()
            loss = step(x, targets[: x.shape[0]] if y is None else y)
            if "memory" not in stats:  # the interpreter's: no warm step at build
                stats["memory"] = step.memory()
            return loss

        return Built(forward=forward, state=lambda: train.state_of(net), stats=stats,
                     layer_scopes=lambda: step.layer_scopes(SCOPE))

    def micro(self, batch: int, res: int, dtype: str, channels_last: bool, task: str = "infer",
              baselines: bool = True) -> list[dict]:
        """Every distinct ResNet-50 layer at this batch/res (core.layers.distinct_layers) with its own epilogue
        (ReLU; the residual added first for a block's last convolution; nothing after a downsample; the stem with its
        max-pool, which our kernel fuses): our Triton kernel (NHWC, autotuned, the epilogue fused) vs cuDNN through
        F.conv2d (convolution + bias only: its epilogue would be other kernels) vs Inductor (torch.compile, default
        mode, of the whole layer), each the median of triton.testing.do_bench; our kernel's output checked against
        the layer in fp32 (TF32 off) with
        the dtype's tolerance (LayerCase). In fp8 our kernel is the e4m3 one the fp8 cell runs (the stem stays
        bf16, as there); cuDNN and Inductor, which have no fp8 convolution here, run bf16, and so does
        `triton_bf16`, our bf16 kernel of the same layer: what e4m3 gains or loses on each layer. Without
        `baselines`, our kernel alone. train: each pass of the training step per distinct layer (`train_micro`)."""
        from triton.testing import do_bench, do_bench_cudagraph  # Triton: only where it runs

        if task == "train":  # the step runs captured: each pass's kernels replayed, not its launches' host time
            return train_micro(distinct_layers("resnet50", res), batch, dtype, "cuda", baselines,
                               partial(do_bench_cudagraph, return_mode="median"))
        rows = []
        for layer in distinct_layers("resnet50", res):
            case = LayerCase(layer, batch, dtype, channels_last, "cuda")
            flop = layer.flops(batch)
            row = {"layer": layer.path, "shape": layer.shape, "count": layer.count, "batch": batch, "dtype": dtype,
                   "layout": layout_name(channels_last), "gflop": round(flop / 1e9, 3), "kernel": case.kernel,
                   "parity": case.parity}
            timed = [("triton", case.ours)]
            if baselines:
                torch._dynamo.reset()  # a fresh compile per layer (no recompile limit, no dynamic shapes)
                inductor = torch.compile(case.whole)
                timed += [("cudnn", lambda: F.conv2d(case.x, case.weight, case.bias, layer.stride, layer.pad)),
                          ("inductor", lambda: inductor(case.x, case.weight, case.bias, case.residual))]
                if dtype == "fp8":
                    timed.append(("triton_bf16", partial(case.run, case.nhwc, case.packed_bf16)))
            for name, fn in timed:
                fn()  # autotune / compile outside the timing
                ms = do_bench(fn, return_mode="median")
                row[f"{name}_ms"] = round(ms, 4)
                row[f"{name}_tflops"] = round(flop / ms / 1e9, 1)
            rows.append(row)
        return rows


def train_micro(layers, batch: int, dtype: str, device: str, baselines: bool, bench: Callable) -> list[dict]:
    """Each pass of the training step, per distinct convolution with its batch norm (the step's schedule,
    kernels/triton/train_block.py): the convolution's forward, data gradient and weight gradient, the batch norm's
    forward and backward. Ours (NHWC, tuned) beside cuDNN's through PyTorch (the same call Inductor makes for a
    convolution: aten.convolution and its backward) and, for the batch norm, PyTorch's kernel and Inductor's
    (torch.compile of the same op). `bench(fn)` -> ms. Each of our passes' relative error against PyTorch's in the
    row (fp32 norms), so that a fast wrong kernel shows. The stem's data gradient is left out: the step computes no
    gradient for the images. Weights are packed before the timing, as cuDNN's are laid out before it.
    The step takes each batch norm's reductions from a convolution's epilogue (conv.conv2d_stats), so two pairs of
    rows, ours alone, time that choice against its alternative: "stats epi" (the forward with the moments in its
    epilogue, then their merge into the statistics) against "stats apart" (the plain forward, then the moments
    kernel and the merge); at stride 1, "dgrad+bn epi" (the data gradient with the sums of the batch norm that
    produced x in its epilogue, then that batch norm's backward) against "dgrad+bn apart" (the sums kernel
    instead): the two ways the step's tuning times per shape (train_block.conv_mean, data_grad_bn_backward). "bn
    forward" starts from the epilogue's moments. Where a convolution's input is a batch norm's ReLU with no residual
    (each block's conv2 and conv3), MLPerf's norm-conv, not yet in the step: "norm prologue" (the forward with its
    moments, reading the batch norm's input and applying its affine map and ReLU on the load) against "norm apart"
    (that batch norm's apply pass, then the same forward), and "wgrad norm" (the weight gradient recomputing that
    activation the same way) against "wgrad"."""
    from kernels.triton import batch_norm  # Triton: only where it runs
    from kernels.triton.conv import BatchNormSaved, conv2d, conv2d_stats, pack_weights
    from kernels.triton.conv_backward import conv2d_input_grad, conv2d_weight_grad
    from kernels.triton.train_block import conv_mean, data_grad_bn_backward

    tdt, g = torch_dtype(dtype), torch.Generator(device=device).manual_seed(0)
    rows = []
    for layer in layers:
        cout, cin, k, _ = layer.weight
        (h, w), (oh, ow) = layer.size, layer.output_size()
        stride, pad = layer.stride, layer.pad
        x = torch.randn(batch, h, w, cin, device=device, generator=g).to(tdt)
        dy = torch.randn(batch, oh, ow, cout, device=device, generator=g).to(tdt)
        weight = torch.randn(cout, cin, k, k, device=device, generator=g) / (cin * k * k) ** 0.5
        gamma = torch.rand(cout, device=device, generator=g) + 0.5
        beta = torch.randn(cout, device=device, generator=g)
        x_t, dy_t = x.permute(0, 3, 1, 2), dy.permute(0, 3, 1, 2)  # NCHW views of the channels-last tensors
        w_t = weight.to(tdt).contiguous(memory_format=torch.channels_last)
        # x taken as the ReLU'd output of a batch norm (unit gamma, zero beta) over `before`: the batch norm whose
        # gradient sums the data gradient's epilogue takes on
        before = torch.randn(x.shape, device=device, generator=g).to(tdt)
        unit = torch.ones(cin, device=device)
        before_stats = batch_norm.statistics(before, True, unit, torch.zeros_like(unit), 1e-5)
        saved = BatchNormSaved(before, x, before_stats.mean, before_stats.invstd)

        def torch_conv_grad(mask):
            return torch.ops.aten.convolution_backward(dy_t, x_t, w_t, None, [stride] * 2, [pad] * 2, [1, 1], False,
                                                       [0, 0], 1, mask)

        packed = pack_weights(weight, stride, pad, dtype=tdt)
        c, moments = conv2d_stats(x, packed)  # the batch norm's input and its partial moments
        c_t = c.permute(0, 3, 1, 2)
        _, mean, invstd = batch_norm.forward(c, gamma, beta, moments=moments)

        def dgrad_bn_backward(in_epilogue: bool):  # the stride-1 layers' (the others have no such rows)
            return data_grad_bn_backward(dy, weight, pad, (h, w), saved, unit, None, True, in_epilogue)

        def torch_dgrad_bn_backward():
            dx = torch_conv_grad([True, False, False])[0] * (x_t > 0)
            return torch.ops.aten.native_batch_norm_backward(dx, before.permute(0, 3, 1, 2), unit, None, None,
                                                             saved.mean, saved.invstd, True, 1e-5,
                                                             [True, False, False])[0]

        def nchw(o, t):
            return o.permute(0, 3, 1, 2), t

        # name: (ours, PyTorch's, what ours returns against what PyTorch's does, who is timed beside ours)
        passes = {
            "forward": (lambda: conv2d(x, packed, relu=False), lambda: F.conv2d(x_t, w_t, None, stride, pad), nchw,
                        "cudnn"),
            "stats epi": (lambda: conv_mean(x, packed, True, True), lambda: F.conv2d(x_t, w_t, None, stride, pad),
                          nchw, None),
            "stats apart": (lambda: conv_mean(x, packed, True, False),
                            lambda: F.conv2d(x_t, w_t, None, stride, pad), nchw, None),
            "dgrad": (lambda: conv2d_input_grad(dy, weight, stride, pad, (h, w)),
                      lambda: torch_conv_grad([True, False, False])[0], nchw, "cudnn"),
            "dgrad+bn epi": (lambda: dgrad_bn_backward(True), torch_dgrad_bn_backward, nchw, None),
            "dgrad+bn apart": (lambda: dgrad_bn_backward(False), torch_dgrad_bn_backward, nchw, None),
            "wgrad": (lambda: conv2d_weight_grad(x, dy, k, k, stride, pad),
                      lambda: torch_conv_grad([False, True, False])[1], lambda o, t: (o, t), "cudnn"),
            "bn forward": (lambda: batch_norm.forward(c, gamma, beta, moments=moments)[0],
                           lambda: F.batch_norm(c_t, None, None, gamma, beta, training=True), nchw, "torch"),
            "bn backward": (lambda: batch_norm.backward(dy, c, mean, invstd, gamma)[0],
                            lambda: torch.ops.aten.native_batch_norm_backward(
                                dy_t, c_t, gamma, None, None, mean, invstd, True, 1e-5, [True, True, True])[0],
                            nchw, "torch"),
        }
        if layer.path.endswith((".conv2", ".conv3")):  # its input a batch norm's ReLU, no residual added before
            norm = torch.stack([before_stats.scale, before_stats.shift])
            normalised = torch.relu(before.float() * before_stats.scale + before_stats.shift).to(tdt)

            def norm_reference():
                return F.conv2d(normalised.permute(0, 3, 1, 2), w_t, None, stride, pad)

            passes["norm apart"] = (lambda: conv2d_stats(batch_norm.apply(before, before_stats, relu=True), packed)[0],
                                    norm_reference, nchw, None)
            passes["norm prologue"] = (lambda: conv2d_stats(before, packed, norm=norm)[0], norm_reference, nchw, None)
            passes["wgrad norm"] = (  # the weight gradient recomputing the activation the forward did not store
                lambda: conv2d_weight_grad(before, dy, k, k, stride, pad, norm=norm),
                lambda: torch.ops.aten.convolution_backward(dy_t, normalised.permute(0, 3, 1, 2), w_t, None,
                                                            [stride] * 2, [pad] * 2, [1, 1], False, [0, 0], 1,
                                                            [False, True, False])[1], lambda o, t: (o, t), None)
        if group_of(layer.path) == "stem":  # no image gradient
            for name in ("dgrad", "dgrad+bn epi", "dgrad+bn apart"):
                del passes[name]
        elif stride > 1:  # the step assembles a strided data gradient from phases, none of which is dx
            del passes["dgrad+bn epi"], passes["dgrad+bn apart"]
        for name, (ours, theirs, pair, baseline) in passes.items():
            got, want = pair(ours(), theirs())
            row = {"layer": layer.path, "pass": name, "shape": layer.shape, "count": layer.count, "batch": batch,
                   "dtype": dtype, "rel_err": float((got.float() - want.float()).norm() / want.float().norm()),
                   "alternative": baseline is None}  # a way of running passes that other rows also time
            timed = [("triton", ours)]
            if baselines and baseline:
                timed.append((baseline, theirs))
                if baseline == "torch":
                    torch._dynamo.reset()
                    timed.append(("inductor", torch.compile(theirs)))
            for who, fn in timed:
                fn()  # autotune / compile outside the timing
                ms = row[f"{who}_ms"] = round(bench(fn), 4)
                if baseline == "cudnn":
                    row[f"{who}_tflops"] = round(layer.flops(batch) / ms / 1e9, 1) if ms else None
            rows.append(row)
    return rows


class LayerCase:
    """One distinct layer of the network as the micro times it: random inputs (NCHW view in the cell's layout,
    and the NHWC copy our kernel reads), the layer as the network runs it (`whole`), our packed kernel (`ours`),
    and its parity against `whole` in fp32 (`check`). The stem (conv1) is run with its max-pool, as the network
    runs it (kernels/triton/stem.py): its `whole` pools too. `activations`: their torch type, by default the
    dtype's (the interpreter, which has no bf16 arithmetic, takes fp32)."""

    def __init__(self, layer, batch: int, dtype: str, channels_last: bool, device: str,
                 activations: torch.dtype | None = None) -> None:
        from kernels.triton.conv import E4M3_MAX, conv2d, pack_conv  # Triton: only where it runs
        from kernels.triton.resnet import block_conv_index  # as above
        from kernels.triton.stem import pack_stem, stem, stem_fuses  # as above

        tdt, precision = activations or torch_dtype(dtype), _precision(dtype)
        fmt = memory_format(channels_last)
        cout, cin, k, _ = layer.weight
        (h, w), (ho, wo) = layer.size, layer.output_size()
        self.layer, self.relu, self.pooled = layer, layer.epilogue != "none", layer.path == "conv1"
        adds = "add" in layer.epilogue
        self.x = torch.randn(batch, cin, h, w, device=device, dtype=tdt).to(memory_format=fmt)
        self.weight = (torch.randn(cout, cin, k, k, device=device) * (2 / (cin * k * k)) ** 0.5).to(tdt).to(
            memory_format=fmt)
        self.bias = torch.randn(cout, device=device, dtype=tdt)
        self.residual = (torch.randn(batch, cout, ho, wo, device=device, dtype=tdt).to(memory_format=fmt)
                         if adds else None)
        self.nhwc = self.x.permute(0, 2, 3, 1).contiguous()  # our kernel's layout (in the rung it stays NHWC)
        self.residual_nhwc = self.residual.permute(0, 2, 3, 1).contiguous() if adds else None
        self.dtype = dtype
        set_math_mode("fp32")
        self.reference = self.whole(self.x.float(), self.weight.float(), self.bias.float(),
                                    self.residual.float() if adds else None)
        pack = partial(pack_stem if self.pooled else pack_conv, self.weight, layer.stride, layer.pad, bias=self.bias,
                       dtype=tdt, device=device,  # the stem packed as the network packs it
                       **({"fused": stem_fuses(tdt, precision)} if self.pooled else {}))
        # The fp8 cell's packing: e4m3 with the input's amax as its calibration, except the stem (bf16 there); as
        # there, a block's convolutions store their output in e4m3 (the downsample in the activations' type), and
        # every one reads e4m3 but the first block's conv1 and downsample, whose input is the stem's output.
        fp8 = dtype == "fp8" and not self.pooled
        tf32 = tdt == torch.float32 and precision == "tf32"  # as the network packs it (kernels/triton/resnet.py)
        index = block_conv_index(layer.path) if fp8 else 0
        reads_e4m3 = fp8 and not (layer.path.startswith("layer1.0.") and index < 2)
        amax = self.x.abs().max().item()
        self.packed = pack(input_amax=amax, output_amax=self.reference.abs().max().item() if index else None
                           ) if fp8 else pack(kmajor=tf32, tf32=tf32)
        ours_input = (self.nhwc.float() * (E4M3_MAX / amax)).to(torch.float8_e4m3fn) if reads_e4m3 else self.nhwc
        self.packed_bf16 = pack() if dtype == "fp8" else None
        self.kernel = "e4m3" if fp8 else str(tdt).removeprefix("torch.")
        self.run = (partial(stem, precision=precision) if self.pooled else
                    partial(conv2d, residual=self.residual_nhwc, relu=self.relu, precision=precision))
        self.ours = partial(self.run, ours_input, self.packed)
        self.parity = self.check()

    def check(self) -> dict:
        """Our kernel's output (scaled back from e4m3 where stored so) against the layer in fp32 (TF32 off), with
        the dtype's tolerance; leaves the dtype's math mode set."""
        set_math_mode(self.dtype)
        out = self.ours().permute(0, 3, 1, 2).float()
        if not self.pooled and self.packed.output_inv is not None:  # (the stem writes the activations' type)
            out = out / self.packed.output_inv
        ref = self.reference
        rel = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
        return {"ok": rel <= TOLERANCES[self.dtype]["rel_err"], "rel_err": rel,
                "reference": "the layer in fp32 (F.conv2d, its epilogue), TF32 off"}

    def whole(self, t, wt, b, r):
        """The layer as the network runs it: convolution, the residual, ReLU; the stem's max-pool."""
        y = F.conv2d(t, wt, b, self.layer.stride, self.layer.pad)
        y = y + r if r is not None else y
        y = F.relu(y) if self.relu else y
        return F.max_pool2d(y, 3, 2, 1) if self.pooled else y


TIER = TritonTier()
