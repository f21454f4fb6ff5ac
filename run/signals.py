"""SIGTERM and Ctrl-C on a coordinator: a graceful stop first, an interrupt the second time.

The first signal asks the coordinator to finish the update in flight, checkpoint, stop the
workers and return its summary (the process then exits 0). A second signal is not caught:
it interrupts at once, for a user who will not wait.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Sequence
from typing import Protocol, TypeVar

T = TypeVar("T")
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stoppable(Protocol):
    """A coordinator, or anything else that stops gracefully when asked."""

    def request_stop(self, why: str) -> None: ...


async def stopping_on_signals(
    coordinator: Stoppable | Sequence[Stoppable], work: Awaitable[T]
) -> T:
    """Await `work` (the coordinator's run, or a launch around it) with the signals routed
    to `request_stop` of the coordinator (of every shard, when given several). Outside the
    main thread signals cannot be caught, and the work runs as it is."""
    coordinators = list(coordinator) if isinstance(coordinator, Sequence) else [coordinator]
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []

    def on_signal(sig: signal.Signals) -> None:
        for s in installed:  # the next one interrupts
            loop.remove_signal_handler(s)
        installed.clear()
        for c in coordinators:
            c.request_stop(sig.name)

    try:
        for sig in SIGNALS:
            loop.add_signal_handler(sig, on_signal, sig)
            installed.append(sig)
    except (RuntimeError, ValueError):  # not the main thread: leave signals alone
        pass
    try:
        return await work
    finally:
        for s in installed:
            loop.remove_signal_handler(s)
