"""Where the triton rung departs from its parity recipe (core/recipes.py), block by block.

Each block is run twice: fed the recipe's own input ("alone": what that block adds) and fed the rung's previous
block ("chained": what the network has gathered so far). Beside them, the recipe against itself with fp64
accumulation ("recipe64"): the spread that summation order alone makes. Figures are ||out - recipe|| / ||recipe||.
The first line checks Triton's fp32 -> e4m3 conversion against torch's, which the recipe uses.

    python3 bench/recipe_per_block.py --dtype fp8 --batch 32          # on a GPU
    TRITON_INTERPRET=1 python3 bench/recipe_per_block.py --dtype tf32 --device cpu --res 32 --batch 2
    python3 bench/recipe_per_block.py --dtype fp8 --batch 8 --device cpu --mutants   # recipes only, no rung

With --mutants, each weight or input mutant (core/mutations.py) is computed by the recipe instead of the rung, on
the right network's calibration, each block fed the right network's input: the gap a per-block check would see.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from core.model import build_model, make_input  # noqa: E402
from core.mutations import FORWARD, mutant_input  # noqa: E402
from core.parity import norm_rel_err  # noqa: E402
from core.recipes import Folded, calibration_amax, calibration_input, strict_fp32  # noqa: E402
from kernels.triton.resnet import TritonResNet  # noqa: E402
from tiers.triton import _precision  # noqa: E402


@triton.jit
def _to_e4m3(x_ptr, y_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs).to(tl.float8e4nv))


def e4m3_mismatch(device: str, n: int = 1 << 14) -> float:
    """The fraction of values Triton's fp32 -> e4m3 conversion rounds unlike torch's."""
    x = torch.randn(n, device=device) * 10
    y = torch.empty_like(x, dtype=torch.float8_e4m3fn)
    _to_e4m3[(1,)](x, y, n)
    return (y.float() != x.to(torch.float8_e4m3fn).float()).float().mean().item()


@contextlib.contextmanager
def fp64_accumulation():
    """Every F.conv2d (the recipe's convolutions) summed in fp64 while it lasts."""
    conv = F.conv2d

    def conv64(x, w, b=None, *args):
        return conv(x.double(), w.double(), None if b is None else b.double(), *args).float()

    F.conv2d = conv64
    try:
        yield
    finally:
        F.conv2d = conv


def fed_stages(stages, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each stage (name, function) applied to its own input."""
    with torch.no_grad(), strict_fp32():
        return [stage(x) for (_, stage), x in zip(stages, inputs)]


def mutant_blocks(args, model: torch.nn.Module, x: torch.Tensor, amax, outer: str) -> None:
    """Each weight or input mutant's recipe against the right network's, block by block (each block fed the right
    network's input, the calibration the right network's, as a kernel bug would leave it): where a per-block check
    would see it."""
    right = Folded(model, args.dtype, args.device, args.dtype != "fp8", amax, outer=outer)
    want = right.stage_outputs(x)
    inputs = [out for _, out in want[:-1]]
    print("mutant                    logits    its worst stage")
    for mutant in FORWARD:
        if mutant.kind == "structure":  # in the rung's code, not in anything the recipe reads
            continue
        wrong, fed = mutant.model(model), mutant_input(mutant, x)
        recipe = Folded(wrong, args.dtype, args.device, args.dtype != "fp8", amax, outer=outer)
        outs = fed_stages(recipe.stages(), [fed] + inputs)
        gaps = {name: norm_rel_err(o, w) for o, (name, w) in zip(outs, want)}
        worst = max(gaps, key=gaps.get)
        print(f"{mutant.name:25} {norm_rel_err(recipe(fed), want[-1][1]):.2e}  {worst} {gaps[worst]:.2e}", flush=True)

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="fp8", choices=("tf32", "bf16", "fp8"))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--res", type=int, default=224)
    parser.add_argument("--pairs", default="auto", choices=("auto", "on", "off"), help="the rung's pairs and chains")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--mutants", action="store_true",
                        help="instead of the rung: each weight or input mutant's recipe against the right one's")
    args = parser.parse_args()
    interpreted = args.device == "cpu" and not args.mutants  # the rung under Triton's interpreter
    if interpreted and args.dtype == "bf16":
        parser.error("the interpreter has no bf16 arithmetic: --dtype tf32 or fp8 on the CPU, or --mutants")
    # fp8 in the interpreter: fp32 storage and TF32 products stand in for bf16 outside the blocks (core/recipes.py)
    act = torch.float32 if interpreted or args.dtype == "tf32" else torch.bfloat16
    outer = "tf32" if interpreted else "bf16"

    model = build_model("resnet50").eval()
    x = make_input(args.batch, args.res).to(args.device)
    amax = (calibration_amax(copy.deepcopy(model).to(args.device),
                             calibration_input(args.batch, args.res).to(args.device)) if args.dtype == "fp8" else None)
    if args.mutants:
        return mutant_blocks(args, model, x, amax, outer)
    print(f"Triton fp32 -> e4m3 unlike torch's: {e4m3_mismatch(args.device):.4f} of values")
    recipe = Folded(model, args.dtype, args.device, args.dtype != "fp8", amax, outer=outer)
    with torch.no_grad():
        logits = recipe(x)
        with fp64_accumulation():
            print(f"recipe, fp32 against fp64 accumulation (logits): {norm_rel_err(logits, recipe(x)):.2e}")
        net = TritonResNet(model, act, args.device, _precision(args.dtype), tune=False,
                           fp8_amax=amax, pairs=args.pairs, chains=args.pairs)
        print(f"rung against recipe (logits): {norm_rel_err(net(x.to(act)), logits):.2e}")

        want = recipe.stage_outputs(x)
        inputs = [x] + [out for _, out in want[:-1]]
        with fp64_accumulation():
            want64 = fed_stages(recipe.stages(), inputs)
        alone = fed_stages(net.stages(act), inputs)
        print("stage     alone     recipe64  chained")
        h = x.to(act)
        for (name, stage), (_, ref), ours, ref64 in zip(net.stages(act), want, alone, want64):
            h = stage(h)
            print(f"{name:9} " + "  ".join(f"{norm_rel_err(y, ref):.2e}" for y in (ours, ref64, h)), flush=True)

if __name__ == "__main__":
    main()
