"""The AOTInductor rungs on the CPU: a real torch.export + AOTInductor package, loaded from Python and from our C++
program (built with CMake), both checked against eager; the package cache's key; the reason on an older torch."""

import pytest
import torch

from conftest import ladder, records
from core.model import build_model
from tiers.exports.aot_inductor import TRACE_BATCH, missing_api, package_key, weights_digest
from core.cell import Cell


def test_both_rungs_match_eager_from_one_package_with_a_dynamic_batch(tmp_path):
    # Channels-last, with the package traced for the batch-1 cell: a package assumes its input's strides are the
    # traced sample's, so a sample in another layout would scramble the batch-3 cell's image.
    proc = ladder(tmp_path, "--tiers", "aot-inductor,aot-inductor-cpp", "--model", "resnet18", "--batch", "1,3",
                  "--res", "32", "--layout", "nhwc")
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = records(tmp_path)
    assert len(recs) == 4
    for r in recs:
        assert r["status"] == "ok", (r["label"], r["reason"])
        assert r["parity"]["ok"] and r["parity"]["rel_err"] < 1e-5
        stats = r["build_stats"]
        assert stats["export_s"] > 0 and stats["aot_compile_s"] > 0 and stats["package_bytes"] > 40e6
        assert stats["package_load_s"] > 0 and stats["batch_dim"] == "dynamic"
        assert stats["runner"] == "single-threaded" and stats["traced_batch"] == TRACE_BATCH
    packages = list((tmp_path / "cache" / "aot-inductor").glob("*.pt2"))
    assert len(packages) == 1  # one package: every batch size, both rungs
    assert {r["build_stats"]["package"] for r in recs} == {packages[0].name}


def test_a_static_package_matches_eager_from_both_rungs_and_either_runner(tmp_path):
    # One package per batch size (its key, below, includes the batch): here one batch, one package for both rungs,
    # the C++ one running it through the loader's pool of model instances.
    proc = ladder(tmp_path, "--tiers", "aot-inductor,aot-inductor-cpp", "--model", "resnet18", "--batch", "3",
                  "--res", "32", "--option", "aot-inductor:batch-dim=static",
                  "--option", "aot-inductor-cpp:batch-dim=static", "--option", "aot-inductor-cpp:runner=pooled")
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = records(tmp_path)
    assert len(recs) == 2
    for r in recs:
        assert r["status"] == "ok" and r["parity"]["rel_err"] < 1e-5, (r["label"], r["reason"])
        assert r["build_stats"]["batch_dim"] == "static" and r["build_stats"]["traced_batch"] == 3
    assert {r["tier"]: r["build_stats"]["runner"] for r in recs} == {"aot-inductor": "single-threaded",
                                                                       "aot-inductor-cpp": "pooled"}
    assert len(list((tmp_path / "cache" / "aot-inductor").glob("*.pt2"))) == 1


@pytest.mark.quick
def test_package_key_follows_what_the_package_bakes_in():
    model = build_model("resnet18")
    digest = weights_digest(model)
    cell = Cell(tier="aot-inductor", model="resnet18", batch=2, device="cpu")
    key = package_key(digest, cell)
    assert package_key(digest, Cell(tier="aot-inductor", model="resnet18", batch=64, device="cpu")) == key
    for other in (dict(dtype="bf16"), dict(channels_last=True), dict(device="cuda"),
                  dict(options=(("mode", "max-autotune"),)), dict(options=(("batch-dim", "static"),))):
        assert package_key(digest, Cell(**{**cell.__dict__, **other})) != key, other
    assert package_key(digest, Cell(**{**cell.__dict__, "options": (("runner", "pooled"),)})) == key  # load-time
    static = Cell(**{**cell.__dict__, "options": (("batch-dim", "static"),)})  # one package per batch size
    assert package_key(digest, static) != package_key(digest, Cell(**{**static.__dict__, "batch": 64}))
    with torch.no_grad():
        model.fc.bias.add_(1e-3)
    assert package_key(weights_digest(model), cell) != key


@pytest.mark.quick
def test_a_torch_without_the_package_api_is_named_exactly(monkeypatch):
    assert missing_api() is None
    monkeypatch.delattr(torch._inductor, "aoti_load_package")
    assert missing_api() == (f"torch {torch.__version__} has no torch._inductor.aoti_load_package (AOTInductor "
                             "packages need torch >= 2.6)")
