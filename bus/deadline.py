"""Deadlines on waits for a peer: every such wait ends, and when it ends early it says why."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from tensorbus.bus.errors import PeerTimeoutError

T = TypeVar("T")


async def within(awaitable: Awaitable[T], seconds: float, *, peer: str, waiting_for: str) -> T:
    """Await `awaitable` for at most `seconds`; raise PeerTimeoutError naming who and what."""
    try:
        return await asyncio.wait_for(awaitable, seconds)
    except TimeoutError:
        raise PeerTimeoutError(peer, waiting_for, seconds) from None
