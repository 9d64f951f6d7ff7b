"""The parity checks can fail: the mutation suite (core/mutations.py) run through the rungs and the ladder's own
checks on the CPU, the recipes they compare with (core/recipes.py), and the training check per parameter tensor.
If a check is loosened back to a band that rounding hides wrong networks in, these fail (docs/notes/parity.md)."""
import copy
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # the triton rung on the CPU: its kernels under the interpreter

import pytest  # noqa: E402
import torch  # noqa: E402

from core.model import build_model, make_input  # noqa: E402
from core.parity import RECIPE_TOLERANCES, TOLERANCES, verdict  # noqa: E402
from core.recipes import folded, folded_recipe, recipe_output, round_tf32  # noqa: E402
from harness.mutations import MutationConfig, caught, forward_rows, training_rows  # noqa: E402


@pytest.mark.quick
def test_round_tf32_keeps_ten_mantissa_bits_to_nearest_ties_away():
    one = torch.tensor([1.0 + 2**-11, 1.0 + 2**-12, 1.0 + 3 * 2**-11, -(1.0 + 2**-11)])
    assert round_tf32(one).tolist() == [1.0 + 2**-10, 1.0, 1.0 + 2**-9, -(1.0 + 2**-10)]
    x = torch.randn(1000)
    assert round_tf32(round_tf32(x)).equal(round_tf32(x))
    assert ((round_tf32(x) - x).abs() <= x.abs() * 2**-11).all()


def test_the_folded_recipe_in_fp32_is_the_network_and_in_bf16_is_bf16_far_from_it():
    model = build_model("resnet18")
    x = make_input(2, 32)
    with torch.no_grad():
        ref = model(x)
    for fused in (True, False):
        assert verdict(folded(model, x, "fp32", fused), ref, "fp32")["ok"]
    bf16 = verdict(folded(model, x, "bf16", True), ref, "bf16")
    assert bf16["ok"] and bf16["rel_err"] > TOLERANCES["fp32"]["rel_err"] * 10, bf16  # it does round


def test_triton_tf32_computes_its_recipe():
    """The triton rung's TF32 network under the interpreter (exact fp32 products of the values as stored) against
    the folded recipe at tf32, and a batch-norm scale 10% off in its weights failing it."""
    from kernels.triton.resnet import TritonResNet

    model = build_model("resnet18")
    x = make_input(1, 32)
    recipe = ("folded-fused-shortcut", recipe_output("folded-fused-shortcut", model, x, "tf32", True))
    with torch.no_grad():
        ref = model(x)
        right = TritonResNet(model, torch.float32, "cpu", "tf32", tune=False)(x)
        model.layer1[0].bn1.weight.mul_(1.1)
        wrong = TritonResNet(model, torch.float32, "cpu", "tf32", tune=False)(x)
    assert verdict(right, ref, "tf32", recipe=recipe)["ok"]
    assert not verdict(wrong, ref, "tf32", recipe=recipe)["ok"]


@pytest.mark.quick
def test_the_stage_check_judges_its_worst_stage_where_the_dtype_has_a_tolerance():
    """fp8 (whose logits cannot be judged) is held to its worst stage; a dtype without a stage tolerance records
    the figures and leaves the verdict to its other checks; stages that are not the recipe's are refused; a cell
    that should be judged by stages and gives none fails; the stages survive their file format."""
    from core.parity import STAGE_TOLERANCES, against_stages, pack_stages, stage_errors, unpack_stages

    tol = STAGE_TOLERANCES["fp8"]["norm"]
    ref = [("stem", torch.ones(9, 4)), ("layer1.0", torch.ones(9, 4)), ("head", torch.full((9, 4), 1 / 3))]
    off = [("stem", torch.ones(9, 4)), ("layer1.0", torch.full((9, 4), 1 + 2 * tol)),
           ("head", torch.full((9, 4), 1 / 3))]
    right = {"ok": True, "reason": None}
    wrong = against_stages(right, stage_errors(off, ref), "fp8")
    assert not wrong["ok"] and wrong["stages"]["worst"] == "layer1.0" and "stage layer1.0" in wrong["reason"]
    assert against_stages(right, stage_errors(ref, ref), "fp8")["ok"]
    recorded = against_stages(right, stage_errors(off, ref), "bf16")
    assert recorded["ok"] and recorded["stages"]["ok"] is None and recorded["stages"]["value"] > 0
    with pytest.raises(ValueError, match="not the recipe's"):
        stage_errors(off[:2], ref)

    logits = torch.ones(2, 4)
    missing = verdict(logits, logits, "fp8", recipe=("folded", logits))
    assert not missing["ok"] and "no stage check" in missing["reason"]
    assert verdict(logits, logits, "fp8", recipe=("folded", logits), stages=stage_errors(ref, ref))["ok"]

    packed = unpack_stages({**pack_stages(off, images=8), "output": logits})
    assert [n for n, _ in packed] == ["stem", "layer1.0", "head"] and packed[0][1].shape[0] == 8
    assert packed[1][1].dtype == torch.float32 and packed[0][1].dtype == torch.bfloat16  # bf16 only where exact
    assert torch.equal(packed[2][1], off[2][1][:8])


