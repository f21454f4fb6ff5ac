"""Test helper: the one setting in which topologies are compared weight for weight.

The relay, shard and colocated tests each train the digits example two ways and compare
the weights: they must start from the same model, use the same optimizer and batch, and
measure the difference the same way, or a passing comparison says nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from specs import load_example

digits = load_example("digits")
LR, MOMENTUM, BATCH = 0.05, 0.9, 16


def sgd(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer every node of a compared run uses (momentum, so its state matters)."""
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def initial() -> torch.nn.Module:
    """The digits model as every compared run starts it (seed 0)."""
    torch.manual_seed(0)
    return digits.model()


def max_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """The largest absolute difference between two models' parameters."""
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters(), strict=True))
