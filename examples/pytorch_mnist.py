"""PyTorch's canonical MNIST example (pytorch/examples, mnist/main.py) as a tensorbus SPEC.

Its model, dropout, Adadelta (lr 1.0), StepLR per epoch (gamma 0.7), loss and input
normalisation are kept as they are. The images are Fashion-MNIST's, from Debian's
dataset-fashion-mnist package (MNIST itself is not installable here without a download):
the same 28x28 greyscale shape and 60k/10k split, a harder task.

    tensorbus local examples/pytorch_mnist.py --workers 2 --batch-size 32 --epochs 2

trains with 2 workers of batch 32 (the original's 64 in all, per version);
`python -m benchmarks pytorch_mnist` runs it beside the original loop in one process.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tensorbus.run.shards import Shards

MEAN, STD = 0.1307, 0.3081  # the original's normalisation, kept
SEED = 1  # the original's default --seed


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
    """(N x 1 x 28 x 28 normalised as the original does, N labels) of "train" or "t10k"."""
    fashion = _fashion()
    x, y = fashion._load(split)  # type: ignore[attr-defined]
    pixels = x * fashion.STD + fashion.MEAN  # type: ignore[attr-defined]  # back to [0, 1]
    return ((pixels - MEAN) / STD).view(-1, 1, 28, 28).contiguous(), y


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def model() -> nn.Module:
    return Net()


def data(rank: int, world_size: int, batch_size: int) -> Shards:
    x, y = images("train")
    return Shards(x, y, rank, world_size, batch_size, seed=SEED)


def loss(output: Tensor, target: Tensor) -> Tensor:
    return F.nll_loss(output, target)


def optimizer(params: object) -> torch.optim.Optimizer:
    return torch.optim.Adadelta(params, lr=1.0)  # type: ignore[arg-type]


def scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)  # per epoch


@torch.no_grad()
def evaluate(net: nn.Module) -> dict[str, float]:
    x, y = images("t10k")
    correct, total_loss = 0, 0.0
    for start in range(0, len(x), 1000):  # the original's test batch
        output = net(x[start:start + 1000])
        total_loss += F.nll_loss(output, y[start:start + 1000], reduction="sum").item()
        correct += int((output.argmax(dim=1) == y[start:start + 1000]).sum())
    return {"accuracy": correct / len(x), "test_loss": total_loss / len(x)}
