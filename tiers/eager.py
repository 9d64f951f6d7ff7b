"""Rung `eager`: the torchvision model called from Python, under torch.inference_mode (the reference); in
training, the step of harness/train.py on the module as it is."""
from tiers.base import Built, PythonTier, place_model


class Eager(PythonTier):
    name = "eager"
    summary = "PyTorch eager (inference_mode)"
    cuda_graph = True
    batch_change = True

    cannot_train = None

    def build(self, model, example, cell):
        return Built(forward=place_model(model, cell))

    def build_train(self, model, example, cell, lr=None):
        from harness import train
        from harness.model import num_classes

        net = train.place_for_training(model, cell)
        return train.built_step(net, net, cell, num_classes(net), lr)


TIER = Eager()
