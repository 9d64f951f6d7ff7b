"""Rungs that fail on purpose, loaded through LADDER_EXTRA_TIERS by the isolation tests: a real segfault, a
Python exception, a hang past the timeout, a rung that computes a different function, one whose output varies
from call to call, one that hangs in its hot start, and an error that looks like rich markup."""
import ctypes
import time

import torch

from core.cell import Built
from core.placement import place_model
from tiers.base import PythonTier


class Segfault(PythonTier):
    name = "test-segfault"
    cannot_train = None

    def build(self, model, example, cell, store):
        ctypes.string_at(0)  # dereferences NULL: SIGSEGV in the child

    def build_train(self, model, example, cell, store, lr=None):  # train-to-accuracy's rungs crash as cells do
        ctypes.string_at(0)


class Raises(PythonTier):
    name = "test-raises"

    def build(self, model, example, cell, store):
        raise RuntimeError("deliberate failure in build")


class Hangs(PythonTier):
    name = "test-hangs"

    def build(self, model, example, cell, store):
        time.sleep(3600)


class WrongFunction(PythonTier):
    """The seed paper's mistake in miniature: a net that skips its last bias (the classifier's; a lone layer's
    BatchNorm's)."""

    name = "test-wrong"

    def build(self, model, example, cell, store):
        net = place_model(model, cell)
        with torch.no_grad():
            [m for m in net.modules() if getattr(m, "bias", None) is not None][-1].bias.zero_()
        return Built(forward=net)


class Varies(PythonTier):
    """The right function, each call's logits a little off the last's (as a kernel whose atomic sums land in another
    order each call): far inside parity's tolerance, not the same bits twice."""

    name = "test-varies"

    def build(self, model, example, cell, store):
        net, calls = place_model(model, cell), [0]

        def forward(x):
            calls[0] += 1
            return net(x) * (1 + 1e-6 * calls[0])
        return Built(forward=forward)


class HangsInItsHotStart(PythonTier):
    """Measures as eager does, then takes an hour over its hot start (as compile's max-autotune takes minutes)."""

    name = "test-slow-hot-start"
    batch_change = True

    def build(self, model, example, cell, store):
        return Built(forward=place_model(model, cell))

    def hot_start(self, built, example, cell):
        time.sleep(3600)


TIERS = [Segfault(), Raises(), Hangs(), WrongFunction(), Varies(), HangsInItsHotStart()]


class MarkupReason(PythonTier):
    """An error whose words look like rich markup: a path in brackets and a style tag."""

    name = "test-markup"

    def build(self, model, example, cell, store):
        raise RuntimeError("cannot open [/tmp/x] in [bold]build[/bold]")


TIERS.append(MarkupReason())
