"""Rung `eager`: the torchvision model called from Python, under torch.inference_mode (the reference); in
training, the step of core/train.py on the module as it is."""
from core import train
from core.cell import Built
from core.layers import module_scopes
from core.model import num_classes
from core.placement import place_model
from tiers.base import CUDNN_BENCHMARK, PythonTier


class Eager(PythonTier):
    name = "eager"
    summary = "PyTorch eager (inference_mode)"
    cuda_graph = True
    batch_change = True
    cannot_train = None
    options = CUDNN_BENCHMARK

    def parity_recipe(self, cell):
        return "eager"

    def build(self, model, example, cell, store):
        module = place_model(model, cell)
        return Built(forward=module, layer_scopes=lambda: module_scopes(module))

    def build_train(self, model, example, cell, store, lr=None):
        net = train.place_for_training(model, cell)
        built = train.built_step(net, net, cell, num_classes(net), lr)
        built.layer_scopes = lambda: module_scopes(net)
        return built


TIER = Eager()
