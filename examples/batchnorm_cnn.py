"""Fashion-MNIST with a small CNN that has BatchNorm: a tensorbus SPEC file.

Two convolution blocks (conv, BatchNorm, ReLU, max-pool) and a linear layer, trained with
SGD and momentum. BatchNorm's running statistics are buffers, not parameters: they travel
with the weights (each worker's with its pushes, their mean back with every version), so
the coordinator's evaluate() scores the model with the statistics training made.

    tensorbus local examples/batchnorm_cnn.py --workers 2 --batch-size 32 --epochs 1

`python -m benchmarks batchnorm` runs it beside the same training in one process.
The images come from Debian's dataset-fashion-mnist package (examples/fashion_mnist.py
reads them); nothing is downloaded.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tensorbus.run.shards import Shards

SEED = 0  # the shuffles of the data: epoch e uses SEED + e


def _fashion() -> object:
    """examples/fashion_mnist.py, for its reader of Debian's files."""
    path = Path(__file__).with_name("fashion_mnist.py")
    spec = importlib.util.spec_from_file_location("_tensorbus_fashion_mnist", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def images(split: str) -> tuple[Tensor, Tensor]:
    """(N x 1 x 28 x 28 normalised images, N labels) of "train" or "t10k"."""
    x, y = _fashion()._load(split)  # type: ignore[attr-defined]
    return x.view(-1, 1, 28, 28).contiguous(), y


def model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 7 * 7, 10),
    )


def data(rank: int, world_size: int, batch_size: int) -> Shards:
    x, y = images("train")
    return Shards(x, y, rank, world_size, batch_size, seed=SEED)


def loss(output: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(output, target)


def optimizer(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)  # type: ignore[arg-type]


@torch.no_grad()
def evaluate(net: nn.Module) -> dict[str, float]:
    """Accuracy and mean cross-entropy on the 10k test images (in eval mode: BatchNorm
    normalises with its running statistics)."""
    x, y = images("t10k")
    correct, total_loss = 0, 0.0
    for start in range(0, len(x), 1000):
        output = net(x[start:start + 1000])
        total_loss += F.cross_entropy(output, y[start:start + 1000], reduction="sum").item()
        correct += int((output.argmax(dim=1) == y[start:start + 1000]).sum())
    return {"accuracy": correct / len(x), "test_loss": total_loss / len(x)}
