"""Deadlines on waits for a peer: every such wait ends, and when it ends early it says why."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from tensorbus.bus.errors import PeerTimeoutError

T = TypeVar("T")


async def at_most(awaitable: Awaitable[T], seconds: float) -> T:
    """`awaitable`'s result, or TimeoutError after `seconds` (it is then cancelled).

    Not asyncio.wait_for: on Python 3.11 it may swallow a cancellation of its caller that
    comes as the awaitable completes, and a loop around it would then never end."""
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=seconds)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        raise TimeoutError
    return task.result()


async def within(awaitable: Awaitable[T], seconds: float, *, peer: str, waiting_for: str) -> T:
    """Await `awaitable` for at most `seconds`; raise PeerTimeoutError naming who and what."""
    try:
        return await at_most(awaitable, seconds)
    except TimeoutError:
        raise PeerTimeoutError(peer, waiting_for, seconds) from None
