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
from core.recipes import Folded, calibration_amax, calibration_input, strict_fp32  # noqa: E402
from kernels.triton.resnet import TritonResNet, run_block  # noqa: E402
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


def distance(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


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


def recipe_blocks(recipe: Folded, model: torch.nn.Module, x: torch.Tensor,
                  fed: list[torch.Tensor] | None = None) -> tuple[list[str], list[torch.Tensor]]:
    """The recipe's stem output and each block's output (NCHW), each block fed `fed`'s entry before it (the right
    network's outputs) or, without `fed`, the block before."""
    layers = (model.layer1, model.layer2, model.layer3, model.layer4)
    names = ["stem"] + [f"layer{i + 1}.{j}" for i, layer in enumerate(layers) for j in range(len(layer))]
    blocks = [block for layer in layers for block in layer]
    with torch.no_grad(), strict_fp32():
        r = recipe.round(F.max_pool2d(F.relu(recipe.conv(recipe.round(x.float()), model.conv1, model.bn1)), 3, 2, 1))
        outs = [r]
        for i, (name, block) in enumerate(zip(names[1:], blocks)):
            outs.append(recipe.block(fed[i] if fed else outs[-1], block, name))
    return names, outs


def mutant_blocks(args, model: torch.nn.Module, x: torch.Tensor, amax, outer: str) -> None:
    """Each weight or input mutant's recipe against the right network's, block by block (each block fed the right
    network's input, the calibration the right network's, as a kernel bug would leave it): where a per-block check
    would see it."""
    right = Folded(model, args.dtype, args.device, args.dtype != "fp8", amax, outer=outer)
    names, want = recipe_blocks(right, model, x)
    logits = right(x)
    print("mutant                    logits    its worst block")
    for mutant in FORWARD:
        if mutant.kind == "structure":  # in the rung's code, not in anything the recipe reads
            continue
        wrong, fed = mutant.model(model), mutant_input(mutant, x)
        recipe = Folded(wrong, args.dtype, args.device, args.dtype != "fp8", amax, outer=outer)
        _, outs = recipe_blocks(recipe, wrong, fed, want)
        gaps = [distance(o, w) for o, w in zip(outs, want)]
        worst = max(range(len(gaps)), key=gaps.__getitem__)
        print(f"{mutant.name:25} {distance(recipe(fed), logits):.2e}  {names[worst]} {gaps[worst]:.2e}", flush=True)


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
            print(f"recipe, fp32 against fp64 accumulation (logits): {distance(logits, recipe(x)):.2e}")
        net = TritonResNet(model, act, args.device, _precision(args.dtype), tune=False,
                           fp8_amax=amax, pairs=args.pairs, chains=args.pairs)
        print(f"rung against recipe (logits): {distance(net(x.to(act)), logits):.2e}")

        names, want = recipe_blocks(recipe, model, x)
        with fp64_accumulation():
            _, want64 = recipe_blocks(recipe, model, x, want)
        h = net.stem_pool(x.permute(0, 2, 3, 1).contiguous().to(act), net.stem)
        print(f"stem {distance(h.permute(0, 3, 1, 2), want[0]):.2e}")
        print("block     kind  alone     recipe64  chained")
        for i, packed in enumerate(net.blocks):
            fed = want[i].permute(0, 2, 3, 1).contiguous().to(act)
            alone, _ = run_block(fed, packed, net.conv, net.pair if net.paired(fed, packed) else None)
            h, _ = run_block(h, packed, net.conv, net.pair if net.paired(h, packed) else None)
            gaps = [distance(y, want[i + 1]) for y in (alone.permute(0, 3, 1, 2), want64[i + 1], h.permute(0, 3, 1, 2))]
            print(f"{names[i + 1]:9} {'pair' if net.paired(fed, packed) else 'conv':5} "
                  + "  ".join(f"{g:.2e}" for g in gaps), flush=True)

if __name__ == "__main__":
    main()
