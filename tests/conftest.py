import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch  # does not import triton

# Without a GPU, Triton runs on the CPU under its interpreter, which must be on before triton is first imported in
# the test process (a module that builds a torchvision model at import can import it); on a GPU the kernels run.
GPU = torch.cuda.is_available()
if not GPU:
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need a CUDA GPU: skipped without one, with that reason (`pytest -m gpu` on a GPU runs
    them all)."""
    if GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (pytest -m gpu runs these on one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A GPU test runs in a child pytest with Triton compiling its kernels when this process has Triton's interpreter
    on: collecting the CPU layer's Triton tests switches it on for the whole process (it must precede triton's first
    import), and a kernel the interpreter wraps cannot launch on the GPU."""
    if not (GPU and "gpu" in pyfuncitem.keywords and os.environ.get("TRITON_INTERPRET") == "1"):
        return None
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", pyfuncitem.nodeid],
                          cwd=REPO, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True)
    assert proc.returncode == 0, f"{pyfuncitem.nodeid} in a child without the interpreter:\n{proc.stdout[-6000:]}"
    return True


from core.paths import REPO  # noqa: E402  (after TRITON_INTERPRET)

# A protocol small enough for the CPU: the measurement code paths are all exercised, just briefly.
FAST = ["--iters", "3", "--min-time", "0", "--warmup-max", "2", "--warmup-s", "0", "--util-s", "0.05"]


def ladder_command(out: Path, *args: str, extra_tiers: bool = False) -> tuple[list[str], dict[str, str]]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    if extra_tiers:
        env["LADDER_EXTRA_TIERS"] = "tests.failing_tiers"
    return [sys.executable, "-m", "harness", "ladder", "--device", "cpu", "--out", str(out),
            "--json", str(out / "ladder.json"), "--markdown", str(out / "ladder.md"), *FAST, *args], env


def ladder(out: Path, *args: str, extra_tiers: bool = False, timeout: float = 900) -> subprocess.CompletedProcess:
    argv, env = ladder_command(out, *args, extra_tiers=extra_tiers)
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def eager_cell_run(tmp_path_factory) -> Path:
    """One finished one-cell CPU ladder (eager, batch 1, res 32) for the tests that resume, rerun or interrupt a
    finished run: each works on its own copy (`copy_run`) instead of running a ladder of its own first (three
    processes that import torch: 15-30 s here)."""
    out = tmp_path_factory.mktemp("eager-cell")
    proc = ladder(out, "--tiers", "eager", "--batch", "1", "--res", "32")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def other_load() -> float:
    """CPUs that processes outside this test's own tree keep busy, over half a second (harness.run.contention's
    measure); 0 where that is too little to flag."""
    from harness.run.contention import Contention

    probe = Contention()
    probe.begin()
    time.sleep(0.5)
    probe.end()
    return probe.result["other_cpus_busy"] if probe.result["flagged"] else 0.0


def copy_run(run: Path, to: Path) -> Path:
    """A copy of a finished run directory, without its lock (nothing in a run names its own path)."""
    shutil.copytree(run, to, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".lock"))
    return to


def records(out: Path) -> list[dict]:
    return json.loads((out / "ladder.json").read_text())["results"]


@pytest.fixture(scope="session")
def python_rungs(tmp_path_factory):
    """One CPU ladder over the Python rungs, shared by the tests that read its output: harness.ladder.run in this
    process, as the command line calls it (the cells still run in child processes)."""
    from harness import cli
    from harness import ladder as ladder_run

    out = tmp_path_factory.mktemp("python-rungs")
    argv = ladder_command(out, "--tiers", "eager,torchscript,compile,onnxruntime", "--model", "resnet18", "--batch", "2",
                          "--res", "32")[0][3:]  # ResNet-18: a third less to compile and export than ResNet-50
    args = cli.parser().parse_args(argv)
    args.argv = argv
    assert ladder_run.run(cli.ladder_config(args)) == 0
    return out
