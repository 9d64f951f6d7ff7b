"""Training down the ladder: the step, its parity over steps (and the bugs it catches), the ladder's training
cells, and train-to-accuracy on real data. All on the CPU, with real rungs."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import REPO, ladder, records
from core import train
from core.model import build_model, num_classes, weights_state
from core.cell import Cell

CELL = Cell(tier="eager", model="resnet18", batch=8, res=64, device="cpu", task="train")


def run_steps(step_of, x):
    """K parity steps of a step built by `step_of(net)` from the seeded weights: the output file's tensors."""
    net = build_model("resnet18").train()
    step = step_of(net)
    losses = [step(x) for _ in range(train.K_STEPS)]
    return train.output_tensors(losses, train.state_of(net))


@pytest.fixture(scope="module")
def reference():
    """The input, eager's output file, and the weights the steps start from (what updates are measured from)."""
    x = torch.randn(8, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    return x, run_steps(lambda net: train.make_step(net, net, CELL, num_classes(net)), x), \
        weights_state(build_model("resnet18"))


def test_the_same_step_passes_parity(reference):
    x, ref, initial = reference
    verdict = train.compare(run_steps(lambda net: train.make_step(net, net, CELL, 1000), x), ref, initial, "fp32")
    assert verdict["ok"] and verdict["rel_err"] == 0.0 and verdict["steps"] == 3


def buggy_step(net, bug):
    """The step of core/train.py with one classic bug."""
    opt = torch.optim.SGD(net.parameters(), lr=train.LEARNING_RATE, momentum=train.MOMENTUM,
                          weight_decay=train.WEIGHT_DECAY)
    y = train.labels(8, 1000, "cpu")
    if bug == "bn-eval":
        net.eval()
    if bug == "stats-frozen":
        for m in net.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.momentum = 0.0

    def step(x):
        if bug != "no-zero-grad":
            opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


@pytest.mark.parametrize("bug,fails_on", [("bn-eval", "loss"), ("no-zero-grad", "update"),
                                          ("stats-frozen", "running_stats")])
def test_parity_catches_the_classic_training_bugs(reference, bug, fails_on):
    x, ref, initial = reference
    verdict = train.compare(run_steps(lambda net: buggy_step(net, bug), x), ref, initial, "fp32")
    assert not verdict["ok"], verdict
    assert fails_on in verdict["reason"], verdict["reason"]


def test_train_ladder_measures_the_rungs_that_train_and_says_why_the_others_do_not(tmp_path):
    proc = ladder(tmp_path, "--task", "train", "--tiers",
                  "eager,torchscript,compile,libtorch,onnxruntime,torchscript-cpp,cudnn",
                  "--model", "resnet18", "--batch", "8", "--res", "64")
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = {r["tier"]: r for r in records(tmp_path)}
    for name in ("eager", "torchscript", "compile", "libtorch"):  # libtorch: C++ torch::nn + torch::optim::SGD
        r = recs[name]
        assert r["status"] == "ok" and r["task"] == "train" and r["key"].startswith("train:"), (name, r["reason"])
        assert r["parity"]["ok"] and r["parity"]["steps"] == 3 and len(r["parity"]["loss"]) == 3
        assert r["throughput_img_s"] > 0 and r["host_overhead_us"]["median"] > 0
        mem = r["memory"]
        assert mem["weights_bytes"] == mem["gradient_bytes"] == mem["optimizer_state_bytes"] > 40e6  # 11.7M fp32
        assert r["tflops"]["flops_per_step"] > 0
    assert recs["compile"]["build_stats"]["compiled"] == "the whole training step"
    assert recs["onnxruntime"]["status"] == "skipped" and "training API" in recs["onnxruntime"]["reason"]
    assert recs["torchscript-cpp"]["status"] == "skipped" and "frozen" in recs["torchscript-cpp"]["reason"]
    assert recs["eager"]["parity"]["rel_err"] == 0
    assert recs["libtorch"]["parity"]["loss"] == recs["eager"]["parity"]["loss"]  # C++ takes the same step
    assert recs["cudnn"]["status"] == "unavailable"
    assert "(training steps)" in proc.stdout


# train-to-accuracy's CPU test trains six rungs for 4 epochs: 216 s on an idle 2-core host (2026-11-29), and past the
# suite's 1,200 s hang guard beside a CPU burner (issue 57: the suite must pass on a busy host), so its own is longer.
BUSY_HOST_TIMEOUT_S = 2400


def train_to_accuracy(out, *args: str, extra_tiers: bool = False) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), **({"LADDER_EXTRA_TIERS": "tests.failing_tiers"} if extra_tiers
                                                     else {})}
    proc = subprocess.run([sys.executable, "-m", "harness", "train-to-accuracy", "--out", str(out), *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=BUSY_HOST_TIMEOUT_S - 60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "accuracy.json").read_text())


