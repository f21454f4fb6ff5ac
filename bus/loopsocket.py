"""A ZeroMQ socket read and written from an asyncio event loop, without pyzmq's futures.

pyzmq's `zmq.asyncio` makes a Future, a done-callback and a poller update for every receive,
and a Future for every send, and re-reads the socket's events after each: in a colocated
sync run at 1M parameters, it was on the stack of much of the time the event loop's thread
held the GIL, the socket calls themselves included (py-spy --gil; the profiles:
benchmarks/cpu_profile.py). Here a send or
a receive is first tried without blocking (unless others of its kind already wait: then it
queues behind them), and only when ZeroMQ answers Again does it wait.

How waiting works. A ZeroMQ socket's file descriptor turns readable when commands reach the
socket (a message came into an empty queue, room was made in a full one), not when a message
is there, and stays readable until the socket processes them. Reading ZMQ_EVENTS processes
them all, and so does a receive that answers Again; a send processes them (at most once a
millisecond) before it tries, not after an Again; a call that succeeds may process them
too. So a coroutine answered Again waits, and one reader callback, registered on the
descriptor once, serves those waiting, in order, until Again or until none is left. Any
call may take a signal meant for the other kind (a receive, the room a waiting send needs;
a send, the message a waiting receive needs): after a call of one kind while the other
kind waits, those are served at once; and where sends wait, the callback ends by reading
ZMQ_EVENTS, going on while a waiting kind can proceed, since a send's Again may have left
commands unprocessed, and each kind's attempts may have taken the other's signal. With
none waiting, the callback only reads ZMQ_EVENTS (which clears the descriptor, or the loop
would call again at once). Otherwise ZMQ_EVENTS is not read: with the GIL held, it cost
more than the rest of this module in a profile, and in this project only a DEALER whose
peer is slow or gone ever has sends waiting. A socket is used from one event loop's thread
only.

Closing cancels whoever still waits, as `zmq.asyncio` does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import zmq

_POLLIN, _POLLOUT = int(zmq.POLLIN), int(zmq.POLLOUT)  # (ints: a zmq.PollEvent's & is slow)
_A = TypeVar("_A")
_R = TypeVar("_R")


class LoopSocket:
    """`socket` (a plain, synchronous zmq.Socket) for coroutines of one event loop."""

    __slots__ = ("_closed", "_fd", "_loop", "_receivers", "_senders", "socket")

    def __init__(self, socket: zmq.Socket[Any]) -> None:
        self.socket = socket
        self._loop: asyncio.AbstractEventLoop | None = None  # whose reader watches the socket
        self._fd = -1  # the descriptor watched (kept: readable after the socket is closed)
        self._receivers: deque[tuple[None, asyncio.Future[list[zmq.Frame]]]] = deque()
        self._senders: deque[tuple[Sequence[Any], asyncio.Future[None]]] = deque()
        self._closed = False

    async def recv_multipart(self) -> list[zmq.Frame]:
        """The next message, its frames not copied."""
        if not self._receivers:
            frames: list[zmq.Frame] | None
            try:
                frames = self._receive_now(None)
            except zmq.Again:
                frames = None
            if self._senders:  # answered or not, it may have taken their signal
                self._serve()
            if frames is not None:
                return frames
        # (answered Again just now, or behind others: either way a change will call _serve)
        waiter: asyncio.Future[list[zmq.Frame]] = self._watch().create_future()
        self._receivers.append((None, waiter))
        return await waiter

    async def send_multipart(self, parts: Sequence[Any]) -> None:
        """Queue `parts` as one message (frames of at least zmq.COPY_THRESHOLD bytes are
        not copied: see bus.transport._send)."""
        if not self._senders:
            try:
                self._send_now(parts)
                sent = True
            except zmq.Again:
                sent = False
            if self._receivers:  # sent or not, it may have taken their signal
                self._serve()
            if sent:
                return
        waiter: asyncio.Future[None] = self._watch().create_future()
        self._senders.append((parts, waiter))
        await waiter

    def close(self, *, linger: int = 0) -> None:
        """Stop watching, cancel whoever waits and close the socket (queued messages may
        leave for `linger` ms more, while the context is terminated)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._fd)
            waiting: list[asyncio.Future[Any]] = [
                *(w for _, w in self._receivers), *(w for _, w in self._senders)]
            for waiter in waiting:
                if not waiter.done():
                    # (a loop closed with tasks still waiting refuses: nobody waits then)
                    with contextlib.suppress(RuntimeError):
                        waiter.cancel()
        finally:
            self._receivers.clear()
            self._senders.clear()
            self.socket.close(linger=linger)

    def _watch(self) -> asyncio.AbstractEventLoop:
        """The running loop, with the reader registered on it (once; again on a new loop)."""
        loop = asyncio.get_running_loop()
        if self._closed:
            raise zmq.ZMQError(zmq.ENOTSOCK)
        if loop is not self._loop:
            if self._loop is not None and not self._loop.is_closed():
                with contextlib.suppress(RuntimeError):  # (that loop's thread is gone)
                    self._loop.remove_reader(self._fd)
            self._fd = self.socket.FD
            loop.add_reader(self._fd, self._serve)
            self._loop = loop
        return loop

    def _serve(self) -> None:
        """Receive and send for those waiting while ZeroMQ lets us (see the module's
        docstring); with none waiting, clear the descriptor."""
        if self._closed:
            return
        if not (self._receivers or self._senders):
            self.socket.get(zmq.EVENTS)
            return
        while not self._closed:
            progressed = _settle(self._receivers, self._receive_now) if self._receivers else False
            if self._senders:
                progressed = _settle(self._senders, self._send_now) or progressed
            if progressed:
                continue
            if not self._senders:
                return  # the receive's Again processed every command: a change signals
            events = int(self.socket.get(zmq.EVENTS))
            if not (events & _POLLIN and self._receivers or events & _POLLOUT and self._senders):
                return

    def _receive_now(self, _: None) -> list[zmq.Frame]:
        return self.socket.recv_multipart(zmq.NOBLOCK, copy=False)

    def _send_now(self, parts: Sequence[Any]) -> None:
        self.socket.send_multipart(parts, zmq.NOBLOCK, copy=False)


def _settle(waiting: deque[tuple[_A, asyncio.Future[_R]]], attempt: Callable[[_A], _R]) -> bool:
    """Settle the waiters at the head of `waiting` with `attempt(argument)`, in order, until
    ZeroMQ answers Again; whether any was settled. A waiter cancelled while it waited is
    dropped (a send: not sent)."""
    progressed = False
    while waiting:
        argument, waiter = waiting[0]
        if waiter.done():
            waiting.popleft()
            continue
        try:
            result = attempt(argument)
        except zmq.Again:
            break
        except zmq.ZMQError as e:
            waiting.popleft()
            waiter.set_exception(e)
        else:
            waiting.popleft()
            waiter.set_result(result)
        progressed = True
    return progressed
