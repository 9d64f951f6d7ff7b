"""Rung `torchscript`: the model traced, frozen and optimize_for_inference'd, called from Python. In training, the
model traced in train mode (not frozen: its weights train), stepped through autograd by core/train.py.
TorchScript is deprecated (FutureWarning from torch 2.10); the rung stays and reports that status."""
import time
import warnings

import torch

from core import train
from core.cell import Built
from core.model import num_classes
from core.placement import place_model
from tiers.base import CUDNN_BENCHMARK, PythonTier
from tiers.exports.torchscript import export_torchscript


class TorchScript(PythonTier):
    name = "torchscript"
    summary = "torch.jit.trace + freeze + optimize_for_inference (deprecated since torch 2.10)"
    cuda_graph = True
    batch_change = True
    cannot_train = None
    options = CUDNN_BENCHMARK

    def build(self, model, example, cell, store):
        module, facts = export_torchscript(place_model(model, cell), example)

        def forward(x):
            with torch.inference_mode(False), torch.no_grad():  # frozen graphs reject inference-mode tensors
                return module(x)

        return Built(forward=forward, stats=facts)

    def build_train(self, model, example, cell, store, lr=None):
        net = train.place_for_training(model, cell)
        t = time.perf_counter()
        before = {k: v.clone() for k, v in net.named_buffers()}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            traced = torch.jit.trace(net, example.clone(), check_trace=False)  # BatchNorm traced in train mode
        with torch.no_grad():  # the tracing forward updated the running statistics: back to the run's weights
            for k, v in traced.named_buffers():
                v.copy_(before[k])
        deprecation = next((str(w.message) for w in caught if "deprecat" in str(w.message).lower()), None)
        facts = {"torchscript_trace_s": time.perf_counter() - t, "torchscript_deprecation": deprecation}
        return train.built_step(traced, traced, cell, num_classes(net), lr, facts)


TIER = TorchScript()
