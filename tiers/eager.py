"""Rung `eager`: the torchvision model called from Python, under torch.inference_mode (the reference)."""
from tiers.base import Built, PythonTier, place_model


class Eager(PythonTier):
    name = "eager"
    summary = "PyTorch eager (inference_mode)"
    cuda_graph = True
    batch_change = True

    def build(self, model, example, cell):
        return Built(forward=place_model(model, cell))


TIER = Eager()
