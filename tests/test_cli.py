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
    proc = subprocess.run([sys.executable, "-m", "harness", "tiers"], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "300"})
    assert proc.returncode == 0
    table = proc.stdout.split("Why not:")[0]
    rows = {line.split()[0]: line.split() for line in table.splitlines() if len(line.split()) > 3}
    for name in ("eager", "torchscript", "compile", "onnxruntime"):
        _, cuda, cpu = rows[name][:3]
        assert cpu == "yes", rows[name]
        # this machine has no GPU: no rung may call itself available there
        assert cuda == "no", rows[name]
        assert f"{name} on cuda: no NVIDIA GPU here" in proc.stdout


def test_a_rung_that_fails_to_import_is_listed_unavailable():
    proc = subprocess.run([sys.executable, "-m", "harness", "tiers"], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO), "LADDER_EXTRA_TIERS": "tests.no_such_rung",
                               "COLUMNS": "300"})
    assert proc.returncode == 0
    assert "no-such-rung" in proc.stdout and "failed to import" in proc.stdout
    assert "eager" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["ladder", "--timeout", "0"], "0 must be a finite number > 0"),
    (["ladder", "--timeout", "-5"], "-5 must be a finite number > 0"),
    (["ladder", "--min-time", "inf"], "inf must be a finite number >= 0"),
    (["ladder", "--precision", "2"], "2 must be a finite number > 0 and <= 1"),
    (["ladder", "--res", "224x160"], "HxW is not supported"),
])
def test_bad_numbers_get_one_line(args, message):
    proc = harness(*args)
    assert proc.returncode == 2 and message in proc.stderr.strip().splitlines()[-1], proc.stderr


def test_bad_output_paths_get_one_line(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    base = ["ladder", "--device", "cpu", "--tiers", "eager", "--batch", "1", "--res", "32"]
    for extra, message in ((["--out", str(a_file)], "exists and is not a directory"),
                           (["--out", str(tmp_path / "o"), "--json", str(tmp_path)], "is a directory; give a file")):
        proc = harness(*base, *extra)
        assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [f"ladder: --{extra[-2].lstrip('-')} "
                                                                              f"{extra[-1]}: {message}"
                                                                              + ("" if "give" not in message else
                                                                                 " name")], proc.stderr


@pytest.mark.parametrize("content, message", [
    ("", "empty file"),
    ("not json", "not JSON"),
    ('{"a": 1}', "not a ladder JSON document"),
    ('{"results": [{"x": 1}]}', "record 0 is not a ladder record"),
])
def test_report_on_bad_files_gets_one_line(tmp_path, content, message):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    proc = harness("report", str(bad))
    assert proc.returncode == 2 and proc.stderr.strip() == f"report: {bad}: {message}" or message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert harness("report", str(tmp_path)).stderr.strip() == f"report: {tmp_path}: is a directory; give its " \
                                                             "results.jsonl or ladder.json"
