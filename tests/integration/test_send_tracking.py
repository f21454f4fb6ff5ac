"""A zero-copy send's tracker (bus.transport._send): done only once ZeroMQ let go of every frame.

Over real ZeroMQ sockets in one event loop. In-process, a frame is the sender's own memory
until the receiver drops it: the tracker stays not done while the receiver holds all the
frames, or only the last one (frames may be let go of in any order), and is done once it
holds none. Over TCP it is done once the bytes are on their way. A message of small frames
only (which pyzmq copies) has nothing to track.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
import pytest
import zmq

from tensorbus.bus.buffers import Tracker
from tensorbus.bus.loopsocket import LoopSocket
from tensorbus.bus.transport import TRACK_ABOVE, _send

pytestmark = pytest.mark.timeout(30)
Receive = Callable[[bool], Awaitable[list[Any]]]


RECV_S = 5.0  # a receive that takes longer fails the test with this bound, not a hang


async def _until_done(tracker: Tracker, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while not tracker.done and time.monotonic() < deadline:
        await asyncio.sleep(0.001)
    return tracker.done


@contextlib.asynccontextmanager
async def _pair(endpoint: str) -> AsyncIterator[tuple[LoopSocket, Receive]]:
    """A sender bound at `endpoint` and a receive (of one message, frames kept as zmq.Frames
    or copied to bytes) from the socket connected to it."""
    context: zmq.Context[Any] = zmq.Context()
    sender, receiver = LoopSocket(context.socket(zmq.PAIR)), LoopSocket(context.socket(zmq.PAIR))
    try:
        sender.socket.bind(endpoint)
        receiver.socket.connect(sender.socket.getsockopt(zmq.LAST_ENDPOINT).decode())

        async def receive(copy: bool) -> list[Any]:
            frames = await asyncio.wait_for(receiver.recv_multipart(), RECV_S)
            return [f.bytes for f in frames] if copy else frames

        yield sender, receive
    finally:
        sender.close()
        receiver.close()
        context.destroy(linger=0)


def _frames() -> list[object]:
    data = np.arange(3 * TRACK_ABOVE, dtype=np.uint8)
    return [b"header", *(data[i : i + TRACK_ABOVE] for i in range(0, data.size, TRACK_ABOVE))]


def test_in_process_frames_are_tracked_until_the_receiver_drops_every_one() -> None:
    async def main() -> None:
        async with _pair("inproc://tracking") as (sender, receive):
            tracker = await _send(sender, _frames())
            assert tracker is not None
            got = await receive(False)
            assert bytes(got[2].buffer)[:3] == bytes([0, 1, 2])  # the sender's bytes, as sent
            await asyncio.sleep(0.05)
            assert not tracker.done  # the receiver holds them: the sender may not write
            last = got[-1]
            del got
            await asyncio.sleep(0.05)
            assert not tracker.done  # one frame is still held
            del last
            assert await _until_done(tracker)

    asyncio.run(main())


def test_tcp_frames_are_tracked_until_they_are_sent() -> None:
    async def main() -> None:
        async with _pair("tcp://127.0.0.1:*") as (sender, receive):
            tracker = await _send(sender, _frames())
            assert tracker is not None
            assert [len(f) for f in await receive(True)] == [6, TRACK_ABOVE, TRACK_ABOVE, TRACK_ABOVE]
            assert await _until_done(tracker)

    asyncio.run(main())


def test_small_frames_are_copied_and_not_tracked() -> None:
    async def main() -> None:
        async with _pair("inproc://small") as (sender, receive):
            assert await _send(sender, [b"header", bytes(TRACK_ABOVE - 1)]) is None
            assert [len(f) for f in await receive(True)] == [6, TRACK_ABOVE - 1]

    asyncio.run(main())
