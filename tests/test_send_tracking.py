"""A zero-copy send's tracker (bus.transport._send): done only once ZeroMQ let go of every frame.

Over real ZeroMQ sockets in one event loop. In-process, a frame is the sender's own memory
until the receiver drops it: the tracker stays not done while the receiver holds all the
frames, or only the last one (frames may be let go of in any order), and is done once it
holds none. Over TCP it is done once the bytes are on their way. A message of small frames
only (which pyzmq copies) has nothing to track.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import zmq
import zmq.asyncio

from bus.buffers import Tracker
from bus.transport import TRACK_ABOVE, _send

pytestmark = pytest.mark.timeout(30)


async def _until_done(tracker: Tracker, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while not tracker.done and time.monotonic() < deadline:
        await asyncio.sleep(0.001)
    return tracker.done


def _pair(endpoint: str) -> tuple[zmq.asyncio.Context, zmq.asyncio.Socket, zmq.asyncio.Socket]:
    context = zmq.asyncio.Context()
    sender, receiver = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    sender.bind(endpoint)
    receiver.connect(sender.getsockopt(zmq.LAST_ENDPOINT).decode())
    return context, sender, receiver


def _frames() -> list[object]:
    data = np.arange(3 * TRACK_ABOVE, dtype=np.uint8)
    return [b"header", *(data[i : i + TRACK_ABOVE] for i in range(0, data.size, TRACK_ABOVE))]


def test_in_process_frames_are_tracked_until_the_receiver_drops_every_one() -> None:
    async def main() -> None:
        context, sender, receiver = _pair("inproc://tracking")
        try:
            tracker = await _send(sender, _frames())
            assert tracker is not None
            got = await receiver.recv_multipart(copy=False)
            assert bytes(got[2].buffer)[:3] == bytes([0, 1, 2])  # the sender's bytes, as sent
            await asyncio.sleep(0.05)
            assert not tracker.done  # the receiver holds them: the sender may not write
            last = got[-1]
            del got
            await asyncio.sleep(0.05)
            assert not tracker.done  # one frame is still held
            del last
            assert await _until_done(tracker)
        finally:
            context.destroy(linger=0)

    asyncio.run(main())


def test_tcp_frames_are_tracked_until_they_are_sent() -> None:
    async def main() -> None:
        context, sender, receiver = _pair("tcp://127.0.0.1:*")
        try:
            tracker = await _send(sender, _frames())
            assert tracker is not None
            got = await receiver.recv_multipart()
            assert [len(f) for f in got] == [6, TRACK_ABOVE, TRACK_ABOVE, TRACK_ABOVE]
            assert await _until_done(tracker)
        finally:
            context.destroy(linger=0)

    asyncio.run(main())


def test_small_frames_are_copied_and_not_tracked() -> None:
    async def main() -> None:
        context, sender, receiver = _pair("inproc://small")
        try:
            assert await _send(sender, [b"header", bytes(TRACK_ABOVE - 1)]) is None
            assert [len(f) for f in await receiver.recv_multipart()] == [6, TRACK_ABOVE - 1]
        finally:
            context.destroy(linger=0)

    asyncio.run(main())
