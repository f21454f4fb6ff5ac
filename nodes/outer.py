"""Delayed Nesterov: the outer optimizer of async-average with outer momentum.

Liu et al. 2024 ("Asynchronous Local-SGD Training for Language Modeling", Algorithm 3,
with its momentum activation c = 0): under asynchronous local SGD each worker's change is
applied as it comes, and momentum taken on every change keeps pushing the weights along
stale changes. Delayed, the momentum moves only every N steps, on their sum:

    every step:       w -= lr * g;  s += g
    every N-th step:  m = momentum * m + s;  w -= lr * momentum * m;  s = 0

where g is the step's gradient: the strategy's change times 1/N (strategies.async_average).
With N = 1 it is SGD with Nesterov momentum (w -= lr * (g + momentum * m), m taken first),
the same arithmetic up to the order of float additions.

A torch optimizer, so that a checkpoint keeps its state (per parameter: the momentum, the
sum of the steps since it last moved, and their count) as it keeps any optimizer's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class DelayedNesterov(torch.optim.Optimizer):
    def __init__(self, params: Iterable[torch.nn.Parameter], *, lr: float, momentum: float,
                 every: int) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be positive, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if every < 1:
            raise ValueError(f"every must be at least 1, got {every}")
        super().__init__(params, {"lr": lr, "momentum": momentum, "every": every})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            lr, momentum, every = group["lr"], group["momentum"], group["every"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["steps"] = 0
                    state["sum"] = torch.zeros_like(param)
                    state["momentum_buffer"] = torch.zeros_like(param)
                grad = param.grad
                param.add_(grad, alpha=-lr)
                state["sum"].add_(grad)
                state["steps"] += 1
                if state["steps"] % every == 0:
                    buffer = state["momentum_buffer"]
                    buffer.mul_(momentum).add_(state["sum"])
                    param.add_(buffer, alpha=-lr * momentum)
                    state["sum"].zero_()
        return loss
