"""The benchmarks' model: an MLP of about 1M or 10M parameters on Fashion-MNIST, as a SPEC.

`BENCH_PARAMS` (environment: `1M`, `10M` or `50M`, default 1M) picks the size, so that one file
serves `tensorbus local`, the DDP baseline and the single-process baseline alike, and every
process of a run (workers inherit the environment) builds the same model.

    784 -> H -> H -> 10 with H = 680 (1.0M parameters), H = 2820 (10.2M) or H = 6650
    (49.5M: benchmarks/shards.py)

Inputs are Fashion-MNIST's training images when Debian's dataset-fashion-mnist is
installed, else fixed random images of the same shape (timing does not depend on pixels).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tensorbus.run.shards import Shards

HIDDEN = {"1M": 680, "10M": 2820, "50M": 6650}
SAMPLES = 8192  # enough batches of 64 for every timed run; loaded once per process


def size() -> str:
    name = os.environ.get("BENCH_PARAMS", "1M")
    if name not in HIDDEN:
        raise ValueError(f"BENCH_PARAMS={name!r}: choose one of {sorted(HIDDEN)}")
    return name


def model() -> nn.Module:
    h = HIDDEN[size()]
    return nn.Sequential(nn.Linear(784, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 10))


def images() -> tuple[Tensor, Tensor]:
    try:
        from examples.fashion_mnist import _load
        x, y = _load("train")
        return x[:SAMPLES], y[:SAMPLES]
    except (ImportError, FileNotFoundError):
        g = torch.Generator().manual_seed(0)
        return torch.randn(SAMPLES, 784, generator=g), torch.randint(0, 10, (SAMPLES,), generator=g)


def data(rank: int, world_size: int, batch_size: int) -> Shards:
    x, y = images()
    return Shards(x, y, rank, world_size, batch_size)


def loss(output: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(output, target)
