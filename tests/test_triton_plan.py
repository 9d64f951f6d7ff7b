"""The Triton rung's launch plan (kernels/triton/plan.py) and dependent launches (kernels/triton/pdl.py): on the GPU,
a planned forward of dependent launches (small grids on copies of their kernels with a fitted carveout) gives the
bits of Triton's own launch path without them on every new input; on the CPU, where the interpreter compiles
nothing and has no dependent launches, the rung refuses both."""
import pytest

from core.cell import Cell
from tiers.triton import TIER


def test_a_plan_is_refused_where_triton_compiles_nothing():
    cell = Cell(tier="triton", model="resnet18", batch=1, res=32, device="cpu", options=(("launch", "plan"),))
    assert "interpreter" in TIER.supports(cell)


def test_dependent_launches_are_refused_on_the_cpu():
    cell = Cell(tier="triton", model="resnet18", batch=1, res=32, device="cpu", options=(("pdl", "on"),))
    assert "programmatic dependent launch" in TIER.supports(cell)
    assert TIER.supports(Cell(tier="triton", model="resnet18", batch=1, res=32, device="cpu")) is None
    defaults = {(device, dtype): TIER.setting(Cell(tier="triton", device=device, dtype=dtype), "pdl")
                for device in ("cpu", "cuda") for dtype in ("fp32", "tf32", "bf16", "fp8")}
    assert defaults == {**{k: "off" for k in defaults}, ("cuda", "tf32"): "on", ("cuda", "bf16"): "on",
                        ("cuda", "fp8"): "on"}  # the GPU outside strict fp32, where they were measured slower


@pytest.mark.gpu
def test_a_planned_forward_gives_the_bits_of_tritons_own_launches_on_each_input():
    """Triton's own launches one after another, against the recorded forward replayed with programmatic dependent
    launches (each kernel starting before the one before has ended): the same bits on every input. A grid that
    leaves room on its SMs launches a copy of its kernel whose carveout just holds its programs. (On a GPU the
    test runs in a child without Triton's interpreter: tests/conftest.py.)"""
    import ctypes

    import torch

    from core.cell import Store
    from core.model import build_model
    from kernels.triton.carveout import fitted_carveout

    net = build_model("resnet18").cuda().eval()
    xs = [torch.randn(2, 3, 64, 64, device="cuda").to(memory_format=torch.channels_last) for _ in range(3)]

    def built(launch, pdl):
        cell = Cell(tier="triton", model="resnet18", batch=2, res=64, device="cuda", channels_last=True,
                    options=(("autotune", "off"), ("launch", launch), ("pdl", pdl)))
        return TIER.build(net, xs[0], cell, Store())

    jit, planned = built("jit", "off"), built("plan", "on")
    assert planned.stats["launch"] == "plan" and jit.stats["launch"] == "jit"
    assert planned.stats["pdl"] == "on" and jit.stats["pdl"] == "off"
    (plan,) = planned.forward.plans.values()
    assert all(launch.kernel.metadata.launch_pdl for launch in plan.launches)
    cuda, value = ctypes.CDLL("libcuda.so.1"), ctypes.c_int()
    fitted = 0
    for launch in plan.launches:
        percent = fitted_carveout(launch.kernel, launch.grid[0] * launch.grid[1] * launch.grid[2], xs[0].device)
        assert (launch.function != launch.kernel.function) == (percent is not None)
        if percent is not None:
            fitted += 1
            assert cuda.cuFuncGetAttribute(ctypes.byref(value), 9, ctypes.c_void_p(launch.function)) == 0
            assert value.value == percent, (value.value, percent)
    assert fitted > 0
    with torch.no_grad():
        outs = []
        for x in xs + xs[:1]:  # each new input read where the recorded forward read its own
            expect = jit.forward(x).clone()
            got = planned.forward(x).clone()
            assert got.equal(expect), (got - expect).abs().max()
            outs.append(got)
        assert not outs[0].equal(outs[1]) and outs[0].equal(outs[3])
