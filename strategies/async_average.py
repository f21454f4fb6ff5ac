"""Asynchronous averaging (asynchronous local SGD): average without waiting for the others.

Workers own their optimizers, as under `average`: each runs H local steps from the newest
weights it has, then pushes what those steps changed, and goes on from the version that
comes back with its change applied. Nobody waits for anybody: a fast worker pushes more
often than a slow one, and each change is applied as it arrives, onto whatever the
coordinator holds by then (it was computed on an older version: that is the asynchrony).

Each change is applied at 1/W, W the number of workers, so that W changes move the weights
as one average of W does under `average` (as async scales gradients by 1/W:
strategies.stale). A change is what the worker's weights moved since the version it
loaded, which only the worker knows: so pushes are changes, quantized with error feedback
(`--compress int8`, the default here, or `int4`: bus.quantize), and the coordinator takes
them from its current weights (nodes.master).

With one worker this is `average` exactly. After Liu et al. 2024, "Asynchronous Local-SGD
Training for Language Modeling", without its delayed Nesterov momentum and its dynamic
local steps.
"""

from __future__ import annotations

from typing import ClassVar

from tensorbus.strategies.base import PushKind, Rhythm, Wait
from tensorbus.strategies.stale import StaleSync


class AsyncAveraging(StaleSync):
    name: ClassVar[str] = "async-average"
    options: ClassVar[frozenset[str]] = frozenset({"average_every"})
    changes_pushed: ClassVar[bool] = True

    def __init__(self, *, workers: int, average_every: int = 8,
                 stall_after_s: float = 30.0) -> None:
        if average_every < 1:
            raise ValueError(f"average_every must be at least 1, got {average_every}")
        # (StaleSync without a bound, its scale 1/W: `momentum_correction` scales each
        # update so; the coordinator has no optimizer here for it to lower.)
        super().__init__(workers=workers, staleness=None, momentum_correction=True,
                         stall_after_s=stall_after_s)
        # A worker pushes, then goes on from the version its answer names (its change in it).
        self.rhythm = Rhythm(push=PushKind.WEIGHTS, local_steps=average_every, wait=Wait.ANSWERED)
        self.average_every = average_every

    def remedies(self) -> tuple[str, ...]:
        return ()