def within_points_of_eager(doc: dict, points: float) -> None:
    """Every rung's test accuracy within `points` of eager's at every epoch (issue 28's test of the seed paper)."""
    eager = next(r for r in doc["rungs"] if r["rung"] == "eager")["curve"]
    for r in doc["rungs"]:
        for mine, ref in zip(r["curve"], eager, strict=True):
            assert abs(mine["test_accuracy"] - ref["test_accuracy"]) * 100 <= points, (r["rung"], mine, ref)


def final_within_points_of_eager(doc: dict, points: float) -> None:
    """Every rung's converged (last) test accuracy within `points` of eager's."""
    eager = next(r for r in doc["rungs"] if r["rung"] == "eager")["final_test_accuracy"]
    for r in doc["rungs"]:
        assert abs(r["final_test_accuracy"] - eager) * 100 <= points, (r["rung"], r["final_test_accuracy"], eager)


@pytest.mark.timeout(BUSY_HOST_TIMEOUT_S)
def test_train_to_accuracy_on_digits_reaches_90_percent(tmp_path):
    """Python rungs (eager, torchscript) and the C++ libtorch program (fed the same images, batch order and rates
    through the contract's --train-data), and eager's twin in the other layout, reach 90% and end within 1.5 points
    of eager; libtorch's curve is eager's within 1.5 points at every epoch, and the agreement table says so.
    compile trains through the same worker path as eager and torchscript; its compiled step is held by the training
    ladder's test and the GPU runs, not compiled a second time here."""
    doc = train_to_accuracy(tmp_path, "--device", "cpu", "--epochs", "4",  # every rung past 97% at the 4th
                            "--tiers", "eager,torchscript,libtorch,onnxruntime,cudnn,test-segfault",
                            extra_tiers=True)
    assert doc["data"]["train_images"] + doc["data"]["test_images"] == 1797
    assert {r["rung"] for r in doc["rungs"]} == {"eager", "torchscript", "libtorch", "eager (nhwc)"}
    for r in doc["rungs"]:
        assert len(r["curve"]) == 4 and r["final_test_accuracy"] >= 0.9, r
    final_within_points_of_eager(doc, 1.5)
    within_points_of_eager({**doc, "rungs": [r for r in doc["rungs"] if r["rung"] in ("eager", "libtorch")]}, 1.5)
    assert doc["agreement"]["libtorch"]["epochs_beyond"] == [] and doc["agreement"]["eager (nhwc)"]["epochs"] == 4
    assert "training API" in doc["skipped"]["onnxruntime"] and doc["skipped"]["cudnn"] == "needs a CUDA GPU"
    # every rung trains in a process of its own, as a ladder cell runs: a crash costs its curve and says why
    assert doc["failed"] == {"test-segfault": doc["failed"]["test-segfault"]}
    assert "killed by SIGSEGV" in doc["failed"]["test-segfault"]
    assert (tmp_path / "plots" / "accuracy.png").read_bytes()[:4] == b"\x89PNG"
    assert "](plots/accuracy.png)" in (tmp_path / "accuracy.md").read_text()


@pytest.mark.gpu
def test_the_hand_written_cudnn_rung_learns_as_eager_does(tmp_path):
    """The seed paper's open question on its own terms: ResNet-50 trained by hand with cuDNN, from the same weights
    over the same batches and rates, converges to eager's test accuracy within 1.5 points (while it learns fast,
    any two roundings of the step drift apart by more: docs/notes/train-to-accuracy.md). libtorch and eager's twins
    (in the other layout, and with cuDNN's benchmark mode off) train beside it and must learn, but the bound is the
    rung's under test: on the GPU, where cuDNN's kernels are not deterministic, eager's own final accuracy moved 0.5
    points between two runs and libtorch's distance from it 1.1-2.0 points (results/nvidia-h200/checks/gpu-tests/)."""
    doc = train_to_accuracy(tmp_path, "--model", "resnet50", "--tiers", "eager,libtorch,cudnn")
    assert {r["rung"] for r in doc["rungs"]} == {"eager", "libtorch", "cudnn", "eager (nchw)",
                                                 "eager (cudnn-benchmark=off)"}, doc["failed"]
    assert all(r["final_test_accuracy"] >= 0.9 for r in doc["rungs"]), doc["rungs"]
    final_within_points_of_eager({**doc, "rungs": [r for r in doc["rungs"] if r["rung"] in ("eager", "cudnn")]}, 1.5)


