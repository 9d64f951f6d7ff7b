"""Does a rung compute the same function as the eager fp32 reference? Checked on every cell."""
from __future__ import annotations

import torch

# Per dtype: largest allowed max|out - ref| / max|ref|, and smallest allowed cosine similarity.
# fp32 is strict fp32 against strict fp32 (only summation order differs); tf32 keeps 10 mantissa bits in
# products; fp16/bf16 store every activation with 11/8 bits.
TOLERANCES = {
    "fp32": {"rel_err": 1e-4, "cosine": 0.99999},
    "tf32": {"rel_err": 2e-2, "cosine": 0.999},
    "fp16": {"rel_err": 2e-2, "cosine": 0.999},
    "bf16": {"rel_err": 6e-2, "cosine": 0.995},
    # e4m3 keeps 3 mantissa bits: about 5% per convolution, compounding over ResNet-50's (docs/notes/fp8-parity.md)
    "fp8": {"rel_err": 0.5, "cosine": 0.9},
}


# Against the rung's own recipe at its dtype (core/recipes.py: the same roundings, in PyTorch), the largest allowed
# ||out - recipe|| / ||recipe|| over all logits. Not the largest element: the rung and the recipe both round the
# logits, and one whose unrounded values differ in the last fp32 bits lands an output ulp away now and then (by the
# largest element tf32 sat at 9e-4 and bf16 at 7e-3, as far as the band against fp32 is); over the norm such flips
# weigh little, while a wrong network moves every logit. Measured on the H100 (batch 32 and 256, 224 px): the right
# rungs at tf32 6.4-6.8e-4, fp16 6.3e-4, bf16 4.5e-3 (triton) and 7.7e-3 (cudnn; eager against itself: 0); the
# mutation suite's wrong networks at 1.48e-2 and more (bf16: 1.57e-2). bf16's margin is thin on both sides: a
# sparse flip of an activation grows about 2x a block through the network (docs/notes/parity.md). None: recorded,
# not judged: fp8's recipe is 3.9e-2 from the rung, as far as five wrong networks are (open).
RECIPE_TOLERANCES = {"fp32": 1e-4, "tf32": 3e-3, "fp16": 3e-3, "bf16": 1.1e-2, "fp8": None}


# Stage by stage against the recipe (core/recipes.py `Folded.stages`): each stage of a hand-written rung fed the
# recipe's own input for it, the largest allowed ||out - recipe|| / ||recipe|| of any stage. Where the logits cannot
# be judged: at fp8 the rung's blocks each sit 2.8e-3 to 5.7e-3 from the recipe (Hopper's fp8 sums), which the
# network amplifies to 3.9e-2 at the logits, as far as subtle wrong networks are; block by block each wrong network
# moves its own block by 2.8e-2 or more (H200, batch 32, 224 px; results/nvidia-h200/checks/fp8-per-block/). Other
# dtypes: recorded, not judged (their logits are).
STAGE_TOLERANCES = {"fp8": 1.2e-2}


# Dtypes whose rounding can come near the distance between two inputs' outputs: with the run's weights at 224 px,
# ResNet-50's logits for another input are 0.24 rel err and 0.973 cosine from these, inside fp8's tolerance. There
# the output must also be nearer the reference than this share of that distance (docs/notes/fp8-parity.md).
NEARER_THAN_ANOTHER_INPUT = {"fp8": 0.5}


def against_another_input(parity: dict, other: torch.Tensor, ref: torch.Tensor, dtype: str) -> dict:
    """`parity` (of an output against `ref`) with the dtype's second test, where it has one: its relative error and
    its cosine distance each at most NEARER_THAN_ANOTHER_INPUT of those between `other` (eager fp32 on another
    input) and `ref`: a rung computing on the wrong input sits about that far."""
    share = NEARER_THAN_ANOTHER_INPUT.get(dtype)
    if share is None or "rel_err" not in parity:
        return parity
    far = compare(other, ref, dtype)
    rel = parity["rel_err"] / far["rel_err"] if far["rel_err"] else float("inf")
    cos = (1 - parity["cosine"]) / (1 - far["cosine"]) if far["cosine"] < 1 else float("inf")
    failures = [parity["reason"]] if parity["reason"] else []
    if max(rel, cos) > share:
        failures.append(f"not nearer the reference than {share:.0%} of another input's distance (rel err "
                        f"{rel:.0%} of it, cosine distance {cos:.0%})")
    return {**parity, "ok": parity["ok"] and max(rel, cos) <= share, "reason": "; ".join(failures) or None,
            "another_input": {"rel_err": far["rel_err"], "cosine": far["cosine"], "share_of_rel_err": rel,
                              "share_of_cosine_distance": cos, "allowed_share": share}}


def against_recipe(parity: dict, out: torch.Tensor, recipe_ref: torch.Tensor, recipe: str, dtype: str) -> dict:
    """`parity` (of `out` against eager fp32) with the second test of a rung that names its recipe: `out` within
    RECIPE_TOLERANCES of the recipe computed at the cell's dtype (`recipe_ref`)."""
    if "rel_err" not in parity:
        return parity
    tol = RECIPE_TOLERANCES[dtype]
    figures = {k: v for k, v in _distance(out, recipe_ref).items() if k in ("rel_err", "norm_rel_err", "cosine")}
    if tol is None:
        return {**parity, "recipe": {"name": recipe, **figures, "tolerance": None, "ok": None}}
    ok = figures["norm_rel_err"] <= tol
    failures = [parity["reason"]] if parity["reason"] else []
    if not ok:
        failures.append(f"{figures['norm_rel_err']:.2e} from its recipe ({recipe}, {dtype}; norm) > {tol:.0e}")
    return {**parity, "ok": parity["ok"] and ok, "reason": "; ".join(failures) or None,
            "recipe": {"name": recipe, **figures, "tolerance": tol, "ok": ok}}