@pytest.mark.quick
def test_a_stage_stored_in_e4m3_is_judged_by_the_share_of_its_codes_that_differ():
    """A block output stored in e4m3 moves a whole e4m3 step wherever a tiny difference crosses a rounding
    boundary: judged by the share of codes that differ (over values not zero in both), a few codes a step off
    pass where their norm alone would fail, and a third of them off fails; the codes survive their file format."""
    from core.parity import STAGE_TOLERANCES, against_stages, code_share, pack_stages, stage_errors, unpack_stages

    torch.manual_seed(0)
    codes = (torch.rand(64, 32) * 8).relu().to(torch.float8_e4m3fn)
    codes[:, :8] = 0  # ReLU's zeros: neither counted nor compared
    live = codes.float() != 0

    def stepped(share: float) -> torch.Tensor:  # `share` of the live codes one e4m3 step up
        moved = live & (torch.rand(codes.shape) < share)
        bits = codes.view(torch.uint8).clone()
        bits[moved] += 1
        return bits.view(torch.float8_e4m3fn)

    ref = [("stem", torch.ones(4, 4)), ("layer1.0", codes), ("head", torch.ones(4, 4))]

    def judged(share: float) -> dict:
        out = [ref[0], ("layer1.0", stepped(share)), ref[2]]
        return against_stages({"ok": True, "reason": None}, stage_errors(out, ref), "fp8")

    rounding, bug = judged(0.05), judged(0.35)
    assert rounding["stages"]["norm"]["layer1.0"] > STAGE_TOLERANCES["fp8"]["norm"]  # the norm would fail it
    assert rounding["ok"] and rounding["stages"]["measure"] == "codes" and 0.02 < rounding["stages"]["value"] < 0.08
    assert not bug["ok"] and "(codes)" in bug["reason"] and bug["stages"]["worst"] == "layer1.0"
    assert code_share(codes, codes) == 0
    with pytest.raises(ValueError, match="stored in"):
        code_share(codes.float(), codes)
    packed = unpack_stages(pack_stages(ref, images=8))
    assert packed[1][1].dtype == torch.float8_e4m3fn and torch.equal(packed[1][1].float(), codes[:8].float())


def test_each_stage_of_the_triton_rung_is_its_recipes_and_a_wrong_one_shows_in_its_own_stage():
    """The triton rung's stages (kernels/triton/resnet.py `stages`) under the interpreter, each fed the recipe's
    input for it, against the recipe's stages at tf32: the right network within 1e-3 at every stage; a batch-norm
    scale 10% off shows in its own block and the classifier's bias dropped in the head, each beyond fp8's stage
    tolerance."""
    from core.parity import against_stages, run_stages, stage_errors
    from kernels.triton.resnet import TritonResNet

    model = build_model("resnet18")
    x = make_input(1, 32)
    refs = folded_recipe("folded-fused-shortcut", model, x, "tf32").stage_outputs(x)

    def stages(m):
        net = TritonResNet(m, torch.float32, "cpu", "tf32", tune=False)
        errors = stage_errors(run_stages(net.stages(torch.float32), x, refs), refs)
        return against_stages({"ok": True, "reason": None}, errors, "fp8")["stages"]

    right = stages(model)
    assert list(right["norm"]) == [name for name, _ in refs] and right["ok"] and right["value"] < 1e-3, right
    for bug, stage in ((lambda m: m.layer1[0].bn1.weight.mul_(1.1), "layer1.0"), (lambda m: m.fc.bias.zero_(), "head")):
        wrong = copy.deepcopy(model)
        with torch.no_grad():
            bug(wrong)
        figures = stages(wrong)
        assert figures["worst"] == stage and not figures["ok"], (stage, figures)


