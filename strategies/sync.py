"""Synchronous gradient averaging: one optimizer step per version, on every live worker's gradient.

Version v is built from one gradient per live member, all computed on v; the coordinator
averages them (in worker order, so the result does not depend on arrival order), steps once
and publishes v+1, which releases the workers. Before the first step, it waits for the
configured number of workers, so that no early joiner trains alone. A member that leaves
after pushing still counts for that version; one that leaves before no longer holds it up.
"""

from __future__ import annotations

from typing import ClassVar

from strategies.base import (
    Apply,
    Arrived,
    Decision,
    Drop,
    DropReason,
    Joined,
    Keep,
    Left,
    PushKind,
    Rhythm,
    Stall,
    Strategy,
    Tick,
    Event,
)


class Sync(Strategy):
    name: ClassVar[str] = "sync"
    rhythm: ClassVar[Rhythm] = Rhythm(push=PushKind.GRADIENT, local_steps=1, wait=True)

    def __init__(self, *, workers: int, version: int = 0, stall_after_s: float = 30.0) -> None:
        super().__init__(workers=workers)
        if not stall_after_s > 0:  # also refuses NaN
            raise ValueError(f"stall_after_s must be positive, got {stall_after_s}")
        self.version = version  # the version being built
        self.stall_after_s = stall_after_s
        self._members: set[int] = set()
        self._held: dict[int, float] = {}  # worker -> when its gradient for `version` came
        self._started = False
        self._stall_reported = 0.0  # waited_s at the last Stall, so each is said once a period

    def handle(self, event: Event) -> list[Decision]:
        match event:
            case Joined(worker, _):
                self._members.add(worker)
                return []
            case Left(worker, now):
                self._members.discard(worker)
                return self._apply_if_complete()
            case Arrived(worker, version, _) if worker not in self._members:
                return [Drop(worker, version, DropReason.NOT_MEMBER)]
            case Arrived(worker, version, _) if version < self.version:
                return [Drop(worker, version, DropReason.STALE)]
            case Arrived(worker, version, _) if version > self.version:
                return [Drop(worker, version, DropReason.AHEAD)]
            case Arrived(worker, version, _) if worker in self._held:
                return [Drop(worker, version, DropReason.DUPLICATE)]
            case Arrived(worker, version, now):
                self._held[worker] = now
                return [Keep(worker, version), *self._apply_if_complete()]
            case Tick(now):
                return self._stall(now)
        raise TypeError(f"not a strategy event: {event!r}")

    def _apply_if_complete(self) -> list[Decision]:
        if not self._held:
            return []
        if not self._started and len(self._members) < self.workers:
            return []  # still gathering the first N workers
        if not self._members <= self._held.keys():
            return []
        apply = Apply(self.version, tuple(sorted(self._held)))
        self.version += 1
        self._held.clear()
        self._started = True
        self._stall_reported = 0.0
        return [apply]

    def _stall(self, now: float) -> list[Decision]:
        if not self._held:
            return []
        waited = now - min(self._held.values())
        if waited - self._stall_reported < self.stall_after_s:
            return []
        self._stall_reported = waited
        missing = tuple(sorted(self._members - self._held.keys()))
        return [Stall(self.version, missing, waited)]
