"""Consistency models: pure policy objects that turn coordinator events into decisions."""

from strategies.base import (
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
)
from strategies.sync import Sync

__all__ = [
    "Apply",
    "Arrived",
    "Decision",
    "Drop",
    "DropReason",
    "Event",
    "Joined",
    "Keep",
    "Left",
    "PushKind",
    "Rhythm",
    "Stall",
    "Strategy",
    "Sync",
    "Tick",
]