@pytest.mark.quick
def test_the_schedule_warms_up_then_decays_to_zero():
    """Rates rise linearly to the peak at the end of the warm-up epochs, then fall along a cosine, to near zero at
    the last step; a run too short for the warm-up warms up over half of it."""
    from harness.accuracy import learning_rates

    rates = learning_rates(0.1, epochs=5, steps=4, warmup_epochs=2).flatten().tolist()
    assert rates[:8] == pytest.approx([0.1 * (k + 1) / 8 for k in range(8)])
    assert rates[8] == pytest.approx(0.1) and all(a > b for a, b in zip(rates[8:], rates[9:]))
    assert 0 < rates[-1] < 0.1 * 0.02  # one step short of the cosine's end
    assert max(learning_rates(0.1, epochs=2, steps=4, warmup_epochs=3).flatten().tolist()[:4]) == pytest.approx(0.1)


@pytest.mark.quick
def test_agreement_reads_each_rung_against_eager_and_the_band_of_its_twins():
    """Epochs beyond 1.5 points of eager, and of those the ones beyond the band at that epoch: the farthest of
    eager's twins (the other layout; on the GPU, cuDNN's benchmark mode off)."""
    from harness.accuracy import agreement, twins

    def run(rung, tier, accs):
        return {"rung": rung, "tier": tier, "curve": [{"test_accuracy": a / 100} for a in accs]}

    doc = agreement([run("eager", "eager", [50, 90, 98]), run("cudnn", "cudnn", [40, 80, 97]),
                     run("eager (nchw)", "eager", [30, 89, 98])], "eager")
    assert doc["cudnn"]["points"] == [10.0, 10.0, 1.0] and doc["cudnn"]["max_points"] == 10.0
    assert doc["cudnn"]["epochs_beyond"] == [1, 2] and doc["cudnn"]["epochs_beyond_twin"] == [2]
    assert doc["eager (nchw)"]["epochs_beyond"] == [1] and doc["eager (nchw)"]["epochs_beyond_twin"] is None
    assert agreement([run("cudnn", "cudnn", [40])], "eager") == {}
    # a second twin 12 points off at epoch 2 widens the band there: cudnn's 10 points are rounding's reach
    doc = agreement([run("eager", "eager", [50, 90, 98]), run("cudnn", "cudnn", [40, 80, 97]),
                     run("eager (nchw)", "eager", [30, 89, 98]),
                     run("eager (cudnn-benchmark=off)", "eager", [49, 78, 98])], "eager")
    assert doc["cudnn"]["epochs_beyond_twin"] == [] and doc["eager (cudnn-benchmark=off)"]["twin"]
    assert twins("cpu", False) == [(True, ())]
    assert twins("cuda", True) == [(False, ()), (True, (("cudnn-benchmark", "off"),))]


def tiny_image_folder(root, per_class: dict[str, int], size: int = 8) -> None:
    """An ImageFolder tree of two classes, dark and bright squares with noise, `per_class` images each by split."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, count in per_class.items():
        for label, level in (("dark", 60), ("bright", 190)):
            (root / split / label).mkdir(parents=True)
            for i in range(count):
                pixels = np.clip(level + rng.normal(0, 30, (size, size, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(root / split / label / f"{i}.png")


def test_the_trained_network_is_evaluated_by_each_inference_cell(tmp_path):
    """train-to-accuracy --infer (issue 58): the network eager trained, evaluated on the test set in the worker by
    eager fp32 (the reference) and by triton fp32 under the interpreter, while the cells that cannot run here (fp8
    and cuDNN need the GPU) are skipped with their reasons. Strict fp32 Triton gives eager fp32's top-1 on every
    image; each cell's accuracy is its own top-1 against the labels."""
    tiny_image_folder(tmp_path / "data", {"train": 8, "test": 2})
    doc = train_to_accuracy(tmp_path / "run", "--device", "cpu", "--tiers", "eager", "--epochs", "1", "--batch", "4",
                            "--res", "16", "--data", str(tmp_path / "data"),
                            "--infer", "triton:fp32,triton:fp8,cudnn:bf16")
    inference = doc["inference"]
    assert [(c["rung"], c["dtype"]) for c in inference["cells"]] == [("eager", "fp32"), ("triton", "fp32")], inference
    assert [c["agreement"] for c in inference["cells"]] == [1.0, 1.0], inference
    assert all(c["test_accuracy"] * 4 == round(c["test_accuracy"] * 4) for c in inference["cells"])  # 4 images
    assert set(inference["skipped"]) == {"triton fp8", "cudnn bf16"} and not inference["failed"], inference
    md = (tmp_path / "run" / "accuracy.md").read_text()
    assert "## The trained network in inference" in md and "cudnn bf16: skipped" in md


