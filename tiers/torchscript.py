"""Rung `torchscript`: the model traced, frozen and optimize_for_inference'd, called from Python.
TorchScript is deprecated (FutureWarning from torch 2.10); the rung stays and reports that status."""
import torch

from tiers.base import Built, PythonTier, place_model
from tiers.torchscript_export import export_torchscript


class TorchScript(PythonTier):
    name = "torchscript"
    summary = "torch.jit.trace + freeze + optimize_for_inference (deprecated since torch 2.10)"
    cuda_graph = True
    batch_change = True

    def build(self, model, example, cell):
        module, facts = export_torchscript(place_model(model, cell), example)

        def forward(x):
            with torch.inference_mode(False), torch.no_grad():  # frozen graphs reject inference-mode tensors
                return module(x)

        return Built(forward=forward, stats=facts)


TIER = TorchScript()
