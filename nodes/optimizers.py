"""The optimizer a SPEC's optimizer(params) makes, checked for what it is: anything but a
torch optimizer would be taken for no optimizer at all, and steps would be wrong in silence
(a coordinator without one averages pushed weights)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def make_optimizer(factory: OptimizerFactory, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """`factory(params)`, or ValueError saying what it returned instead of an optimizer."""
    made = factory(params)
    if not isinstance(made, torch.optim.Optimizer):
        # (A ValueError: the CLI says those in one line, as the user's; a TypeError is ours.)
        raise ValueError(  # noqa: TRY004
            f"optimizer(params) returned {type(made).__name__}, not a torch.optim.Optimizer: "
            "return the optimizer it makes (or define no optimizer() for SGD with --lr)")
    return made
