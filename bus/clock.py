"""Where the nodes read the time: a seam, so that liveness can be tested without waiting.

Nodes read two clocks: a monotonic one for every duration and deadline (silence, join
and stop timeouts, back-off), and the wall clock for what they record (metrics, traces).
They take a `Clock` (by default `SYSTEM_CLOCK`: `time.monotonic` and `time.time`); what
they await (`asyncio.sleep`, `wait_for`) runs on the event loop's own clock.

`VirtualTimeLoop` is an event loop whose clock jumps: when nothing is ready to run and no
thread is working for it, it moves its time straight to the next timer instead of
sleeping. Driven with a `LoopClock` on it, a coordinator or worker lives through ten
seconds of silence, a join timeout or a back-off in milliseconds, with every timer in
the order real time would give. It is for one-loop tests over an in-memory transport
(`bus.memory`): bytes in flight on real sockets (TCP's I/O threads) are not seen as
pending work, and would be outrun by the jumps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import selectors
import time
from collections.abc import Callable
from typing import Any, Final, Protocol, TypeVar, TypeVarTuple

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes back: for durations and deadlines."""
        ...

    def wall(self) -> float:
        """Seconds since the epoch: for what is recorded."""
        ...


class SystemClock:
    """The machine's clocks."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()


SYSTEM_CLOCK: Final = SystemClock()


class LoopClock:
    """The clock of an event loop (a `VirtualTimeLoop`'s: virtual seconds), with the wall
    clock as it was when made, moved on by as much."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._epoch = time.time() - loop.time()

    def monotonic(self) -> float:
        return self._loop.time()

    def wall(self) -> float:
        return self._epoch + self._loop.time()


IDLE_LIMIT_S: Final = 10.0  # real seconds a VirtualTimeLoop waits with nothing to run


class _JumpingSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """A selector that, asked to wait, looks without waiting and, if nothing is ready,
    moves its loop's time on by the wait instead."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if ready or timeout == 0 or self._loop.has_ready():
            # (A callback a thread has just queued, its wake-up byte not yet written, is
            # work: time does not jump past it.)
            return ready
        if self._loop.busy_threads:
            # A thread works for the loop (to_thread): its end wakes us, and time waits.
            return super().select(timeout)
        if timeout is None:
            # No timer at all: only something from outside can come (another thread's
            # call_soon_threadsafe). Wait for it in real time, but not for ever: a scenario
            # where nothing can happen any more is a deadlock, said as one.
            ready = super().select(IDLE_LIMIT_S)
            if not ready:
                raise RuntimeError(f"the virtual-time loop had nothing to run for "
                                   f"{IDLE_LIMIT_S:g} s: no timer, no thread, nothing ready "
                                   "(a wait that nothing will end)")
            return ready
        self._loop.now += timeout
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose time moves only by its timers (see the module's docstring)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.busy_threads = 0
        super().__init__(_JumpingSelector(self))

    def time(self) -> float:
        return self.now

    def has_ready(self) -> bool:
        """Whether a callback waits to run (put there by another thread, say)."""
        return bool(self._ready)  # type: ignore[attr-defined]  # (asyncio's own queue)

    def run_in_executor(self, executor: concurrent.futures.Executor | None,
                        func: Callable[[*Ts], T], *args: *Ts) -> asyncio.Future[T]:
        return self.hold(super().run_in_executor(executor, func, *args))

    def hold(self, future: asyncio.Future[T]) -> asyncio.Future[T]:
        """Count `future`, a thread's work, while it runs: time does not jump past it."""
        self.busy_threads += 1

        def done(_: asyncio.Future[T]) -> None:
            self.busy_threads -= 1

        future.add_done_callback(done)
        return future


def working(future: asyncio.Future[T]) -> asyncio.Future[T]:
    """`future`, the end of a thread's work as its event loop sees it: held by a
    `VirtualTimeLoop` until done (see `hold`); on any other loop, as it is."""
    loop = future.get_loop()
    if isinstance(loop, VirtualTimeLoop):
        loop.hold(future)
    return future


def run_virtual(main: Callable[[LoopClock], Any]) -> Any:
    """Run the coroutine `main(clock)` to its end on a new `VirtualTimeLoop`, `clock`
    reading that loop's time; its result."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(main(LoopClock(loop)))
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
