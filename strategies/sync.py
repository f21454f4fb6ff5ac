"""Synchronous gradient averaging, with optional backup workers.

Version v is built from one gradient per live member, all computed on v; the coordinator
averages them (in worker order, so the result does not depend on arrival order), steps once
and publishes v+1, which releases the workers. A member that leaves after pushing still
counts for that version; one that leaves before no longer holds it up.

With `backups` K, the first (live - K) gradients of a version make the step and the rest
arrive late and are dropped (Chen et al. 2016, "Revisiting Distributed Synchronous SGD"):
up to K stragglers no longer set the pace.
"""

from __future__ import annotations

from typing import ClassVar

from tensorbus.strategies.base import (
    Apply,
    Arrived,
    Decision,
    Drop,
    DropReason,
    Event,
    Joined,
    Keep,
    Left,
    PushKind,
    Rhythm,
    Stall,
    Strategy,
    Tick,
    Wait,
)

_RHYTHM = Rhythm(push=PushKind.GRADIENT, local_steps=1, wait=Wait.NEWER)


class Sync(Strategy):
    name: ClassVar[str] = "sync"
    options: ClassVar[frozenset[str]] = frozenset({"backups"})

    def __init__(
        self,
        *,
        workers: int,
        backups: int = 0,
        stall_after_s: float = 30.0,
        rhythm: Rhythm = _RHYTHM,
    ) -> None:
        super().__init__(workers=workers, rhythm=rhythm, stall_after_s=stall_after_s)
        if not 0 <= backups < workers:
            raise ValueError(f"backups must be in 0..workers-1 ({workers - 1}), got {backups}")
        self.backups = backups
        self._held: dict[int, float] = {}  # worker -> when its update for `version` came
        self._stall_reported = 0.0  # waited_s at the last Stall, so each is said once a period

    def handle(self, event: Event) -> list[Decision]:
        match event:
            case Joined(worker, _):
                return self._join(worker)
            case Left(worker, _):
                self._leave(worker)
                return self._apply_if_complete()
            case Arrived(worker, version, now):
                if (drop := self._early(event)) is not None:
                    return drop
                self.clocks[worker] += 1  # pushed, whether taken or not
                if version < self.version:
                    late = DropReason.LATE if version == self.version - 1 else DropReason.STALE
                    return [Drop(worker, version, late)]
                if worker in self._held:
                    return [Drop(worker, version, DropReason.DUPLICATE)]
                self._held[worker] = now
                return [Keep(worker, version), *self._apply_if_complete()]
            case Tick(now):
                return self._stall(now)
        raise TypeError(f"not a strategy event: {event!r}")

    def quorum(self) -> int:
        """Updates that make a step: every live member (and any that pushed, then left),
        less the backups."""
        return max(1, len(self.members | self._held.keys()) - self.backups)

    def _apply_if_complete(self) -> list[Decision]:
        if not self._held or len(self._held) < self.quorum():
            return []
        apply = Apply(self.version, tuple(sorted(self._held)))
        self.version += 1
        self._held.clear()
        self._stall_reported = 0.0
        return [apply]

    def _stall(self, now: float) -> list[Decision]:
        if not self._held:
            return []
        waited = now - min(self._held.values())
        if waited - self._stall_reported < self.stall_after_s:
            return []
        self._stall_reported = waited
        missing = tuple(sorted(self.members - self._held.keys()))
        return [Stall(self.version, missing, waited)]
