"""Asynchronous averaging (asynchronous local SGD): average without waiting for the others.

Workers own their optimizers, as under `average`: each runs H local steps from the newest
weights it has, then pushes what those steps changed, and goes on from the version that
comes back with its change applied. Nobody waits for anybody: a fast worker pushes more
often than a slow one, and each change is applied as it arrives, onto whatever the
coordinator holds by then (it was computed on an older version: that is the asynchrony).

Each change is applied at 1/N, N the number of workers (or `momentum_every`), so that N
changes move the weights as one average of N does under `average` (as async scales
gradients by 1/W: strategies.stale). A change is what the worker's weights moved since the
version it loaded, which only the worker knows: so pushes are changes, quantized with
error feedback (`--compress int8`, the default here, or `int4`: bus.quantize), and the
coordinator takes them from its current weights (nodes.master).

After Liu et al. 2024, "Asynchronous Local-SGD Training for Language Modeling", two
remedies for what asynchrony does to local SGD, both optional:

- Delayed Nesterov (`outer_lr`, `outer_momentum`, `momentum_every` N): momentum taken on
  every change lets the stale ones push the weights on and on; instead each change moves
  the weights at once by -lr/N of itself, and every N changes their sum is folded into
  the momentum, which moves them once (nodes.outer.DelayedNesterov, their Algorithm 3).
- Dynamic local steps (`dynamic_steps`): each worker's H is scaled to its speed, H times
  its speed over the fastest live worker's (at least 1), so that every worker pushes
  about as often and a slow worker's changes are no staler than a fast one's. A worker is
  told its H in the answer to each push; its speed is the samples a second of computing
  its pushes report.

With one worker and neither remedy this is `average` exactly.
"""

from __future__ import annotations

import math
from typing import ClassVar

from tensorbus.strategies.base import (
    Arrived,
    Decision,
    Event,
    Left,
    OuterOptimizer,
    PushKind,
    Rhythm,
    Wait,
)
from tensorbus.strategies.stale import StaleSync

# How much one push's measure of a worker's speed moves the speed kept for it: half. One
# push's timing on a shared machine is noisy (a pause of the process, another's burst),
# and a worker whose speed truly changed is followed within a few pushes.
SPEED_WEIGHT = 0.5


class AsyncAveraging(StaleSync):
    name: ClassVar[str] = "async-average"
    options: ClassVar[frozenset[str]] = frozenset(
        {"average_every", "outer_lr", "outer_momentum", "momentum_every", "dynamic_steps"})
    changes_pushed: ClassVar[bool] = True

    def __init__(self, *, workers: int, average_every: int = 8, outer_lr: float | None = None,
                 outer_momentum: float = 0.0, momentum_every: int | None = None,
                 dynamic_steps: bool = False, stall_after_s: float = 30.0) -> None:
        if average_every < 1:
            raise ValueError(f"average_every must be at least 1, got {average_every}")
        if outer_lr is None and outer_momentum:
            raise ValueError("outer_momentum needs outer_lr")
        if momentum_every is not None and not outer_momentum:
            raise ValueError("momentum_every delays Nesterov momentum: it needs outer_momentum")
        # (StaleSync without a bound, each update at _share(): `momentum_correction` scales
        # them so; the coordinator's optimizer, if any, is the outer one, not lowered.)
        super().__init__(workers=workers, staleness=None, momentum_correction=True,
                         stall_after_s=stall_after_s)
        # A worker pushes, then goes on from the version its answer names (its change in it).
        self.rhythm = Rhythm(push=PushKind.WEIGHTS, local_steps=average_every, wait=Wait.ANSWERED)
        self.average_every = average_every
        self.every = momentum_every if momentum_every is not None else workers
        self.outer = (OuterOptimizer(lr=outer_lr, momentum=outer_momentum,
                                     nesterov=bool(outer_momentum),
                                     every=self.every if outer_momentum else 1)
                      if outer_lr is not None else None)
        self.dynamic_steps = dynamic_steps
        self._speeds: dict[int, float] = {}  # member -> samples a second, smoothed

    def remedies(self) -> tuple[str, ...]:
        return ()

    def corrected_momentum(self, momentum: float) -> float:
        """As asked: the outer momentum is delayed (see the module's docstring), not lowered."""
        return momentum

    def _share(self) -> float:
        return 1.0 / self.every

    def handle(self, event: Event) -> list[Decision]:
        match event:
            case Arrived(worker=worker, speed=speed) if speed > 0 and worker in self.members:
                kept = self._speeds.get(worker)
                self._speeds[worker] = (speed if kept is None
                                        else kept + SPEED_WEIGHT * (speed - kept))
            case Left(worker=worker):
                self._speeds.pop(worker, None)
        return super().handle(event)

    def local_steps(self, worker: int) -> int | None:
        """With dynamic steps, H scaled by the worker's speed over the fastest member's."""
        if not self.dynamic_steps:
            return None
        speed = self._speeds.get(worker)
        live = [self._speeds[m] for m in self.members if m in self._speeds]
        if speed is None or not live:
            return self.average_every
        # (The ratio first: the fastest's is exactly 1, its H exactly H.)
        return max(1, math.floor(self.average_every * (speed / max(live))))
