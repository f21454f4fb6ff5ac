"""Periodic weight averaging (local SGD), optionally with a DiLoCo-style outer optimizer.

Workers own their optimizers: each runs H local steps from the published weights, then
pushes its weights. The round is a barrier like sync's (so this is `Sync` with another
rhythm): when every live member's weights for version v are in, the coordinator averages
them and publishes v+1. With an outer optimizer, the coordinator instead treats
(published - average) as a gradient and takes one SGD step on it (with momentum and
Nesterov as configured; Douillard et al. 2023). With plain SGD and H = 1 this equals sync.
"""

from __future__ import annotations

from typing import ClassVar

from tensorbus.strategies.base import OuterOptimizer, PushKind, Rhythm, Wait
from tensorbus.strategies.sync import Sync


class PeriodicAveraging(Sync):
    name: ClassVar[str] = "average"
    options: ClassVar[frozenset[str]] = frozenset(
        {"average_every", "outer_lr", "outer_momentum", "nesterov"}
    )

    def __init__(
        self,
        *,
        workers: int,
        average_every: int = 8,
        outer_lr: float | None = None,
        outer_momentum: float = 0.0,
        nesterov: bool = False,
        stall_after_s: float = 30.0,
    ) -> None:
        if average_every < 1:
            raise ValueError(f"average_every must be at least 1, got {average_every}")
        rhythm = Rhythm(push=PushKind.WEIGHTS, local_steps=average_every, wait=Wait.NEWER)
        super().__init__(workers=workers, stall_after_s=stall_after_s, rhythm=rhythm)
        if outer_lr is None and (outer_momentum or nesterov):
            raise ValueError("outer_momentum or nesterov needs outer_lr")
        self.average_every = average_every
        self.outer = (
            OuterOptimizer(lr=outer_lr, momentum=outer_momentum, nesterov=nesterov)
            if outer_lr is not None else None
        )