def test_an_fp8_build_calibrates_on_the_images_the_run_hands_it(tmp_path):
    """The triton rung's fp8 calibration (tiers/triton.py calibrate): each convolution's input amax over the images
    in the store's calibration file where the run gives one (train-to-accuracy --infer: training images), else over
    the calibration input; the stem's amax is the images' own largest magnitude."""
    from safetensors.torch import save_file

    from core.cell import Store
    from tiers.triton import calibrate

    model = build_model("resnet18").eval()
    images = 7 * torch.randn(3, 3, 32, 32)
    save_file({"x": images}, str(tmp_path / "calibration.safetensors"))
    given = calibrate(model, images[:2], Store(calibration=tmp_path / "calibration.safetensors"))
    assert given["conv1"] == images.abs().max().item()
    assert calibrate(model, images[:2], Store())["conv1"] < given["conv1"] / 3  # the N(0,1)-like calibration input


def test_accuracy_refuses_a_data_dir_without_splits(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "harness", "train-to-accuracy", "--device", "cpu", "--data",
                           str(tmp_path)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "expected train/ and test/" in proc.stderr and proc.stderr.count("\n") == 1


@pytest.mark.gpu
def test_the_triton_rung_trains_within_parity_and_every_training_mutant_fails(monkeypatch):
    """The triton rung's training step (kernels/triton/train_resnet.py) on ResNet-50, strict fp32 and bf16: the
    right step passes the ladder's training check against eager fp32, and each training mutant fails it. Shapes
    missing from the tuning tables run their untuned configuration: autotuning each of them first took this test
    past 170 s on the H200."""
    from harness.mutations import MutationConfig, caught, training_rows
    from kernels.triton import tuning

    monkeypatch.setattr(tuning, "NO_AUTOTUNE", True)

    rows = training_rows(MutationConfig(model="resnet50", device="cuda", rungs=("triton",),
                                        train_dtypes=("fp32", "bf16"), train_batch=8, train_res=64))
    assert caught(rows) and len(rows) == 10, [(r["dtype"], r["mutant"], r["ok"], r["reason"]) for r in rows]


@pytest.mark.gpu
def test_the_triton_training_steps_peak_memory_is_at_most_eagers():
    """Issue 60's bar, at its cell (ResNet-50, bf16, batch 256, 224 px): the torch allocator's peak over 3 steps
    after a reset, as the ladder's memory pass takes it, for the triton step (each block's saved tensors freed as
    the backward passes it: kernels/triton/train_block.py) and for eager's. Untuned configurations (autotune off):
    the tiles change the time, not what is kept."""
    from core.cell import Cell, Store
    from tiers import get_tier

    x = torch.randn(256, 3, 224, 224, generator=torch.Generator().manual_seed(0)).cuda()
    peaks = {}
    for rung, options in (("eager", ()), ("triton", (("autotune", "off"),))):
        cell = Cell(tier=rung, model="resnet50", batch=256, res=224, dtype="bf16", channels_last=True,
                    device="cuda", task="train", options=options)
        step = get_tier(rung).build_train(build_model("resnet50").train(), x, cell, Store())
        step.forward(x)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(3):
            step.forward(x)
        torch.cuda.synchronize()
        peaks[rung] = torch.cuda.max_memory_allocated()
        del step
        torch.cuda.empty_cache()
    assert peaks["triton"] <= peaks["eager"], {k: f"{v / 2**30:.2f} GiB" for k, v in peaks.items()}
