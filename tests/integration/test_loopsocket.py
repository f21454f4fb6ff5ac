"""bus.loopsocket.LoopSocket: ZeroMQ sockets served from one event loop without pyzmq's futures.

Real sockets (inproc and tcp on loopback) in one event loop: messages arrive whole and in
order, a receive or a send that must wait is woken (never lost: the descriptor is
edge-like), those that wait are served in the order they came, a cancelled receive takes no
message with it, closing cancels whoever waits, and a socket nobody reads does not keep the
loop busy.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import zmq

from tensorbus.bus.loopsocket import LoopSocket

pytestmark = pytest.mark.timeout(30)
WITHIN_S = 5.0  # an await that takes longer fails the test, not hangs it


@asynccontextmanager
async def _pair(endpoint: str, kinds: tuple[int, int] = (zmq.PAIR, zmq.PAIR),
                hwm: int | None = None) -> AsyncIterator[tuple[LoopSocket, LoopSocket]]:
    """A socket bound at `endpoint` and one connected to it."""
    context: zmq.Context[Any] = zmq.Context()
    a, b = LoopSocket(context.socket(kinds[0])), LoopSocket(context.socket(kinds[1]))
    try:
        for s in (a, b):
            if hwm is not None:
                s.socket.setsockopt(zmq.SNDHWM, hwm)
                s.socket.setsockopt(zmq.RCVHWM, hwm)
        a.socket.bind(endpoint)
        b.socket.connect(a.socket.getsockopt(zmq.LAST_ENDPOINT).decode())
        yield a, b
    finally:
        a.close()
        b.close()
        context.destroy(linger=0)


async def _within(awaitable: Any) -> Any:
    return await asyncio.wait_for(awaitable, WITHIN_S)


@pytest.mark.parametrize("endpoint", ["inproc://ping", "tcp://127.0.0.1:*"])
def test_messages_cross_both_ways_whole_and_in_order(endpoint: str) -> None:
    """Both sides send and receive at once, many messages of mixed sizes (some large enough
    to go without a copy): every one arrives, whole, in the order it was sent."""
    rng = random.Random(7)
    sizes = [rng.choice((0, 10, 1000, 70_000, 300_000)) for _ in range(400)]

    async def main() -> None:
        async with _pair(endpoint) as (a, b):
            async def send(s: LoopSocket, tag: bytes) -> None:
                for i, n in enumerate(sizes):
                    await s.send_multipart([tag + i.to_bytes(4, "big"), bytes([i % 251]) * n])

            async def receive(s: LoopSocket, tag: bytes) -> None:
                for i, n in enumerate(sizes):
                    head, body = await _within(s.recv_multipart())
                    assert head.bytes == tag + i.to_bytes(4, "big")
                    assert len(body) == n and (n == 0 or body.bytes[n // 2] == i % 251)

            await _within(asyncio.gather(send(a, b"a"), send(b, b"b"),
                                         receive(b, b"a"), receive(a, b"b")))

    asyncio.run(main())


def test_waiting_receivers_are_served_in_the_order_they_came() -> None:
    async def main() -> None:
        async with _pair("inproc://order") as (a, b):
            waiting = [asyncio.ensure_future(b.recv_multipart()) for _ in range(5)]
            await asyncio.sleep(0.01)
            assert not any(w.done() for w in waiting)  # nothing sent yet: all wait
            for i in range(5):
                await a.send_multipart([bytes([i])])
            got = await _within(asyncio.gather(*waiting))
            assert [frames[0].bytes for frames in got] == [bytes([i]) for i in range(5)]

    asyncio.run(main())


def test_a_send_that_meets_the_high_water_mark_waits_and_goes_in_order() -> None:
    """Past the high-water mark ZeroMQ answers Again: the sends wait, in order, and each
    goes once the receiver makes room; later sends queue behind them, not ahead."""
    async def main() -> None:
        async with _pair("inproc://full", hwm=2) as (a, b):
            sends = [asyncio.ensure_future(a.send_multipart([bytes([i])])) for i in range(20)]
            await asyncio.sleep(0.05)
            waiting = [s for s in sends if not s.done()]
            assert waiting, "the high-water mark held nothing back"
            got = [(await _within(b.recv_multipart()))[0].bytes for _ in range(20)]
            assert got == [bytes([i]) for i in range(20)]
            await _within(asyncio.gather(*sends))

    asyncio.run(main())


def test_a_cancelled_receive_takes_no_message_with_it() -> None:
    async def main() -> None:
        async with _pair("tcp://127.0.0.1:*") as (a, b):
            early = asyncio.ensure_future(b.recv_multipart())
            await asyncio.sleep(0.01)
            early.cancel()
            await asyncio.sleep(0)
            await a.send_multipart([b"for the next one"])
            assert (await _within(b.recv_multipart()))[0].bytes == b"for the next one"
            assert early.cancelled()

    asyncio.run(main())


def test_closing_cancels_whoever_waits() -> None:
    async def main() -> None:
        async with _pair("inproc://close") as (_, b):
            waiting = asyncio.ensure_future(b.recv_multipart())
            await asyncio.sleep(0.01)
            b.close()
            with pytest.raises(asyncio.CancelledError):
                await _within(waiting)
            with pytest.raises(zmq.ZMQError):
                await b.recv_multipart()  # closed: refused, not a wait forever

    asyncio.run(main())


def test_a_socket_nobody_reads_does_not_keep_the_loop_busy() -> None:
    """Messages that arrive while nobody waits signal the descriptor; the callback clears
    it (reading ZMQ_EVENTS). Without that, the loop would call it again and again: a core
    busy for as long as nobody reads."""
    async def main() -> None:
        async with _pair("tcp://127.0.0.1:*") as (a, b):
            await a.send_multipart([b"first"])
            assert (await _within(b.recv_multipart()))[0].bytes == b"first"
            # A receive that finds nothing (so that the next message signals), given up.
            waiting = asyncio.ensure_future(b.recv_multipart())
            await asyncio.sleep(0.01)
            waiting.cancel()
            for i in range(3):  # arrive while nobody waits
                await a.send_multipart([bytes([i])])
            await asyncio.sleep(0.05)
            cpu = time.process_time()
            await asyncio.sleep(0.5)
            assert time.process_time() - cpu < 0.2
            got = [(await _within(b.recv_multipart()))[0].bytes for _ in range(3)]
            assert got == [b"\x00", b"\x01", b"\x02"]

    asyncio.run(main())


def test_a_socket_serves_a_second_event_loop() -> None:
    """Bound once, used under one asyncio.run and then another: the reader moves along."""
    context: zmq.Context[Any] = zmq.Context()
    a, b = LoopSocket(context.socket(zmq.PAIR)), LoopSocket(context.socket(zmq.PAIR))
    try:
        a.socket.bind("inproc://loops")
        b.socket.connect("inproc://loops")

        async def exchange(tag: bytes) -> bytes:
            waiting = asyncio.ensure_future(b.recv_multipart())  # waits: watched on this loop
            await asyncio.sleep(0.01)
            await a.send_multipart([tag])
            frames: list[zmq.Frame] = await _within(waiting)
            return frames[0].bytes

        assert asyncio.run(exchange(b"one")) == b"one"
        assert asyncio.run(exchange(b"two")) == b"two"
    finally:
        a.close()
        b.close()
        context.destroy(linger=0)


def test_router_and_dealers_under_load_lose_no_wake_up() -> None:
    """Requests from several dealers, answered by a router at once, many in flight: each
    dealer gets every answer (a lost wake-up would leave one waiting: the test's timeout)."""
    async def main() -> None:
        context: zmq.Context[Any] = zmq.Context()
        router = LoopSocket(context.socket(zmq.ROUTER))
        router.socket.bind("tcp://127.0.0.1:*")
        endpoint = router.socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        dealers = [LoopSocket(context.socket(zmq.DEALER)) for _ in range(3)]
        try:
            for d in dealers:
                d.socket.connect(endpoint)
            count = 300

            async def serve() -> None:
                for _ in range(count * len(dealers)):
                    peer, body = await router.recv_multipart()
                    await router.send_multipart([peer, body.bytes + b"!"])

            async def ask(d: LoopSocket) -> None:
                async def send() -> None:
                    for i in range(count):
                        await d.send_multipart([i.to_bytes(4, "big")])

                sending = asyncio.ensure_future(send())
                for i in range(count):
                    (answer,) = await d.recv_multipart()
                    assert answer.bytes == i.to_bytes(4, "big") + b"!"
                await sending

            await _within(asyncio.gather(serve(), *(ask(d) for d in dealers)))
        finally:
            for s in (router, *dealers):
                s.close()
            context.destroy(linger=0)

    asyncio.run(main())


@pytest.mark.parametrize("endpoint", ["inproc://edge", "tcp://127.0.0.1:*"])
def test_a_send_that_takes_a_receivers_signal_serves_it(endpoint: str) -> None:
    """A receive waits; a message comes for it; before the loop gets to the descriptor,
    the same socket sends, and libzmq, sending, processes the socket's commands: the signal
    that was the receiver's is gone. The send serves the receiver itself."""
    async def main() -> None:
        async with _pair(endpoint) as (a, b):
            await b.send_multipart([b"hello"])  # connected both ways, b watched
            assert (await _within(a.recv_multipart()))[0].bytes == b"hello"
            waiting = asyncio.ensure_future(b.recv_multipart())
            await asyncio.sleep(0.01)  # b found nothing: the next message signals
            a.socket.send(b"for the waiting one")  # (no await: the loop does not run)
            # Arrived; and libzmq's throttle lets the next call process it. (Blocking on
            # purpose: the loop must not run, or it would serve the receiver itself.)
            time.sleep(0.05)  # noqa: ASYNC251
            await b.send_multipart([b"meanwhile"])  # succeeds at once, processing commands
            assert (await _within(waiting))[0].bytes == b"for the waiting one"

    asyncio.run(main())


def test_a_receive_that_takes_a_senders_signal_serves_it() -> None:
    """The mirror case: a send waits past the high-water mark; the peer makes room and
    sends a message back; before the loop gets to the descriptor, a receive on the same
    socket succeeds at once, processing both commands: the signal that was the sender's is
    gone. The receive serves the sender itself."""
    async def main() -> None:
        async with _pair("inproc://mirror", hwm=2) as (a, b):
            sends = [asyncio.ensure_future(a.send_multipart([bytes([i])])) for i in range(10)]
            await asyncio.sleep(0.05)
            assert not all(s.done() for s in sends), "the high-water mark held nothing back"
            with pytest.raises(zmq.Again):  # a found nothing: the next message signals
                a.socket.recv(zmq.NOBLOCK)
            got = []
            while True:  # the peer makes room (no await: the loop does not run)
                try:
                    got.append(b.socket.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
            b.socket.send(b"back")
            time.sleep(0.05)  # noqa: ASYNC251 (blocking on purpose, as above)
            assert (await a.recv_multipart())[0].bytes == b"back"  # at once, commands taken
            while len(got) < 10:
                got.append((await _within(b.recv_multipart()))[0].bytes)
            assert got == [bytes([i]) for i in range(10)]
            await _within(asyncio.gather(*sends))

    asyncio.run(main())


def test_a_receive_answered_again_serves_the_sends_waiting() -> None:
    """Sends wait past the high-water mark; the peer makes room; in the same step, before
    the loop gets to the descriptor, a receive finds nothing and answers Again, having
    processed the socket's commands, the room among them: the waiting sends go all the same."""
    async def main() -> None:
        async with _pair("inproc://recv-again", (zmq.DEALER, zmq.DEALER), hwm=2) as (a, b):
            sends = [asyncio.ensure_future(a.send_multipart([bytes([i])])) for i in range(20)]
            await asyncio.sleep(0.05)
            waiting = sum(not s.done() for s in sends)
            assert waiting, "the high-water mark held nothing back"

            async def make_room_then_receive() -> None:
                while True:  # (no await: the loop does not run)
                    try:
                        b.socket.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                time.sleep(0.05)  # noqa: ASYNC251 (blocking on purpose, as above)
                await a.recv_multipart()  # Again: nothing came back; it waits

            receiving = asyncio.ensure_future(make_room_then_receive())
            await asyncio.sleep(0.2)
            assert sum(not s.done() for s in sends) < waiting  # some went into the room
            receiving.cancel()
            for s in sends:
                s.cancel()

    asyncio.run(main())


def test_a_send_answered_again_serves_the_receive_waiting() -> None:
    """A receive waits; the peer sends it a message; in the same step, a send on the full
    socket answers Again, having processed the socket's commands first, the message's
    among them: the waiting receive gets it all the same."""
    async def main() -> None:
        async with _pair("inproc://send-again", (zmq.DEALER, zmq.DEALER), hwm=2) as (a, b):
            while True:  # a's way out full: nobody reads b
                try:
                    a.socket.send(b"fill", zmq.NOBLOCK)
                except zmq.Again:
                    break
            receiving = asyncio.ensure_future(a.recv_multipart())
            await asyncio.sleep(0.05)

            async def peer_then_send() -> None:
                b.socket.send(b"for the receiver")  # (no await: the loop does not run)
                time.sleep(0.05)  # noqa: ASYNC251 (past libzmq's throttle of a send's commands)
                await a.send_multipart([b"more"])  # Again: it waits

            sending = asyncio.ensure_future(peer_then_send())
            assert (await _within(receiving))[0].bytes == b"for the receiver"
            sending.cancel()

    asyncio.run(main())


class _LateMessage:
    """A socket whose second send lets the peer's message in just before it is tried: as
    if the I/O thread delivered it between the callback's receive (Again) and its send."""

    def __init__(self, real: zmq.Socket[Any], deliver: Any) -> None:
        self._real, self._deliver, self.sends = real, deliver, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def send_multipart(self, *args: Any, **kwargs: Any) -> Any:
        self.sends += 1
        if self.sends == 2:
            self._deliver()
            time.sleep(0.05)  # arrived; and past libzmq's throttle of a send's commands
        return self._real.send_multipart(*args, **kwargs)


def test_a_message_that_lands_between_the_callbacks_two_calls_is_served() -> None:
    """Receives and a send wait on a full DEALER; a message wakes the callback, which
    serves one receive, the next receive answers Again, a second message lands, and the
    send (Again) processes its signal: the callback reads ZMQ_EVENTS before it ends, and
    the second receive gets its message."""
    async def main() -> None:
        async with _pair("inproc://late", (zmq.DEALER, zmq.DEALER), hwm=2) as (a, b):
            while True:  # a's way out full: nobody reads b
                try:
                    a.socket.send(b"fill", zmq.NOBLOCK)
                except zmq.Again:
                    break
            first, second = (asyncio.ensure_future(a.recv_multipart()) for _ in range(2))
            sending = asyncio.ensure_future(a.send_multipart([b"waits"]))
            await asyncio.sleep(0.05)
            real = a.socket
            late = _LateMessage(real, lambda: b.socket.send(b"second"))
            a.socket = late  # type: ignore[assignment]
            try:
                b.socket.send(b"first")
                assert (await _within(first))[0].bytes == b"first"
                assert (await _within(second))[0].bytes == b"second"
                assert late.sends >= 2  # the case was met
            finally:
                a.socket = real
                sending.cancel()

    asyncio.run(main())


def test_closing_after_the_loop_closed_still_closes_the_socket() -> None:
    """A loop closed while a receive still waited (its task never cancelled): closing the
    socket afterwards neither raises nor leaves it open."""
    context: zmq.Context[Any] = zmq.Context()
    a, b = LoopSocket(context.socket(zmq.PAIR)), LoopSocket(context.socket(zmq.PAIR))
    try:
        a.socket.bind("inproc://closed-loop")
        b.socket.connect("inproc://closed-loop")
        loop = asyncio.new_event_loop()
        waiting = loop.create_task(b.recv_multipart())
        loop.run_until_complete(asyncio.sleep(0.01))
        assert not waiting.done()
        loop.close()
        b.close()
        assert b.socket.closed
    finally:
        a.close()
        b.close()
        context.destroy(linger=0)
