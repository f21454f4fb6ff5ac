"""Learning-rate schedules: what a SPEC's `scheduler(optimizer)` makes, and when it steps.

`scheduler(optimizer)` returns a torch LR scheduler, or `{"scheduler": s, "interval":
"epoch" | "step"}` (as Lightning's `configure_optimizers` does); "epoch" is the default.
Whoever owns the optimizer steps the schedule: the coordinator under sync, ssp and async
(a step is a version, an epoch a pass of samples over every worker's shard), each worker
under average (a step is a local step, an epoch a pass over its own shard).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

SchedulerFactory = Callable[[torch.optim.Optimizer], Any]
INTERVALS = ("epoch", "step")


@dataclass
class Schedule:
    scheduler: torch.optim.lr_scheduler.LRScheduler
    interval: Literal["epoch", "step"]

    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])


def make_schedule(factory: SchedulerFactory, optimizer: torch.optim.Optimizer) -> Schedule:
    """`factory(optimizer)` as a Schedule, or ValueError saying what it returned instead."""
    made = factory(optimizer)
    interval: Any = "epoch"
    if isinstance(made, Mapping):
        unknown = set(made) - {"scheduler", "interval"}
        interval = made.get("interval", "epoch")
        if unknown or interval not in INTERVALS:
            raise ValueError(
                "scheduler(optimizer) returned a dict: it takes only 'scheduler' and "
                f"'interval' ('epoch' or 'step'), got {sorted(map(str, made))} with interval "
                f"{interval!r}")
        made = made.get("scheduler")
    if not isinstance(made, torch.optim.lr_scheduler.LRScheduler):
        raise ValueError(
            f"scheduler(optimizer) returned {type(made).__name__}, not a torch LR scheduler: "
            "return the one it makes on that optimizer (StepLR(optimizer, ...), say), or "
            "{'scheduler': it, 'interval': 'epoch' or 'step'}")
    if made.optimizer is not optimizer:
        raise ValueError("scheduler(optimizer) returned a scheduler of another optimizer: "
                         "make it on the optimizer it is given")
    return Schedule(made, interval)
