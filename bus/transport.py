"""Socket set-up: the coordinator's ROUTER + XPUB and a worker's DEALER + SUB, on asyncio
(each socket driven by a `bus.loopsocket.LoopSocket`).

Nodes see only the two small interfaces below (frames in, frames out), never a socket, so
their logic does not depend on how bytes move. Every socket lingers 0 ms on close, so that
closing never waits on a peer that is gone, and receiving sockets refuse frames larger than
the model allows (ZeroMQ drops the connection of a peer that sends one).

A `Hub` is one ZeroMQ context shared by the nodes of one process: a coordinator bound with
a hub is also reachable at `inproc://` endpoints, and a worker whose link uses the same
hub connects there, so that a worker and the coordinator shard it hosts (nodes.colocated)
talk without TCP and without copying: a frame sent over inproc is the sender's own memory
until the receiver lets go of it, so the zero-copy rules of `bus.buffers` reach across.

Every broadcast begins with a topic frame, which SUB filters on: `TOPIC_ALL` for what every
worker takes (heartbeats, Changes, Stop), and a version's whole weights twice, as bytes
(`TOPIC_WEIGHTS`) and for workers of the coordinator's host as references to its shared memory
(`TOPIC_SHARED`: bus.shared.SharedWeightPool). A worker subscribes to one of the two; PUB sends a
message only to subscribers of its topic, so one that nobody wants costs no bytes. It would
still cost the coordinator the message's encoding and the making and dropping of its
zero-copy frames, a measurable part of its event loop's time a version at 1M parameters
under async, so the broadcast socket is an XPUB, which hands up the topics subscribed to (the first
subscription to a topic, and the last one's end), and `ZmqServer.wants(topic)` tells the
coordinator whether anyone takes a topic before it makes the message. A subscriber whose
subscription is not in yet misses the message either way, as with any PUB (the slow
joiner), and catches up with a Pull.

With keys (see `bus.security`) every socket speaks CURVE: the ROUTER and XPUB are CURVE
servers behind a `KeyGate` that admits only the authorized worker keys, and the DEALER and
SUB are CURVE clients pinned to the coordinator's public key. Without keys the sockets speak
plain ZeroMQ (NULL), as on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import weakref
from collections.abc import Sequence
from typing import Any, Final, Protocol
from urllib.parse import urlsplit

import numpy as np
import zmq
from zmq.utils.monitor import parse_monitor_message

from tensorbus.bus.buffers import Tracker
from tensorbus.bus.loopsocket import LoopSocket
from tensorbus.bus.security import ClientKeys, KeyGate, ServerKeys, curve_client, curve_server

Frames = Sequence[Any]  # anything with the buffer protocol
TRACK_ABOVE: Final = zmq.COPY_THRESHOLD  # smaller frames are copied by pyzmq: nothing to track
PUB_QUEUE: Final = 8  # broadcasts queued per subscriber before PUB drops
# A connection whose handshake failed before any key was shown (a peer without keys).
_PLAIN_REFUSED: Final = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
TOPIC_ALL: Final = b"a"  # broadcast topics (see above)
TOPIC_WEIGHTS: Final = b"w"
TOPIC_SHARED: Final = b"s"
_WATCHED: Final = (zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
                   | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                   | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
# What `ZmqClient.connection_problem` reports; each says what to check.
HANDSHAKE_REFUSED: Final = (
    "the coordinator refused the CURVE handshake: its authorized/ directory lacks this "
    "worker's public key (--key-name picks which), or the coordinator.key given is not "
    "the coordinator's")
HANDSHAKE_MECHANISM: Final = (
    "one side uses CURVE keys and the other does not: give --keys to both the coordinator "
    "and the worker, or to neither")
NOT_CONNECTED: Final = (
    "no connection was made: is the coordinator running and reachable at that address "
    "(check --connect, and the host's firewall)?")


class ServerTransport(Protocol):
    """What a coordinator needs of its sockets; made by a `ServerFactory` (ZmqServer, or
    bus.memory's for one-loop tests)."""

    endpoint: str
    inproc_endpoint: str  # "" without a hub
    pub_port: int

    @property
    def rejected(self) -> int: ...  # connections refused for their keys
    async def recv(self) -> tuple[bytes, list[memoryview]]: ...
    async def send(self, peer: bytes, frames: Frames) -> Tracker | None: ...
    async def publish(self, frames: Frames, topic: bytes = TOPIC_ALL) -> Tracker | None: ...
    def wants(self, topic: bytes) -> bool: ...
    def close(self) -> None: ...


class ClientTransport(Protocol):
    """What a worker's link needs of its sockets; made by a `ClientFactory`."""

    def connection_problem(self) -> str | None: ...
    def subscribe(self, pub_port: int, *, shared: bool = False) -> None: ...
    async def send(self, frames: Frames) -> Tracker | None: ...
    async def recv(self) -> list[memoryview]: ...
    async def recv_broadcast(self) -> list[memoryview]: ...
    def close(self) -> None: ...


class ServerFactory(Protocol):
    def __call__(self, bind: str, *, max_message_bytes: int, pub_port: int | None = None,
                 keys: ServerKeys | None = None, hub: Hub | None = None) -> ServerTransport: ...


class ClientFactory(Protocol):
    def __call__(self, connect: str, *, max_message_bytes: int, keys: ClientKeys | None = None,
                 hub: Hub | None = None) -> ClientTransport: ...


class Hub:
    """A ZeroMQ context shared by the nodes of one process (for inproc:// links).

    Sockets made on it are closed by their owners; `close` ends the context itself, after
    every node that uses it has closed.
    """

    def __init__(self) -> None:
        self.context: zmq.Context[Any] = zmq.Context()

    def close(self) -> None:
        self.context.destroy(linger=0)


def _inproc(port: int) -> tuple[str, str]:
    """The in-process endpoints (requests, broadcasts) of a server bound to `port`."""
    return f"inproc://tensorbus-{port}", f"inproc://tensorbus-{port}-broadcasts"


def _reason(e: zmq.ZMQError) -> str:
    """ZeroMQ's reason alone (a bind's own error text also repeats the address)."""
    return zmq.strerror(e.errno) if e.errno is not None else str(e)


def is_loopback(host: str) -> bool:
    """Whether HOST (a name or an address) is this machine's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """'tcp://HOST:PORT' -> (HOST, PORT); ValueError naming what is wrong otherwise."""
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp" or not parts.hostname or parts.port is None:
        raise ValueError(f"endpoint {endpoint!r} is not of the form tcp://HOST:PORT")
    return parts.hostname, parts.port


def _new_sockets(context: zmq.Context[Any], kinds: Sequence[int], *, own_context: bool
                 ) -> list[LoopSocket]:
    """Sockets of these kinds; if one cannot be made (out of descriptors, say), those made
    are closed, and the context too where it is ours alone, before the error goes on."""
    made: list[LoopSocket] = []
    try:
        for kind in kinds:
            made.append(LoopSocket(context.socket(kind)))
    except BaseException:
        for socket in made:
            socket.close()
        if own_context:
            context.destroy(linger=0)
        raise
    return made


async def _send(socket: LoopSocket, frames: Frames) -> Tracker | None:
    """Send large frames without copying them; the tracker is done once ZeroMQ has let go
    of every one of them (None if all were small enough to copy)."""
    parts: list[Any] = []
    watched: list[weakref.ref[np.ndarray]] = []
    for f in frames:
        if memoryview(f).nbytes >= TRACK_ABOVE:
            # Each frame watched: a short frame is copied, and frames of one message may be
            # let go of in any order (in-process, as the receiver drops them).
            part = np.frombuffer(f, dtype=np.uint8)
            watched.append(weakref.ref(part))
            parts.append(part)
        else:
            parts.append(f)
    await socket.send_multipart(parts)
    return _Released(watched) if watched else None


class _Released:
    """Done once ZeroMQ has let go of every watched frame.

    pyzmq holds the object a zero-copy frame was made from (here a fresh array over the
    frame's bytes, which only it references once the send has returned) until libzmq frees
    the message, then drops it on its garbage-collector thread: a frame is let go of when
    its array is gone. Cheaper than pyzmq's own trackers (a frame made with `track=True`,
    with a MessageTracker and a threading.Event, takes about 14 µs; one made without, about
    2.6, and the array and its weak reference about 0.35), and as exact.
    """

    __slots__ = ("_done", "_watched")

    def __init__(self, watched: list[weakref.ref[np.ndarray]]) -> None:
        self._watched = watched
        self._done = False

    @property
    def done(self) -> bool:
        if not self._done:
            self._done = all(ref() is None for ref in self._watched)
        return self._done


class ZmqServer:
    """The coordinator's sockets: a ROUTER for requests and an XPUB for broadcasts."""

    def __init__(
        self,
        bind: str,
        *,
        max_message_bytes: int,
        pub_port: int | None = None,
        keys: ServerKeys | None = None,
        hub: Hub | None = None,
    ) -> None:
        host, port = split_endpoint(bind)
        self._hub = hub
        self._context: zmq.Context[Any] = hub.context if hub is not None else zmq.Context()
        self._sockets: list[LoopSocket] = []
        self._keys = keys
        self._gate: KeyGate | None = None
        try:
            if keys is not None:
                # Listening before any bind: libzmq lets every CURVE key in while no ZAP
                # handler is there.
                self._gate = KeyGate(self._context, keys.admitted)
            self._requests = self._socket(zmq.ROUTER, max_message_bytes)
            self._router = self._requests.socket
            # Peers without keys never reach the gate (libzmq drops them at the mechanism
            # mismatch): only the socket's monitor sees them.
            self._monitor = (self._router.get_monitor_socket(_PLAIN_REFUSED)
                             if keys is not None else None)
            try:
                self._router.bind(f"tcp://{host}:{port or '*'}")
            except zmq.ZMQError as e:
                raise OSError(f"cannot bind the request port, {bind} ({_reason(e)}): stop "
                              "what holds it (a coordinator still running?), or choose "
                              "another port") from None
            self.endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
            _, bound = split_endpoint(self.endpoint)
            # A fixed request port gets a fixed broadcast port beside it (firewall rules);
            # a random one gets a random one.
            self._broadcasts = self._socket(zmq.XPUB, max_message_bytes)
            self._pub = self._broadcasts.socket
            self._topics: set[bytes] = set()  # subscribed to (prefixes, as SUB matches)
            # A stalled subscriber may hold at most this many versions; past it PUB drops,
            # and the worker catches up with a Pull.
            self._pub.setsockopt(zmq.SNDHWM, PUB_QUEUE)
            want = pub_port if pub_port is not None else (port + 1 if port else 0)
            try:
                self._pub.bind(f"tcp://{host}:{want or '*'}")
            except zmq.ZMQError as e:
                raise OSError(f"cannot bind the broadcast port, tcp://{host}:{want} "
                              f"({_reason(e)}), which is the request port + 1 unless "
                              "--pub-port says otherwise: stop what holds it, or give "
                              "another --pub-port") from None
            _, self.pub_port = split_endpoint(self._pub.getsockopt_string(zmq.LAST_ENDPOINT))
            # With a hub, also in-process: for a worker of this process (after the tcp
            # binds, which LAST_ENDPOINT above must name).
            self.inproc_endpoint = ""
            if hub is not None:
                requests, broadcasts = _inproc(bound)
                self._router.bind(requests)
                self._pub.bind(broadcasts)
                self.inproc_endpoint = requests
        except BaseException:
            self.close()
            raise
        self.port = bound
        self._plain_refused = 0

    @property
    def rejected(self) -> int:
        """Connections refused with keys on: handshakes of unknown keys, and of peers with
        none (0 without keys). Read without waiting."""
        if self._monitor is not None:
            while True:
                try:
                    self._monitor.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._plain_refused += 1
        return self._plain_refused + (self._gate.rejected if self._gate is not None else 0)

    def _socket(self, kind: int, max_message_bytes: int) -> LoopSocket:
        socket: zmq.Socket[Any] = self._context.socket(kind)
        self._sockets.append(LoopSocket(socket))
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        if self._keys is not None:
            curve_server(socket, self._keys)
        return self._sockets[-1]

    async def recv(self) -> tuple[bytes, list[memoryview]]:
        frames = await self._requests.recv_multipart()
        return frames[0].bytes, [f.buffer for f in frames[1:]]

    async def send(self, peer: bytes, frames: Frames) -> Tracker | None:
        return await _send(self._requests, [peer, *frames])

    async def publish(self, frames: Frames, topic: bytes = TOPIC_ALL) -> Tracker | None:
        return await _send(self._broadcasts, [topic, *frames])

    def wants(self, topic: bytes) -> bool:
        """Whether any subscriber takes `topic` (as far as the subscriptions handed up so
        far say: they are read here, never waited for)."""
        while True:
            try:
                change = self._pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            if change[:1] == b"\x01":
                self._topics.add(change[1:])
            elif change[:1] == b"\x00":
                self._topics.discard(change[1:])
        return any(topic.startswith(prefix) for prefix in self._topics)

    def close(self) -> None:
        # The gate's sockets belong to a shadow of this context, which destroy() does not
        # close: stop it first, or terminating the context would wait on them forever.
        if self._gate is not None:
            self._gate.close()
            self._gate = None
        monitor = getattr(self, "_monitor", None)
        if monitor is not None:  # (before the socket it watches)
            self._router.disable_monitor()
            monitor.close(linger=0)
            self._monitor = None
        for socket in self._sockets:  # (unwatched first: the loop must not poll closed ones)
            socket.close()
        if self._hub is None:  # a hub's context outlives us
            self._context.destroy(linger=0)


class ZmqRouter:
    """A lone ROUTER: a rendezvous that answers requests and publishes nothing (the
    collectives of custom loops, see nodes.rendezvous), or a pipeline stage's inbox, which
    its neighbours' `ZmqSender`s send to (nodes.neighbours)."""

    def __init__(self, bind: str, *, max_message_bytes: int, keys: ServerKeys | None = None,
                 hub: Hub | None = None) -> None:
        """`hub`: this process's shared context, else one of its own (whose I/O thread is
        one more thread)."""
        host, port = split_endpoint(bind)
        self._hub = hub
        self._context: zmq.Context[Any] = hub.context if hub is not None else zmq.Context()
        self._gate: KeyGate | None = None
        (self._requests,) = _new_sockets(self._context, [zmq.ROUTER], own_context=hub is None)
        self._router = self._requests.socket
        try:
            if keys is not None:
                self._gate = KeyGate(self._context, keys.admitted)  # before any bind
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
            if keys is not None:
                curve_server(self._router, keys)
            self._router.bind(f"tcp://{host}:{port or '*'}")
            self.endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:
            self.close()
            raise OSError(f"cannot bind {bind} ({_reason(e)}): stop what holds "
                          "the port, or choose another") from None
        except BaseException:
            self.close()
            raise
        _, self.port = split_endpoint(self.endpoint)

    async def recv(self) -> tuple[bytes, list[memoryview]]:
        frames = await self._requests.recv_multipart()
        return frames[0].bytes, [f.buffer for f in frames[1:]]

    async def send(self, peer: bytes, frames: Frames) -> Tracker | None:
        return await _send(self._requests, [peer, *frames])

    def close(self, *, linger_s: float = 0.0) -> None:
        """Close; with `linger_s`, first give queued replies that long to leave (the last
        answers of a rendezvous whose host process is about to go)."""
        if self._gate is not None:
            self._gate.close()
            self._gate = None
        linger = round(linger_s * 1000)
        self._requests.close(linger=linger)
        if self._hub is None:  # (a hub's context outlives us)
            self._context.destroy(linger=linger)


class ZmqSender:
    """A lone DEALER that only sends, to one ROUTER, which reads `routing_id` as the name of
    whoever sent (a pipeline stage's link to a neighbour's inbox: nodes.neighbours). Until
    the connection is made, messages queue (up to ZeroMQ's high-water mark, then a send
    waits: give it a deadline)."""

    def __init__(self, connect: str, *, routing_id: bytes, hub: Hub | None = None) -> None:
        split_endpoint(connect)
        self.endpoint = connect
        self._hub = hub
        self._context: zmq.Context[Any] = hub.context if hub is not None else zmq.Context()
        (self._requests,) = _new_sockets(self._context, [zmq.DEALER], own_context=hub is None)
        try:
            socket = self._requests.socket
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.ROUTING_ID, routing_id)
            socket.connect(connect)
        except BaseException:
            self.close()
            raise

    async def send(self, frames: Frames) -> Tracker | None:
        return await _send(self._requests, frames)

    def close(self) -> None:
        self._requests.close()
        if self._hub is None:
            self._context.destroy(linger=0)


