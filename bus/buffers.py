"""Ownership of buffers on the zero-copy send path.

A tensor sent with `copy=False` is read by ZeroMQ's I/O thread after `send` returns, so it
must not be written again until ZeroMQ is done with it; a send's `Tracker` says so
(`bus.transport._send`: done once pyzmq has dropped every frame). Two tools for the two
cases in tensorbus:

- `SendBuffers`: a pool of flat buffer sets for data that is written anew for every send
  (the coordinator's snapshot of each published version). The owner `take`s a set, sends
  it as often as it likes, then `release`s it with the trackers of those sends; `take`
  reuses a released set once all its sends are done, so the hot path does not allocate.
- `wait_sent`: for a buffer that is written in place between sends (a worker's gradient
  buffer), wait, with a deadline, until the last send of it is done.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import Protocol

import torch

from tensorbus.bus.errors import PeerTimeoutError


class Tracker(Protocol):
    @property
    def done(self) -> bool: ...


class SendBuffers:
    """Reusable buffer sets; a set is free again once every send of it is done."""

    def __init__(self, allocate: Callable[[], tuple[torch.Tensor, ...]], *, keep: int = 4,
                 held: Callable[[tuple[torch.Tensor, ...]], bool] | None = None,
                 reused: Callable[[tuple[torch.Tensor, ...]], None] | None = None,
                 dropped: Callable[[tuple[torch.Tensor, ...]], None] | None = None) -> None:
        """`held`, if given, says whether someone other than a send still reads a released
        set (a colocated worker computing on it: see nodes.colocated_sets); such a set stays out
        of the pool until it is let go of too. `reused` is called with a set about to be
        written again, and `dropped` with one the pool lets go of (sets in shared memory
        that workers read by reference: bus.shared.SharedWeightPool); with `reused`, a set is reused
        only while `keep` others are free, the one released longest ago first, so that
        readers have the most time (a few versions) before it changes, and twice as many
        are kept free before one is let go of (a set made anew costs its readers a new
        mapping)."""
        self._allocate = allocate
        self._keep = keep  # free sets kept for reuse; more in flight than that are let go
        self._is_held = held
        self._reused, self._dropped = reused, dropped
        self._free: list[tuple[torch.Tensor, ...]] = []
        self._busy: list[tuple[tuple[torch.Tensor, ...], list[Tracker | None]]] = []

    def take(self) -> tuple[torch.Tensor, ...]:
        """A buffer set that no send reads; its contents are stale and must be overwritten."""
        self._collect()
        if self._reused is None:
            # The last released: the likeliest still in cache.
            return self._free.pop() if self._free else self._allocate()
        if len(self._free) < self._keep:
            return self._allocate()
        buffers = self._free.pop(0)
        self._reused(buffers)
        return buffers

    def release(self, buffers: tuple[torch.Tensor, ...], trackers: list[Tracker | None]) -> None:
        """The owner is done with `buffers`; they return to the pool once these sends are."""
        # Keep the caller's list itself, not a copy: a send still being awaited may add to it.
        self._busy.append((buffers, trackers))

    def held(self, buffers: tuple[torch.Tensor, ...]) -> bool:
        """Whether someone other than a send reads `buffers` (see `held` above)."""
        return self._is_held is not None and self._is_held(buffers)

    def _collect(self) -> None:
        still = []
        for buffers, trackers in self._busy:
            if all_done(trackers) and not self.held(buffers):
                if len(self._free) < (self._keep if self._reused is None else 2 * self._keep):
                    self._free.append(buffers)
                elif self._dropped is not None:
                    self._dropped(buffers)
            else:
                still.append((buffers, trackers))
        self._busy = still


def all_done(trackers: Iterable[Tracker | None]) -> bool:
    """Whether every one of these sends is done (None: a send that copied its frames)."""
    return all(t is None or t.done for t in trackers)


async def wait_sent(tracker: Tracker | None, *, timeout: float, what: str) -> None:
    """Wait until ZeroMQ no longer reads a zero-copy frame, or raise PeerTimeoutError."""
    if tracker is None or tracker.done:
        return
    deadline = time.monotonic() + timeout
    delay = 0.0001
    while not tracker.done:
        if time.monotonic() > deadline:
            raise PeerTimeoutError("ZeroMQ", f"the send of {what}", timeout)
        await asyncio.sleep(delay)
        # Not much longer than a millisecond: a waiter usually waits for a peer's last
        # step (in-process, the frames are let go of when it is done with them).
        delay = min(delay * 2, 0.001)
