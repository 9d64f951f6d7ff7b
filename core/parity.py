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


def compare(out: torch.Tensor, ref: torch.Tensor, dtype: str) -> dict:
    """Parity figures and the verdict. Top-1 agreement is required only on decisive rows: those whose reference
    top-1 margin is larger than twice the error allowed for the dtype (a near-tie may legitimately flip)."""
    tol = TOLERANCES[dtype]
    if out.shape != ref.shape:
        return {"ok": False, "reason": f"output shape {tuple(out.shape)} != reference {tuple(ref.shape)}"}
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return {"ok": False, "reason": "output has NaN or Inf"}
    scale = ref.abs().max().item()
    max_abs = (out - ref).abs().max().item()
    rel = max_abs / scale if scale > 0 else max_abs
    cosine = torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0).item()
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
