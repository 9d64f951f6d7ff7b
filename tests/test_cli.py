"""Bad input gets one clear line naming the valid choices. The command line is called in this process
(harness.cli.main); only the import of a broken rung module runs in a process of its own."""
import os
import subprocess
import sys

import pytest

from core.env import default_device
from harness.cli import main
from tests.conftest import REPO


def harness(capsys, *args: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `python -m harness ARGS`, in this process."""
    try:
        status = main(list(args))
    except SystemExit as e:  # argparse's refusals
        status = e.code
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.parametrize("args, valid", [
    (["ladder", "--dtype", "fp64"], ["fp32", "tf32", "fp16", "bf16"]),
    (["ladder", "--tiers", "eager,nope"], ["eager", "torchscript", "compile", "onnxruntime"]),
    (["ladder", "--compile-mode", "fast"], ["default", "reduce-overhead", "max-autotune"]),
    (["ladder", "--device", "tpu"], ["cuda", "cpu"]),
    (["ladder", "--cuda-graph", "maybe"], ["off", "on", "both"]),
    (["micro", "--tier", "eager"], ["cudnn", "triton"]),  # the hand-written rungs
])
@pytest.mark.quick
def test_bad_values_name_the_valid_choices(capsys, args, valid):
    status, _, err = harness(capsys, *args)
    assert status == 2
    error = err.strip().splitlines()[-1]
    assert "invalid choice" in error and args[-1].split(",")[-1] in error
    assert all(v in error for v in valid), error


@pytest.mark.quick
def test_rung_options_are_checked_against_what_the_rung_declares(capsys):
    assert "eager has no option 'x' (valid: cudnn-benchmark)" in harness(capsys, "ladder", "--option", "eager:x=1")[2]
    assert "takes a positive integer" in harness(capsys, "ladder", "--option", "tensorrt:trt-max-batch=0")[2]
    assert "triton:autotune" in harness(capsys, "ladder", "--option", "garbage")[2]
    assert "invalid choice 'maybe' for triton:autotune (choose from on, off)" in harness(
        capsys, "ladder", "--option", "triton:autotune=maybe")[2]


@pytest.mark.quick
def test_micro_refuses_a_dtype_its_rung_has_no_kernels_for(capsys):
    status, _, err = harness(capsys, "micro", "--tier", "cudnn", "--dtype", "fp8")
    assert status == 2 and err.strip() == (
        "micro: cudnn's per-layer microbenchmark times fp32, tf32, fp16, bf16 kernels, not fp8")


@pytest.mark.quick
def test_bad_model_and_batch(capsys):
    assert "invalid choice" in harness(capsys, "ladder", "--model", "resnet9")[2].splitlines()[-1]
    assert "0 must be a positive integer" in harness(capsys, "ladder", "--batch", "1,0")[2].splitlines()[-1]


def test_tiers_lists_every_rung_with_availability(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")
    status, out, _ = harness(capsys, "tiers")
    assert status == 0
    table = out.split("Why not:")[0]
    rows = {line.split()[0]: line.split() for line in table.splitlines() if len(line.split()) > 3}
    gpu = default_device() == "cuda"
    for name in ("eager", "torchscript", "compile", "onnxruntime"):
        _, cuda, cpu = rows[name][:3]
        assert cpu == "yes", rows[name]
        if not gpu:  # no rung may call itself available on a GPU that is not there
            assert cuda == "no", rows[name]
            assert f"{name} on cuda: no NVIDIA GPU here" in out
    assert rows["eager"][1] == ("yes" if gpu else "no")  # eager runs wherever there is a GPU


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
    (["train-to-accuracy", "--infer", "triton:fp9"], "'triton:fp9' is not RUNG:DTYPE (rungs: eager,"),
    (["train-to-accuracy", "--device", "cpu", "--tiers", "torchscript", "--infer", "triton:fp32"],
     "--infer evaluates the network eager trains: add eager to --tiers"),
])
@pytest.mark.quick
def test_bad_numbers_get_one_line(capsys, args, message):
    status, _, err = harness(capsys, *args)
    assert status == 2 and message in err.strip().splitlines()[-1], err


def test_bad_output_paths_get_one_line(capsys, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    base = ["ladder", "--device", "cpu", "--tiers", "eager", "--batch", "1", "--res", "32"]
    for extra, message in ((["--out", str(a_file)], "exists and is not a directory"),
                           (["--out", str(tmp_path / "o"), "--json", str(tmp_path)],
                            "is a directory; give a file name")):
        status, _, err = harness(capsys, *base, *extra)
        assert status == 2 and err.strip().splitlines() == [f"ladder: {extra[-2]} {extra[-1]}: {message}"], err


@pytest.mark.parametrize("content, message", [
    ("", "empty file"),
    ("not json", "not JSON"),
    ('{"a": 1}', "not a ladder JSON document"),
    ('{"results": [{"x": 1}]}', "record 0 is not a ladder record"),
])
def test_report_on_bad_files_gets_one_line(capsys, tmp_path, content, message):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    status, _, err = harness(capsys, "report", str(bad))
    assert status == 2, err
    assert err.strip().startswith(f"report: {bad}: {message}"), err
    assert len(err.strip().splitlines()) == 1, err
    status, _, err = harness(capsys, "report", str(tmp_path))
    assert (status, err.strip()) == (2, f"report: {tmp_path}: is a directory; give its results.jsonl or ladder.json")


def test_an_unwritable_results_file_is_one_line_before_any_measuring(capsys, tmp_path):
    out = tmp_path / "run"
    (out / "results.jsonl").mkdir(parents=True)  # not a file (chmod would not stop root)
    status, _, err = harness(capsys, "ladder", "--device", "cpu", "--tiers", "eager", "--batch", "1", "--res", "32",
                             "--out", str(out))
    assert status == 2 and err.strip().splitlines() == [
        f"ladder: {out / 'results.jsonl'}: cannot append to it (Is a directory)"], err
    assert not (out / "cells").exists() and not (out / "run.json").exists()  # nothing measured, nothing written


@pytest.mark.quick
def test_the_default_gpu_ladder_runs_each_rung_in_the_16_bit_type_it_is_deployed_in():
    """ONNX Runtime and TensorRT deploy in fp16 (no bf16 kernels or graph): their 16-bit cells are fp16, eager gets
    fp16 cells as their baseline, every other rung stays bf16; a --dtype given is taken as it is, and a training
    ladder adds no eager fp16 (no rung that trains deploys fp16)."""
    from harness.run.plan import LadderConfig, plan

    def dtypes(config: LadderConfig) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for cell in plan(config, "cuda"):
            out.setdefault(cell.tier, set()).add(cell.dtype)
        return out

    default = dtypes(LadderConfig())
    assert default["onnxruntime"] == default["tensorrt"] == default["ort-tensorrt"] == {"fp32", "tf32", "fp16"}
    assert default["eager"] == {"fp32", "tf32", "fp16", "bf16"} and default["cudnn"] == {"fp32", "tf32", "bf16"}
    assert dtypes(LadderConfig(dtype=["bf16"]))["onnxruntime"] == {"bf16"}  # asked for: skipped, with its reason
    assert dtypes(LadderConfig(tiers=["eager", "cudnn"]))["eager"] == {"fp32", "tf32", "bf16"}
    assert dtypes(LadderConfig(task="train"))["eager"] == {"fp32", "tf32", "bf16"}


@pytest.mark.quick
def test_fp8_is_the_triton_rungs_own_and_its_baseline_is_eager_bf16():
    """--dtype fp8: the triton rung runs it; every other rung says it does not implement fp8, and the CPU that it
    is a GPU configuration; an fp8 cell's speed-up is over eager in bf16, the type of its activations."""
    from core.cell import Cell
    from harness.results.derive import eager_baseline
    from tiers import all_tiers

    gpu = {name: tier.supports(Cell(tier=name, dtype="fp8", device="cuda")) for name, tier in all_tiers().items()}
    assert gpu.pop("triton") is None and all("does not implement fp8" in reason for reason in gpu.values())
    assert "on the CPU only fp32" in all_tiers()["triton"].supports(Cell(tier="triton", dtype="fp8", device="cpu"))
    eager = [{"tier": "eager", "cuda_graph": False, "status": "ok", "model": "resnet50", "batch": 256, "res": 224,
              "dtype": d, "channels_last": True, "device": "cuda"} for d in ("fp16", "bf16")]
    fp8 = {**eager[0], "tier": "triton", "dtype": "fp8"}
    assert eager_baseline(eager, fp8)["dtype"] == "bf16"


def test_ctrl_c_while_starting_is_one_line():
    """SIGINT in the first second lands inside `import torch`: one line and status 130, no traceback."""
    import signal
    import time

    # as from a terminal: a runner started in the background (nohup, `&`) hands its children SIGINT ignored
    proc = subprocess.Popen([sys.executable, "-m", "harness", "tiers"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(0.8)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.strip().count("\n") == 0 and "interrupted" in err, err[-2000:]
    assert "Traceback" not in err


@pytest.mark.quick
def test_a_resolution_too_large_for_even_one_image_says_so(capsys):
    from core.cell import Cell
    from harness.run.plan import fitting
    from harness.run.refusal import Refusal

    with pytest.raises(Refusal, match=r"more than 80% of the .* GiB of .* here; even batch 1 needs .* GiB: choose "
                                      r"a smaller --res"):
        fitting("resnet50", [Cell(tier="eager", batch=1, res=20000, device="cpu")], "cpu", drop=False)


@pytest.mark.quick
def test_a_resolution_under_32_is_planned_with_a_note(capsys):
    from harness import cli
    from harness.run.plan import plan

    args = cli.parser().parse_args(["ladder", "--tiers", "eager", "--res", "7,64"])
    args.argv = []
    cells = plan(cli.ladder_config(args), "cpu")
    assert sorted(c.res for c in cells) == [7, 64]
    err = capsys.readouterr().err
    assert "note: at res 7 the feature maps shrink to 1x1 before the last stage" in err and "res 64" not in err


@pytest.mark.quick
def test_an_option_given_several_values_plans_a_cell_per_value(capsys):
    from harness import cli
    from harness.run.plan import plan

    args = cli.parser().parse_args(["ladder", "--tiers", "eager,compile", "--batch", "256", "--dtype", "bf16",
                                    "--option", "eager:cudnn-benchmark=on,off", "--option",
                                    "compile:cudnn-benchmark=off", "--compile-mode", "default,max-autotune"])
    args.argv = []
    labels = sorted(c.label for c in plan(cli.ladder_config(args), "cuda"))
    assert labels == ["compile(default,cudnn-benchmark=off)", "compile(max-autotune,cudnn-benchmark=off)",
                      "eager(cudnn-benchmark=off)", "eager(cudnn-benchmark=on)"], labels
    assert "invalid choice 'maybe' for eager:cudnn-benchmark (choose from on, off)" in harness(
        capsys, "ladder", "--option", "eager:cudnn-benchmark=on,maybe")[2]


@pytest.mark.quick
def test_every_argument_has_help_and_the_usage_fits_80_columns():
    import argparse

    from harness import cli

    parser = cli.parser()
    assert len(parser.format_usage().splitlines()[0]) <= 80
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    bare = [f"{name} {a.option_strings or a.dest}" for name, sub in commands.items() for a in sub._actions
            if not a.help and not isinstance(a, argparse._HelpAction)]
    assert not bare, bare