def against_stages(parity: dict, outs: list[tuple[str, torch.Tensor]], refs: list[tuple[str, torch.Tensor]],
                   dtype: str) -> dict:
    """`parity` with the stage check: each stage's output (`outs`, the rung's stage fed the recipe's input for it)
    against the recipe's (`refs`, the same names in order), the worst stage within STAGE_TOLERANCES."""
    if [name for name, _ in outs] != [name for name, _ in refs]:
        raise ValueError(f"the rung's stages {[n for n, _ in outs]} are not the recipe's {[n for n, _ in refs]}")
    each = {name: norm_rel_err(out, ref) for (name, out), (_, ref) in zip(outs, refs)}
    worst = max(each, key=each.get)
    tol = STAGE_TOLERANCES.get(dtype)
    ok = None if tol is None else each[worst] <= tol
    failures = [parity["reason"]] if parity.get("reason") else []
    if ok is False:
        failures.append(f"stage {worst} {each[worst]:.2e} from its recipe's (norm) > {tol:.1e}")
    return {**parity, "ok": parity["ok"] and ok is not False, "reason": "; ".join(failures) or None,
            "stages": {"worst": worst, "norm_rel_err": each[worst], "tolerance": tol, "ok": ok, "each": each}}


def ratio_to_eager(parity: dict, eager_out: torch.Tensor, ref: torch.Tensor) -> dict:
    """`parity` with its error as a share of eager's at the same dtype (`eager_out`, against the same `ref`)."""
    if "rel_err" not in parity:
        return parity
    eager = _distance(eager_out, ref)["rel_err"]
    return {**parity, "eager_rel_err": eager, "ratio_to_eager": parity["rel_err"] / eager if eager > 0 else None}


def norm_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, as the recipe and stage checks judge."""
    return _distance(out, ref)["norm_rel_err"]


def _distance(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """How far `out` is from `ref`: by the largest element (max_abs_err, and rel_err over the largest |ref|, `scale`),
    over the norm (norm_rel_err) and by direction (cosine)."""
    out, ref = out.double(), ref.double()
    scale, norm = ref.abs().max().item(), ref.norm().item()
    max_abs, dist = (out - ref).abs().max().item(), (out - ref).norm().item()
    return {"scale": scale, "max_abs_err": max_abs, "rel_err": max_abs / scale if scale > 0 else max_abs,
            "norm_rel_err": dist / norm if norm > 0 else dist,
            "cosine": torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0).item()}


def compare(out: torch.Tensor, ref: torch.Tensor, dtype: str) -> dict:
    """Parity figures and the verdict. Top-1 agreement is required only on decisive rows: those whose reference
    top-1 margin is larger than twice the error allowed for the dtype (a near-tie may legitimately flip)."""
    tol = TOLERANCES[dtype]
    if out.shape != ref.shape:
        return {"ok": False, "reason": f"output shape {tuple(out.shape)} != reference {tuple(ref.shape)}"}
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return {"ok": False, "reason": "output has NaN or Inf"}
    figures = _distance(out, ref)
    scale, max_abs, rel, cosine = figures["scale"], figures["max_abs_err"], figures["rel_err"], figures["cosine"]
    top2 = ref.topk(2, dim=1).values
    decisive = (top2[:, 0] - top2[:, 1]) > 2 * tol["rel_err"] * scale
    agree = out.argmax(1) == ref.argmax(1)
    top1 = agree.double().mean().item()
    top1_decisive = agree[decisive].double().mean().item() if decisive.any() else 1.0
    failures = []
    if rel > tol["rel_err"]:
        failures.append(f"rel err {rel:.2e} > {tol['rel_err']:.0e}")
    if cosine < tol["cosine"]:
        failures.append(f"cosine {cosine:.6f} < {tol['cosine']}")
    if top1_decisive < 1.0:
        failures.append(f"top-1 differs on {int((~agree & decisive).sum())} decisive rows")
    return {
        "ok": not failures,
        "reason": "; ".join(failures) or None,
        "max_abs_err": max_abs,
        "rel_err": rel,
        "cosine": cosine,
        "top1_agreement": top1,
        "top1_agreement_decisive": top1_decisive,
        "decisive_rows": int(decisive.sum()),
        "tolerance": tol,
        "reference": "eager fp32 (TF32 off), same input",
    }


def verdict(out: torch.Tensor, ref: torch.Tensor, dtype: str, other: torch.Tensor | None = None,
            eager: torch.Tensor | None = None, recipe: tuple[str, torch.Tensor] | None = None) -> dict:
    """Every forward check of a cell, as the ladder applies them: the band against eager fp32 (`ref`), nearer
    `ref` than another input's output (`other`) where the dtype asks it, the error as a ratio to `eager`'s at the
    same dtype, and within RECIPE_TOLERANCES of the rung's `recipe` (name, output at the dtype)."""
    parity = compare(out, ref, dtype)
    if dtype in NEARER_THAN_ANOTHER_INPUT and other is not None:
        parity = against_another_input(parity, other, ref, dtype)
    if eager is not None:
        parity = ratio_to_eager(parity, eager, ref)
    if recipe is not None:
        parity = against_recipe(parity, out, recipe[1], recipe[0], dtype)
    return parity