class ZmqClient:
    """A worker's sockets: a DEALER to the coordinator's ROUTER and a SUB to its PUB."""

    def __init__(
        self, connect: str, *, max_message_bytes: int, keys: ClientKeys | None = None,
        hub: Hub | None = None,
    ) -> None:
        # inproc://: a coordinator of this process bound with the same hub.
        self._inproc = connect.startswith("inproc://")
        if self._inproc and hub is None:
            raise ValueError(f"{connect} is in-process: it needs the Hub its coordinator uses")
        self._host = "" if self._inproc else split_endpoint(connect)[0]
        self._connect = connect
        self._hub = hub
        self._context: zmq.Context[Any] = hub.context if hub is not None else zmq.Context()
        self._requests, self._broadcasts = _new_sockets(
            self._context, [zmq.DEALER, zmq.SUB], own_context=hub is None)
        self._dealer, self._sub = self._requests.socket, self._broadcasts.socket
        # The DEALER's connection events, read without the loop (see `connection_problem`).
        self._monitor: zmq.Socket[Any] | None = None
        self._topics: set[bytes] = set()  # subscribed to
        self._pub_port: int | None = None  # connected to
        self._connected = False
        self._handshake_failure: str | None = None
        self._curve = keys is not None
        try:
            for socket in (self._dealer, self._sub):
                socket.setsockopt(zmq.LINGER, 0)
                socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
                if keys is not None:
                    curve_client(socket, keys)  # a malformed key fails here, before connect
            address = f"inproc://tensorbus-monitor-{id(self)}"
            self._dealer.monitor(address, _WATCHED)
            self._monitor = self._context.socket(zmq.PAIR)
            self._monitor.setsockopt(zmq.LINGER, 0)
            self._monitor.connect(address)
            self._dealer.connect(connect)
            self._connected = self._inproc  # inproc connects at once, with no events
        except BaseException:
            self.close()
            raise

    def connection_problem(self) -> str | None:
        """Why nothing may have come back, as far as ZeroMQ can tell: a refused CURVE
        handshake, or no connection at all; None once a connection was made and nothing
        failed. It reads the events queued since the last call (never blocks)."""
        while self._monitor is not None:
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
            kind, value = event["event"], event["value"]
            failed = kind in (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_AUTH,
                              zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._connected, self._handshake_failure = True, None
            elif failed and (not self._curve or (
                    kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)):
                # Any handshake failure of a client without keys is a mismatch (a server
                # without keys refuses nobody), whatever detail reached us: under load the
                # server may close before the mismatch event is raised here.
                self._handshake_failure = HANDSHAKE_MECHANISM
            elif failed and self._handshake_failure != HANDSHAKE_MECHANISM:
                # A mismatch, once seen, is the diagnosis: a retry after it may fail with
                # less detail (seen under load), which must not hide it.
                self._handshake_failure = HANDSHAKE_REFUSED
            elif kind == zmq.EVENT_CONNECTED:
                self._connected = True
        if self._handshake_failure is not None:
            return self._handshake_failure
        return None if self._connected else NOT_CONNECTED

    def subscribe(self, pub_port: int, *, shared: bool = False) -> None:
        """Take broadcasts from `pub_port`: the versions' weights by reference if `shared`,
        else as bytes (see above); called again, it only changes that choice."""
        want = {TOPIC_ALL, TOPIC_SHARED if shared else TOPIC_WEIGHTS}
        for topic in self._topics - want:
            self._sub.setsockopt(zmq.UNSUBSCRIBE, topic)
        for topic in want - self._topics:
            self._sub.setsockopt(zmq.SUBSCRIBE, topic)
        self._topics = want
        if self._pub_port == pub_port:
            return
        if self._inproc:
            self._sub.connect(self._connect + "-broadcasts")
        else:
            self._sub.connect(f"tcp://{self._host}:{pub_port}")
        self._pub_port = pub_port

    async def send(self, frames: Frames) -> Tracker | None:
        return await _send(self._requests, frames)

    async def recv(self) -> list[memoryview]:
        return [f.buffer for f in await self._requests.recv_multipart()]

    async def recv_broadcast(self) -> list[memoryview]:
        """A broadcast's frames, after its topic."""
        return [f.buffer for f in (await self._broadcasts.recv_multipart())[1:]]

    def close(self) -> None:
        if self._monitor is not None:
            self._monitor.close()
            self._monitor = None
        if self._hub is not None:  # the hub's context outlives us: stop what we started
            with contextlib.suppress(zmq.ZMQError):
                self._dealer.disable_monitor()
        for socket in (self._requests, self._broadcasts):  # (unwatched first)
            socket.close()
        if self._hub is None:
            self._context.destroy(linger=0)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop where it is installed (faster wake-ups), the standard loop otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
