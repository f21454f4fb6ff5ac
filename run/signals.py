"""SIGTERM and Ctrl-C on a coordinator: a graceful stop first, an interrupt the second time.

The first signal asks the coordinator to finish the update in flight, checkpoint, stop the
workers and return its summary; the command then says what was saved and dies of the
signal (run.cli), as a stopped process should. A second signal is not caught: it
interrupts at once, for a user who will not wait.

SIGTERM or Ctrl-C on a worker: it leaves the run at once (its coordinator is told why and
goes on without it; a step being computed is not waited for), lets go of its shared memory,
then dies of the signal (`die_of`), so that whoever started it sees what a kill shows.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, TypeVar

T = TypeVar("T")
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stoppable(Protocol):
    """A coordinator, or anything else that stops gracefully when asked."""

    def request_stop(self, why: str) -> None: ...


async def stopping_on_signals(
    coordinator: Stoppable | Sequence[Stoppable], work: Awaitable[T],
    signals: Sequence[signal.Signals] = SIGNALS,
) -> T:
    """Await `work` (the coordinator's run, or a launch around it) with `signals` routed
    to `request_stop` of the coordinator (of every shard, when given several; a worker
    stops too: see `die_of`). Outside the main thread signals cannot be caught, and the
    work runs as it is."""
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
        for sig in signals:
            loop.add_signal_handler(sig, on_signal, sig)
            installed.append(sig)
    except (RuntimeError, ValueError):  # not the main thread: leave signals alone
        pass
    try:
        return await work
    finally:
        for s in installed:
            loop.remove_signal_handler(s)


def cancel_on_signals(signalled: list[signal.Signals]) -> Callable[[], None]:
    """Ctrl-C or SIGTERM cancel the current task (a launcher's, which then ends what it
    started before it ends itself), recorded in `signalled`; a second one acts as it
    would. Returns what undoes this, to call once the task is over. Outside the main
    thread signals cannot be caught, and nothing is done."""
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    assert task is not None
    signals = (signal.SIGINT, signal.SIGTERM)

    def undo() -> None:
        for s in signals:
            with contextlib.suppress(RuntimeError, ValueError):
                loop.remove_signal_handler(s)

    def on(sig: signal.Signals) -> None:
        undo()
        signalled.append(sig)
        task.cancel()

    try:
        for s in signals:
            loop.add_signal_handler(s, on, s)
    except (RuntimeError, ValueError):  # not the main thread: signals are not ours
        undo()
    return undo


def die_of(sig: signal.Signals) -> None:
    """End this process by `sig`, its default action, once a graceful stop is done: its
    parent reads the exit status a kill by `sig` gives (a shell's 128 + signal number)."""
    signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
