"""Consistency models: pure policy objects that turn coordinator events into decisions.

`STRATEGIES` maps each model's name (as `--strategy` takes it) to its class. A new model
is one file with a `Strategy` subclass, and one line here.
"""

from tensorbus.strategies.async_average import AsyncAveraging
from tensorbus.strategies.average import OuterOptimizer, PeriodicAveraging
from tensorbus.strategies.base import (
    Apply,
    Arrived,
    Decision,
    Drop,
    DropReason,
    Event,
    Hold,
    Joined,
    Keep,
    Left,
    PushKind,
    Release,
    Rhythm,
    Stall,
    Strategy,
    Tick,
    Wait,
)
from tensorbus.strategies.stale import Async, StaleSync
from tensorbus.strategies.sync import Sync

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (Sync, StaleSync, Async, PeriodicAveraging, AsyncAveraging)
}

__all__ = [
    "STRATEGIES",
    "Apply",
    "Arrived",
    "Async",
    "AsyncAveraging",
    "Decision",
    "Drop",
    "DropReason",
    "Event",
    "Hold",
    "Joined",
    "Keep",
    "Left",
    "OuterOptimizer",
    "PeriodicAveraging",
    "PushKind",
    "Release",
    "Rhythm",
    "StaleSync",
    "Stall",
    "Strategy",
    "Sync",
    "Tick",
    "Wait",
]
