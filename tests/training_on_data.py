"""train-to-accuracy's contract for a C++ training rung (--train-data, --states), checked against eager: the program
trains a 10-class network on the images, labels, batch order and per-step rates given, and its state after each
epoch must be eager's after the same steps. Shared by the libtorch (CPU) and cudnn (GPU) tests."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from core import train
from core.cell import Cell
from core.model import make_input, write_input, write_weights
from core.placement import set_math_mode
from harness.child.contract import TRAIN_PHASES, TRAIN_RESULT_KEYS, Protocol, contract_argv

IMAGES, BATCH, EPOCHS = 16, 8, 2
# Each step's rate, up to 5x apart: a rate left constant, or read once, fails.
RATES = torch.tensor([[0.05, 0.01], [0.03, 0.02]])


def check_training_on_data(program: list[str], initial: torch.nn.Module, cell: Cell, protocol: Protocol,
                           tmp_path: Path) -> None:
    """`initial` has a 10-class head; `cell` the rung, model, batch BATCH, res, device and dtype. Every image has
    its own content and the labels differ from batch to batch, so a batch that arrives stale or half-copied fails."""
    torch.manual_seed(0)
    x, y = make_input(IMAGES, cell.res), torch.arange(IMAGES) % 10
    order = torch.stack([torch.randperm(IMAGES, generator=torch.Generator().manual_seed(e)) for e in range(EPOCHS)])
    write_weights(initial, tmp_path / "weights.safetensors")
    save_file({"x": x, "y": y.float(), "order": order.float(), "lr": RATES}, str(tmp_path / "train.safetensors"))
    write_input(x[:BATCH], tmp_path / "input.safetensors")
    (tmp_path / "states").mkdir()
    argv = contract_argv(program, cell, {
        "weights": tmp_path / "weights.safetensors", "input": tmp_path / "input.safetensors",
        "output": tmp_path / "output.safetensors", "result": tmp_path / "result.json"}, protocol, {
        "train-data": str(tmp_path / "train.safetensors"), "states": str(tmp_path / "states"),
        "lr": repr(RATES[0, 0].item())})
    proc = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [line[8:] for line in proc.stdout.splitlines() if line.startswith("@@phase ")] == list(TRAIN_PHASES)
    result = json.loads((tmp_path / "result.json").read_text())
    assert set(result) == TRAIN_RESULT_KEYS and [e["epoch"] for e in result["epochs"]] == list(range(1, EPOCHS + 1))

    set_math_mode(cell.dtype)
    start = {k: v.clone() for k, v in initial.state_dict().items()}
    net = train.place_for_training(initial, cell)
    lr = torch.tensor(RATES[0, 0].item())
    step = train.make_step(net, net, cell, num_classes=10, lr=lr)
    memory_format = torch.channels_last if cell.channels_last else torch.contiguous_format

    def at_rate(rate: float, idx: torch.Tensor) -> torch.Tensor:
        lr.fill_(rate)
        return step(x[idx].to(cell.device).contiguous(memory_format=memory_format), y[idx].to(cell.device))

    for epoch, perm in enumerate(order, start=1):  # parity over steps, as a training cell's (core/train.py)
        losses = [at_rate(rate, idx) for rate, idx in zip(RATES[epoch - 1].tolist(), perm.view(-1, BATCH))]
        loss = torch.stack(losses).float().mean().reshape(1).cpu()
        state = load_file(str(tmp_path / "states" / f"epoch-{epoch}.safetensors"))
        mine = {**state, "loss": torch.tensor([result["epochs"][epoch - 1]["train_loss"]])}
        ref = {k: v.cpu() for k, v in train.state_of(net).items()}
        verdict = train.compare(mine, {**ref, "loss": loss}, start, cell.dtype)
        assert verdict["ok"], (epoch, verdict)
