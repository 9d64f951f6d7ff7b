"""Bad input gets one clear line naming the valid choices."""
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO


def harness(*args):
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.parametrize("args, valid", [
    (["ladder", "--dtype", "fp64"], ["fp32", "tf32", "fp16", "bf16"]),
    (["ladder", "--tiers", "eager,nope"], ["eager", "torchscript", "compile", "onnxruntime"]),
    (["ladder", "--compile-mode", "fast"], ["default", "reduce-overhead", "max-autotune"]),
    (["ladder", "--device", "tpu"], ["cuda", "cpu"]),
    (["ladder", "--cuda-graph", "maybe"], ["off", "on", "both"]),
    (["micro", "--tier", "eager"], ["cudnn", "triton"]),  # the hand-written rungs
])
def test_bad_values_name_the_valid_choices(args, valid):
    proc = harness(*args)
    assert proc.returncode == 2
    error = proc.stderr.strip().splitlines()[-1]
    assert "invalid choice" in error and args[-1].split(",")[-1] in error
    assert all(v in error for v in valid), error


def test_rung_options_are_checked_against_what_the_rung_declares():
    assert "eager has no option 'x' (valid: none)" in harness("ladder", "--option", "eager:x=1").stderr
    assert "takes a positive integer" in harness("ladder", "--option", "tensorrt:trt-max-batch=0").stderr
    assert "triton:autotune" in harness("ladder", "--option", "garbage").stderr
    assert "invalid choice 'maybe' for triton:autotune (choose from on, off)" in harness(
        "ladder", "--option", "triton:autotune=maybe").stderr


def test_bad_model_and_batch():
    assert "invalid choice" in harness("ladder", "--model", "resnet9").stderr.splitlines()[-1]
    assert "0 must be a positive integer" in harness("ladder", "--batch", "1,0").stderr.splitlines()[-1]


def test_tiers_lists_every_rung_with_availability():
    proc = harness("tiers")
    assert proc.returncode == 0
    for name in ("eager", "torchscript", "compile", "onnxruntime"):
        assert name in proc.stdout
    assert "available" in proc.stdout


def test_a_rung_that_fails_to_import_is_listed_unavailable():
    proc = subprocess.run([sys.executable, "-m", "harness", "tiers"], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO), "LADDER_EXTRA_TIERS": "tests.no_such_rung",
                               "COLUMNS": "300"})
    assert proc.returncode == 0
    assert "no-such-rung" in proc.stdout and "failed to import" in proc.stdout
    assert "eager" in proc.stdout
