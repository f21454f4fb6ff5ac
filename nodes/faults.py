"""Faults injected into a worker on purpose, for local experiments and tests.

`slow_s` makes every local step that much slower (a straggler): the worker waits it out on
its event loop before each compute (`delay`), so that a virtual clock (bus.clock) counts
it as the time it stands for. `crash_at` makes the worker process die abruptly, by SIGKILL
to itself, when it is about to take that step (counted from 0, so `crash_at=5` dies after
five steps). Nothing here runs unless asked for.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Faults:
    slow_s: float = 0.0
    crash_at: int | None = None

    def __post_init__(self) -> None:
        if not self.slow_s >= 0:
            raise ValueError(f"slow_s must be at least 0, got {self.slow_s}")
        if self.crash_at is not None and self.crash_at < 0:
            raise ValueError(f"crash_at must be at least 0, got {self.crash_at}")

    def delay(self, steps: int) -> float:
        """Seconds to wait before a compute of `steps` local steps."""
        return self.slow_s * steps

    def before_step(self, step: int) -> None:
        """Called in the compute thread before local step `step`."""
        if self.crash_at is not None and step >= self.crash_at:
            os.kill(os.getpid(), signal.SIGKILL)  # abrupt on purpose: no Leave, no cleanup
