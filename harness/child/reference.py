"""Small child jobs the runner needs besides the cells (each in its own process, like the cells):

- `ref`:  the eager fp32 reference (TF32 off) that every rung is compared against: the output of one forward, or
          for `train` the loss of each parity step and the state after them (core/train.py);
- `recipe`: a rung's recipe at its dtype (core/recipes.py), which cells below fp32 are also held to (and, where
            the cell judges_stages, its stages on the first images: core/parity.py);
- `jobs`: a JSON list of `ref` and `recipe` argument lists, in one process (one start of torch for all);
- `peak`: the GPU's measured dense matrix-multiply rate per dtype, the denominator of 'share of peak', and its
          measured memory bandwidth (a device-to-device copy), the other side of a layer's roofline."""
from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import save_file

from core import train
from core.cell import Cell, Store
from core.files import write_atomic, write_text_atomic
from core.model import load_model, read_tensor
from core.placement import set_math_mode, torch_dtype
from core.parity import judges_stages, pack_stages
from core.recipes import folded_recipe, recipe_output
from tiers import get_tier


def reference(model_name: str, weights: str, input_path: str, output: str, device: str, task: str = "infer") -> None:
    set_math_mode("fp32")
    model = load_model(model_name, weights).to(device)
    x = read_tensor(input_path, "input").to(device)
    if task == "train":  # the eager rung's step, in strict fp32 and NCHW
        cell = Cell(tier="eager", model=model_name, batch=x.shape[0], res=x.shape[-1], device=device, task=task)
        built = get_tier("eager").build_train(model.train(), x, cell, Store())
        losses = [built.forward(x) for _ in range(train.K_STEPS)]
        saved(train.output_tensors(losses, built.state()), output)
        return
    with torch.inference_mode():
        out = model(x)
    saved({"output": out.float().cpu().contiguous()}, output)


def recipe(model_name: str, weights: str, input_path: str, output: str, device: str, name: str, dtype: str,
           layout: str) -> None:
    model = load_model(model_name, weights).to(device)
    x = read_tensor(input_path, "input").to(device)
    if judges_stages(name, dtype):  # its stages too, the last of them its logits (core/parity.py STAGE_IMAGES)
        stages = folded_recipe(name, model, x, dtype).stage_outputs(x)
        saved({"output": stages[-1][1].float().cpu().contiguous(), **pack_stages(stages)}, output)
        return
    out = recipe_output(name, model, x, dtype, layout == "nhwc")
    saved({"output": out.float().cpu().contiguous()}, output)


def saved(tensors: dict[str, torch.Tensor], output: str) -> None:
    """Written whole or not at all: the runner takes a file that exists as made."""
    write_atomic(Path(output), lambda tmp: save_file(tensors, str(tmp)))


def jobs(listing: str) -> None:
    """Each job of the listing in turn; the first that raises ends the process (the runner makes the rest alone)."""
    for job, *args in json.loads(Path(listing).read_text()):
        JOBS[job](*args)


def measured_peak(output: str) -> None:
    """Median TFLOP/s of large square matrix products through cuBLAS (random data; zeros run faster)."""
    from triton.testing import do_bench  # Triton: only on the GPU

    rates = {}
    for name, n in (("bf16", 8192), ("fp16", 8192), ("tf32", 8192), ("fp32", 4096), ("fp8", 8192)):
        if name == "fp8" and torch.cuda.get_device_capability() < (8, 9):
            continue  # e4m3 tensor cores: Ada and Hopper on
        set_math_mode(name)
        a = torch.randn(n, n, device="cuda", dtype=torch_dtype(name))
        b = torch.randn(n, n, device="cuda", dtype=torch_dtype(name))
        if name == "fp8":  # per-tensor scales, as the fp8 cell's kernels; the second operand column-major
            one = torch.ones((), device="cuda")
            product = partial(torch._scaled_mm, a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t(), one, one,
                              out_dtype=torch.bfloat16)
        else:
            product = partial(torch.matmul, a, b)
        ms = do_bench(product, warmup=100, rep=500, return_mode="median")
        rates[name] = 2 * n**3 / ms / 1e9
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    write_text_atomic(Path(output), json.dumps({
        "tflops": rates, "what": "median of cuBLAS n x n matmul (n=8192; fp32 4096; fp8: e4m3 through "
        "torch._scaled_mm, bf16 out), random data",
        "copy_gbs": 2 * src.numel() / copy_ms / 1e6, "copy_what": "median of a 1 GiB device-to-device copy: bytes "
        "read + written per second"}))


JOBS = {"ref": reference, "recipe": recipe, "jobs": jobs, "peak": measured_peak}

if __name__ == "__main__":
    job, *args = sys.argv[1:]
    JOBS[job](*args)