def test_the_fp8_rungs_stages_are_its_recipes_e4m3_codes_and_a_wrong_block_moves_a_third_of_them():
    """fp8 end to end: the triton rung's fp8 network (e4m3 block outputs, each in its reader's input scale) under the
    interpreter, each stage fed the fp8 recipe's input for it, stores the recipe's e4m3 codes at every block but a
    few (the sums' order, and the interpreter's rounding at a binade's top: triton-lang/triton#8322); a batch-norm
    scale 10% off in one block moves a third of that block's codes, and the stage check fails it there."""
    from core.parity import against_stages, run_stages, stage_errors
    from core.recipes import Folded, calibration_amax
    from kernels.triton.resnet import TritonResNet

    model = build_model("resnet18").eval()
    x = make_input(2, 32)
    amax = calibration_amax(copy.deepcopy(model), make_input(2, 32, seed=2))
    refs = Folded(model, "fp8", "cpu", False, amax, outer="tf32").stage_outputs(x)
    assert [out.dtype for _, out in refs].count(torch.float8_e4m3fn) == 7  # every block's output but the last

    def stages(m):
        with torch.no_grad():
            net = TritonResNet(m, torch.float32, "cpu", "tf32", tune=False, fp8_amax=amax)
            errors = stage_errors(run_stages(net.stages(torch.float32), x, refs), refs)
        return against_stages({"ok": True, "reason": None}, errors, "fp8")["stages"]

    right = stages(model)
    assert right["ok"] and len(right["codes"]) == 7 and max(right["codes"].values()) < 0.01, right
    wrong = copy.deepcopy(model)
    with torch.no_grad():
        wrong.layer2[0].bn1.weight.mul_(1.1)
    figures = stages(wrong)
    assert not figures["ok"] and figures["worst"] == "layer2.0" and figures["measure"] == "codes", figures


def test_every_wrong_network_fails_and_the_right_one_passes_on_the_cpu():
    """The whole forward suite through eager at fp32 and bf16, and through the triton rung at fp32 for a mutant in
    its weights and one in its launches, by the ladder's checks. In bf16 the band against fp32 alone (today's check before recipes) passes
    several of them: the recipe check is what fails them."""
    config = MutationConfig(model="resnet18", batch=2, res=64, device="cpu", rungs=("eager",), dtypes=("fp32", "bf16"))
    rows = forward_rows(config)
    assert caught(rows), [(r["dtype"], r["mutant"], r["ok"]) for r in rows if r["ok"] != (r["mutant"] == "none")]
    assert len({r["mutant"] for r in rows}) >= 13
    hidden = [r["mutant"] for r in rows if r["dtype"] == "bf16" and r["mutant"] != "none" and r["band_ok"]]
    assert hidden, "the bf16 band alone should pass some wrong networks: the suite no longer tests the recipe check"
    assert RECIPE_TOLERANCES["bf16"] < min(r["recipe_rel_err"] for r in rows
                                           if r["dtype"] == "bf16" and r["mutant"] != "none")
    triton = forward_rows(MutationConfig(model="resnet18", batch=1, res=32, device="cpu", rungs=("triton",),
                                         dtypes=("fp32",), mutants=("bn-scale-x1.1-mid", "relu-dropped")))
    assert caught(triton) and len(triton) == 3, triton


def test_every_wrong_backward_fails_and_the_right_step_passes():
    """The training suite on eager at fp32: a block's convolutions or layer4 without gradient, batch-norm's scale
    without one and every weight gradient x0.7 each fail; the worst tensor's gain says which."""
    rows = training_rows(MutationConfig(model="resnet18", device="cpu", rungs=("eager",), train_dtypes=("fp32",),
                                        train_batch=4, train_res=32))
    assert caught(rows) and len(rows) == 5, rows
    gains = {r["mutant"]: r["worst_group_gain"] for r in rows}
    assert abs(gains["none"] - 1) < 0.05 and abs(gains["weight-grads-x0.7"] - 0.7) < 0.05, gains
