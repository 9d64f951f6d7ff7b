"""Does a rung compute the same function as the eager fp32 reference? Checked on every cell."""
from __future__ import annotations

from typing import Callable

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
# recipe's own input for it, judged by its worst stage. Where the logits cannot be judged: at fp8 the rung's blocks
# each sit 2.8e-3 to 5.7e-3 from the recipe (Hopper's fp8 sums), which the network amplifies to 3.9e-2 at the
# logits, as far as subtle wrong networks are; block by block each wrong network moves its own block by 2.8e-2 or
# more (H200, batch 32, 224 px; results/nvidia-h200/checks/fp8-per-block/). Other dtypes: recorded, not judged
# (their logits are). Two measures, by how a stage stores its output:
# - "norm": ||out - recipe|| / ||recipe||;
# - "codes", for a stage stored in e4m3 (fp8's block outputs): the share of values whose e4m3 codes differ from the
#   recipe's, over the values not zero in both. A small difference before the store moves a value a whole e4m3
#   step (6-12%) where it crosses a rounding boundary, which makes the norm of a right block (1.1-1.6e-2) nearly
#   that of a wrong one; the share of moved codes grows with the difference itself, a few percent for the sums'
#   order against about a third for a wrong network (docs/notes/fp8.md).
STAGE_TOLERANCES = {"fp8": {"norm": 1.2e-2, "codes": 0.15}}
# The ladder's stage check runs on the parity input's first images: an image's stages do not depend on the others
# (inference, batch-norm folded), and the recipe's stages of 8 images at 224 px are about 90 MB in bf16, of a whole
# batch of 256 about 2.9 GB.
STAGE_IMAGES = 8


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


def against_stages(parity: dict, errors: dict[str, dict[str, float]], dtype: str) -> dict:
    """`parity` with the stage check: each stage's figure (stage_errors: by measure, then stage) within its
    measure's STAGE_TOLERANCES; the worst is the stage furthest over (or nearest to) its tolerance."""
    tol = STAGE_TOLERANCES.get(dtype)
    figures = [(measure, name, value) for measure, each in errors.items() for name, value in each.items()
               if measure == "codes" or name not in errors.get("codes", {})]
    measure, worst, value = max(figures, key=lambda f: f[2] / tol[f[0]] if tol else f[2])
    ok = None if tol is None else value <= tol[measure]
    failures = [parity["reason"]] if parity.get("reason") else []
    if ok is False:
        failures.append(f"stage {worst} {value:.2e} from its recipe's ({measure}) > {tol[measure]:.1e}")
    return {**parity, "ok": parity["ok"] and ok is not False, "reason": "; ".join(failures) or None,
            "stages": {"worst": worst, "measure": measure, "value": value,
                       "tolerance": None if tol is None else tol[measure], "ok": ok, **errors}}


def judges_stages(recipe: str, dtype: str) -> bool:
    """Whether a cell held to `recipe` at `dtype` is held to the stage check too: a dtype with a stage tolerance,
    against a folded recipe (eager's own build has no stages)."""
    return recipe != "eager" and dtype in STAGE_TOLERANCES


def run_stages(stages: list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]], x: torch.Tensor,
               refs: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Each of a rung's `stages` fed the recipe's input for it: the stem `x`, every later stage the recipe's output
    of the stage before (`refs`, moved to x's device)."""
    inputs = [x] + [out.to(x.device) for _, out in refs[:-1]]
    with torch.inference_mode():
        return [(name, stage(inp)) for (name, stage), inp in zip(stages, inputs)]


def stage_errors(outs: list[tuple[str, torch.Tensor]], refs: list[tuple[str, torch.Tensor]]) -> dict[str, dict]:
    """Each stage's figures, the rung's stages (`outs`, run_stages) against the recipe's (`refs`, the same names in
    order): "norm", ||out - ref|| / ||ref|| of every stage; "codes", of each stage stored in e4m3 (the recipe's
    output in e4m3), the share of its values whose codes differ (code_share)."""
    if [name for name, _ in outs] != [name for name, _ in refs]:
        raise ValueError(f"the rung's stages {[n for n, _ in outs]} are not the recipe's {[n for n, _ in refs]}")
    pairs = [(name, out, ref.to(out.device)) for (name, out), (_, ref) in zip(outs, refs)]
    return {"norm": {name: norm_rel_err(out.float(), ref.float()) for name, out, ref in pairs},
            "codes": {name: code_share(out, ref) for name, out, ref in pairs if ref.dtype == torch.float8_e4m3fn}}


def code_share(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The share of e4m3 values whose codes differ, over those not zero in both (after a ReLU most are zero)."""
    if out.dtype != ref.dtype:
        raise ValueError(f"a stage stored in {ref.dtype} by the recipe was stored in {out.dtype} by the rung")
    out, ref = out.float(), ref.float()
    live = (out != 0) | (ref != 0)
    return ((out != ref) & live).sum().item() / max(live.sum().item(), 1)


def pack_stages(refs: list[tuple[str, torch.Tensor]], images: int = STAGE_IMAGES) -> dict[str, torch.Tensor]:
    """The recipe's stage outputs of the first `images` images as safetensors entries (unpack_stages reads them):
    e4m3 as stored, else in bf16 where that holds them exactly (the fp8 recipe's stem and last block), else fp32."""
    def compact(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.float8_e4m3fn:
            return t[:images].cpu().contiguous()
        t = t[:images].float().cpu().contiguous()
        return t.bfloat16() if torch.equal(t.bfloat16().float(), t) else t
    return {f"stage.{i:02d}.{name}": compact(out) for i, (name, out) in enumerate(refs)}


def unpack_stages(tensors: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """pack_stages's entries back into the stages in order (other entries of the file are left out)."""
    return [(key.split(".", 2)[2], tensors[key]) for key in sorted(k for k in tensors if k.startswith("stage."))]


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
            eager: torch.Tensor | None = None, recipe: tuple[str, torch.Tensor] | None = None,
            stages: dict[str, float] | None = None) -> dict:
    """Every forward check of a cell, as the ladder applies them: the band against eager fp32 (`ref`), nearer
    `ref` than another input's output (`other`) where the dtype asks it, the error as a ratio to `eager`'s at the
    same dtype, within RECIPE_TOLERANCES of the rung's `recipe` (name, output at the dtype), and each of its
    `stages` (stage_errors) within STAGE_TOLERANCES: a cell that judges_stages and gives none fails."""
    parity = compare(out, ref, dtype)
    if dtype in NEARER_THAN_ANOTHER_INPUT and other is not None:
        parity = against_another_input(parity, other, ref, dtype)
    if eager is not None:
        parity = ratio_to_eager(parity, eager, ref)
    if recipe is not None:
        parity = against_recipe(parity, out, recipe[1], recipe[0], dtype)
    if stages:
        parity = against_stages(parity, stages, dtype)
    elif recipe is not None and judges_stages(recipe[0], dtype):
        missing = "the rung ran no stage check (its build gives no stages)"
        parity = {**parity, "ok": False, "reason": "; ".join(filter(None, (parity.get("reason"), missing)))}
    return parity
