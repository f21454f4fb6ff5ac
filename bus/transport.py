"""Socket set-up: the coordinator's ROUTER + PUB and a worker's DEALER + SUB, on zmq.asyncio.

Nodes see only the two small interfaces below (frames in, frames out), never a socket, so
their logic does not depend on how bytes move. Every socket lingers 0 ms on close, so that
closing never waits on a peer that is gone, and receiving sockets refuse frames larger than
the model allows (ZeroMQ drops the connection of a peer that sends one).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Final, Protocol
from urllib.parse import urlsplit

import zmq
import zmq.asyncio

from bus.buffers import Tracker

Frames = Sequence[Any]  # anything with the buffer protocol
TRACK_ABOVE: Final = zmq.COPY_THRESHOLD  # smaller frames are copied by pyzmq: nothing to track
PUB_QUEUE: Final = 8  # broadcasts queued per subscriber before PUB drops


class ServerTransport(Protocol):
    endpoint: str
    pub_port: int

    async def recv(self) -> tuple[bytes, list[memoryview]]: ...
    async def send(self, peer: bytes, frames: Frames) -> Tracker | None: ...
    async def publish(self, frames: Frames) -> Tracker | None: ...
    def close(self) -> None: ...


class ClientTransport(Protocol):
    def subscribe(self, pub_port: int) -> None: ...
    async def send(self, frames: Frames) -> Tracker | None: ...
    async def recv(self) -> list[memoryview]: ...
    async def recv_broadcast(self) -> list[memoryview]: ...
    def close(self) -> None: ...


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """'tcp://HOST:PORT' -> (HOST, PORT); ValueError naming what is wrong otherwise."""
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp" or not parts.hostname or parts.port is None:
        raise ValueError(f"endpoint {endpoint!r} is not of the form tcp://HOST:PORT")
    return parts.hostname, parts.port


def _needs_tracking(frames: Frames) -> bool:
    return any(memoryview(f).nbytes >= TRACK_ABOVE for f in frames)


async def _send(socket: zmq.asyncio.Socket, frames: Frames) -> Tracker | None:
    track = _needs_tracking(frames)
    result = await socket.send_multipart(frames, copy=False, track=track)
    return result if track else None


class ZmqServer:
    """The coordinator's sockets: a ROUTER for requests and a PUB for broadcasts."""

    def __init__(self, bind: str, *, max_message_bytes: int, pub_port: int | None = None) -> None:
        host, port = split_endpoint(bind)
        self._context = zmq.asyncio.Context()
        try:
            self._router = self._socket(zmq.ROUTER, max_message_bytes)
            self._router.bind(f"tcp://{host}:{port or '*'}")
            self.endpoint = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
            _, bound = split_endpoint(self.endpoint)
            # A fixed request port gets a fixed broadcast port beside it (firewall rules);
            # a random one gets a random one.
            self._pub = self._socket(zmq.PUB, max_message_bytes)
            # A stalled subscriber may hold at most this many versions; past it PUB drops,
            # and the worker catches up with a Pull.
            self._pub.setsockopt(zmq.SNDHWM, PUB_QUEUE)
            want = pub_port if pub_port is not None else (port + 1 if port else 0)
            self._pub.bind(f"tcp://{host}:{want or '*'}")
            _, self.pub_port = split_endpoint(self._pub.getsockopt(zmq.LAST_ENDPOINT).decode())
        except zmq.ZMQError as e:
            self._context.destroy(linger=0)
            raise OSError(
                f"cannot bind {bind} or its broadcast port ({e.strerror}); the broadcast port is "
                "PORT+1 unless --pub-port says otherwise"
            ) from None
        except BaseException:
            self._context.destroy(linger=0)
            raise
        self.port = bound

    def _socket(self, kind: int, max_message_bytes: int) -> zmq.asyncio.Socket:
        socket = self._context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        return socket

    async def recv(self) -> tuple[bytes, list[memoryview]]:
        frames = await self._router.recv_multipart(copy=False)
        return frames[0].bytes, [f.buffer for f in frames[1:]]

    async def send(self, peer: bytes, frames: Frames) -> Tracker | None:
        return await _send(self._router, [peer, *frames])

    async def publish(self, frames: Frames) -> Tracker | None:
        return await _send(self._pub, frames)

    def close(self) -> None:
        self._context.destroy(linger=0)


class ZmqClient:
    """A worker's sockets: a DEALER to the coordinator's ROUTER and a SUB to its PUB."""

    def __init__(self, connect: str, *, max_message_bytes: int) -> None:
        self._host, _ = split_endpoint(connect)
        self._context = zmq.asyncio.Context()
        self._dealer = self._context.socket(zmq.DEALER)
        self._sub = self._context.socket(zmq.SUB)
        for socket in (self._dealer, self._sub):
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self._dealer.connect(connect)

    def subscribe(self, pub_port: int) -> None:
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(f"tcp://{self._host}:{pub_port}")

    async def send(self, frames: Frames) -> Tracker | None:
        return await _send(self._dealer, frames)

    async def recv(self) -> list[memoryview]:
        return [f.buffer for f in await self._dealer.recv_multipart(copy=False)]

    async def recv_broadcast(self) -> list[memoryview]:
        return [f.buffer for f in await self._sub.recv_multipart(copy=False)]

    def close(self) -> None:
        self._context.destroy(linger=0)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop where it is installed (faster wake-ups), the standard loop otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
