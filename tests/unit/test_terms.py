"""Unit: a worker's coordinator term (nodes.liveness): the newest heard goes on its beats, and
what a coordinator of an older term says is stale (one taken over while cut off)."""

from __future__ import annotations

import asyncio

import pytest

from tensorbus.bus.clock import SYSTEM_CLOCK
from tensorbus.bus.codec import decode
from tensorbus.bus.messages import Heartbeat, Phase, Stop, Weights
from tensorbus.nodes.liveness import Liveness

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


class _Owner:
    rank, phase, clock = 1, Phase.COMPUTING, 4

    def end_session(self, why: Exception) -> None:
        raise AssertionError(why)


class _Beats:
    """A client transport that keeps what is sent, and ends the sender after one beat."""

    def __init__(self) -> None:
        self.sent: list[list[memoryview]] = []

    async def send(self, frames: list[bytes]) -> None:
        self.sent.append([memoryview(bytes(f)) for f in frames])
        raise asyncio.CancelledError


def test_a_newer_term_is_taken_and_an_older_one_is_stale() -> None:
    liveness = Liveness(_Owner(), "coordinator at tcp://a:1", SYSTEM_CLOCK, loaded=lambda: 3)
    assert not liveness.stale(Weights(version=2))
    liveness.heard(Weights(version=2, term=1))  # (a standby that took over welcomed us)
    assert liveness.term == 1
    assert liveness.stale(Stop(reason="done", term=0))  # the old coordinator, lived on apart
    assert not liveness.stale(Heartbeat(term=1)) and not liveness.stale(Heartbeat(term=2))
    liveness.heard(Heartbeat(term=0))  # (never heard: stale. Never lowered, were it.)
    assert liveness.term == 1


def test_a_worker_s_heartbeat_carries_the_newest_term_it_heard() -> None:
    liveness = Liveness(_Owner(), "coordinator at tcp://a:1", SYSTEM_CLOCK, loaded=lambda: 3)
    liveness.heard(Weights(version=2, term=2))
    client = _Beats()
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(liveness.heartbeats(client))  # type: ignore[arg-type]
    beat = decode(client.sent[0])
    assert isinstance(beat, Heartbeat) and (beat.sender, beat.version, beat.term) == (1, 3, 2)
