"""Learning-rate schedules: what a SPEC's `scheduler(optimizer)` makes, and when it steps.

`scheduler(optimizer)` returns a torch LR scheduler, or `{"scheduler": s, "interval":
"epoch" | "step"}` (as Lightning's `configure_optimizers` does); "epoch" is the default.
Whoever owns the optimizer steps the schedule: the coordinator under sync, ssp and async
(a step is a version, an epoch a pass of samples over every worker's shard), each worker
under average (a step is a local step, an epoch a pass over its own shard).
"""

from __future__ import annotations

import warnings
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
    epochs_stepped: int = 0  # epochs the scheduler has been stepped for ("epoch")

    def after_step(self, epochs_done: int | None) -> None:
        """An optimizer step was taken, `epochs_done` passes done by now (None: not
        known yet, counted once they are): step the scheduler at each step ("step"), or
        once for each epoch newly done ("epoch")."""
        if self.interval == "step":
            steps = 1
        elif epochs_done is None:
            return
        else:
            steps, self.epochs_stepped = epochs_done - self.epochs_stepped, epochs_done
        with warnings.catch_warnings():
            # The coordinator takes a plain SGD step without optimizer.step() (it reads
            # the lr and applies it itself: nodes.master), which the scheduler takes for a
            # schedule stepped before its optimizer.
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
            for _ in range(steps):
                self.scheduler.step()


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
