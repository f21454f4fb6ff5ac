"""The strategy interface: events in, decisions out, no I/O and no clock of its own.

A strategy decides what the coordinator does with each update and when workers may go on.
The coordinator feeds it events (a worker joined or left, an update arrived, time passed,
with `now` supplied by the caller) and carries out the decisions it returns. It also states
the rhythm its workers follow (`Rhythm`), which the coordinator hands each worker on join,
so that no node branches on the strategy's name.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar


class PushKind(str, enum.Enum):
    GRADIENT = "gradient"  # workers push gradients; the coordinator owns the optimizer
    WEIGHTS = "weights"  # workers own optimizers and push weights to be averaged


@dataclass(frozen=True, kw_only=True)
class Rhythm:
    """What a worker does between pushes."""

    push: PushKind
    local_steps: int = 1  # optimizer steps (or gradients) between pushes
    wait: bool = True  # after a push, wait for a newer version before computing again


class DropReason(str, enum.Enum):
    """Why an update was not used; counted in the summary under these names."""

    STALE = "stale"  # computed on a version older than the one being built
    AHEAD = "ahead"  # claims a version the coordinator has not published
    DUPLICATE = "duplicate"  # a second update from the same worker for the same version
    NOT_MEMBER = "not_member"  # the sender is not (or no longer) a training member
    NOT_FINITE = "not_finite"  # holds NaN or infinity


# Events -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Joined:
    worker: int
    now: float


@dataclass(frozen=True)
class Left:
    worker: int
    now: float


@dataclass(frozen=True)
class Arrived:
    worker: int
    version: int  # the version the update was computed on
    now: float


@dataclass(frozen=True)
class Tick:
    now: float


Event = Joined | Left | Arrived | Tick


# Decisions ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Keep:
    """Hold this update; a later Apply names it."""

    worker: int
    version: int


@dataclass(frozen=True)
class Drop:
    """Discard this update, and count it under `reason`."""

    worker: int
    version: int
    reason: DropReason


@dataclass(frozen=True)
class Apply:
    """Average the held updates of `workers` (computed on `version`), take one step, publish."""

    version: int
    workers: tuple[int, ...]


@dataclass(frozen=True)
class Stall:
    """Version `version` has waited `waited_s` seconds for `waiting_for`; worth a log line."""

    version: int
    waiting_for: tuple[int, ...]
    waited_s: float


Decision = Keep | Drop | Apply | Stall


class Strategy(ABC):
    """A consistency model. Subclasses are small: state, `handle`, and their rhythm."""

    name: ClassVar[str]
    rhythm: ClassVar[Rhythm]

    def __init__(self, *, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.workers = workers  # how many to wait for before the first step

    @abstractmethod
    def handle(self, event: Event) -> list[Decision]:
        """Take one event, return what the coordinator must do, in order."""
