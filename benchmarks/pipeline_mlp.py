"""The pipeline benchmark's model: an MLP cut into stages, as a SPEC with stages().

`BENCH_PIPE_STAGES` (environment, default 2) stages, each a `Linear(W, W)` and a ReLU of
`BENCH_PIPE_WIDTH` (default 1024) features; the first takes 784 inputs, the last gives 10
classes. Every process of a run (the coordinator, the stage workers, and the
torch.distributed.pipelining ranks of the baseline) builds the same model from the
environment. The data are fixed random images: a step's time does not depend on pixels.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tensorbus.run.shards import Shards

SAMPLES = 4096


def shape() -> tuple[int, int]:
    """(stages, width) from the environment."""
    return int(os.environ.get("BENCH_PIPE_STAGES", "2")), int(os.environ.get("BENCH_PIPE_WIDTH", "1024"))


def stages() -> list[nn.Module]:
    count, width = shape()
    made: list[nn.Module] = []
    for s in range(count):
        layers: list[nn.Module] = [nn.Linear(784 if s == 0 else width, width), nn.ReLU()]
        if s == count - 1:
            layers.append(nn.Linear(width, 10))
        made.append(nn.Sequential(*layers))
    return made


def model() -> nn.Module:
    return nn.Sequential(*stages())


def images() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(SAMPLES, 784, generator=g), torch.randint(0, 10, (SAMPLES,), generator=g)


def data(rank: int, world_size: int, batch_size: int) -> Shards:
    x, y = images()
    return Shards(x, y, rank, world_size, batch_size)


def loss(output: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(output, target)
