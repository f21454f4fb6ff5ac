"""An in-memory transport: the coordinator's and the workers' two interfaces of
`bus.transport`, over queues of one event loop instead of ZeroMQ sockets.

It is the transport seam's other side: nodes take a transport factory (by default
`ZmqServer` and `ZmqClient`), and one-loop tests give them a `MemoryNetwork`'s, so that
nothing is in flight outside the loop and a `bus.clock.VirtualTimeLoop` can jump its time
(liveness in milliseconds). It keeps what the nodes rely on from ZeroMQ:

- Requests and replies are routed by a peer identity the server sees, one per client.
- A broadcast reaches the clients subscribed to its topic (`TOPIC_ALL`, and one of the
  weights' two), at most `PUB_QUEUE` waiting per client; past that it is dropped, as PUB
  drops for a slow subscriber.
- What is sent is copied at once, so a sender may reuse its buffers when `send` returns
  (no tracker).
- A message to an endpoint where nothing listens is lost, as are messages across a
  `partition` until it is healed (a lost coordinator), and every message to or from a
  client that was `sever`ed (a worker killed: it says nothing more, not even goodbye).

It has no security: keys are refused, not ignored.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from tensorbus.bus.transport import PUB_QUEUE, TOPIC_ALL, TOPIC_SHARED, TOPIC_WEIGHTS, Frames


def _copied(frames: Frames) -> list[memoryview]:
    # Writable, as a received ZeroMQ frame is (torch.frombuffer warns on read-only memory).
    return [memoryview(bytearray(memoryview(f))) for f in frames]


class MemoryNetwork:
    """Endpoints `mem://N` in this process; each server bound gets the next N."""

    def __init__(self) -> None:
        self._servers: dict[str, MemoryServer] = {}
        self._numbers = itertools.count(1)
        self._identities = itertools.count(1)
        self._cut: set[str] = set()
        self._severed: set[bytes] = set()  # client identities
        # What was lost on its way to a server, (loop time, endpoint, frames): how a test
        # sees what a node tried while nobody could hear it.
        self.lost: list[tuple[float, str, list[memoryview]]] = []

    def server(self, bind: str = "", *, max_message_bytes: int = 0, pub_port: int | None = None,
               keys: Any = None, hub: Any = None) -> MemoryServer:
        """A server (a `ServerTransport`) at a new endpoint; the arguments of `ZmqServer`,
        of which only `max_message_bytes` matters."""
        if keys is not None:
            raise ValueError("the in-memory transport has no CURVE: give no keys")
        number = next(self._numbers)
        server = MemoryServer(self, f"mem://{number}", number, max_message_bytes)
        self._servers[server.endpoint] = server
        return server

    def client(self, connect: str, *, max_message_bytes: int = 0, keys: Any = None,
               hub: Any = None) -> MemoryClient:
        """A client (a `ClientTransport`) of whatever server is at `connect`."""
        if keys is not None:
            raise ValueError("the in-memory transport has no CURVE: give no keys")
        return MemoryClient(self, connect, next(self._identities).to_bytes(5, "big"))

    def sever(self, client: MemoryClient) -> None:
        """Lose every message `client` sends or is sent from now on, for good."""
        self._severed.add(client.identity)

    def partition(self, endpoint: str) -> None:
        """Lose every message to and from the server at `endpoint` until `heal`."""
        self._cut.add(endpoint)

    def heal(self, endpoint: str) -> None:
        self._cut.discard(endpoint)

    def _reachable(self, endpoint: str) -> MemoryServer | None:
        server = self._servers.get(endpoint)
        return None if server is None or endpoint in self._cut else server


class MemoryServer:
    def __init__(self, network: MemoryNetwork, endpoint: str, port: int, max_bytes: int) -> None:
        self._network = network
        self.endpoint = endpoint
        self.inproc_endpoint = ""
        self.port = port
        self.pub_port = port
        self.rejected = 0
        self._max_bytes = max_bytes
        self._requests: asyncio.Queue[tuple[bytes, list[memoryview]]] = asyncio.Queue()
        self._clients: dict[bytes, MemoryClient] = {}  # identity -> who sent from it
        self._subscribers: list[MemoryClient] = []

    async def recv(self) -> tuple[bytes, list[memoryview]]:
        return await self._requests.get()

    async def send(self, peer: bytes, frames: Frames) -> None:
        client = self._clients.get(peer)
        if (client is not None and self._network._reachable(self.endpoint) is self
                and peer not in self._network._severed):
            client.replies.put_nowait(_copied(frames))

    async def publish(self, frames: Frames, topic: bytes = TOPIC_ALL) -> None:
        if self._network._reachable(self.endpoint) is not self:
            return
        message = _copied(frames)
        for client in self._subscribers:
            if (topic in client.topics and client.broadcasts.qsize() < PUB_QUEUE
                    and client.identity not in self._network._severed):
                client.broadcasts.put_nowait(message)

    def wants(self, topic: bytes) -> bool:
        return any(topic in c.topics for c in self._subscribers)

    def close(self) -> None:
        if self._network._servers.get(self.endpoint) is self:
            del self._network._servers[self.endpoint]

    def _take(self, client: MemoryClient, frames: list[memoryview]) -> None:
        if self._max_bytes and sum(f.nbytes for f in frames) > self._max_bytes:
            return  # ZeroMQ drops what is over MAXMSGSIZE, with the connection
        self._clients[client.identity] = client
        self._requests.put_nowait((client.identity, frames))

    def _subscribe(self, client: MemoryClient) -> None:
        if client not in self._subscribers:
            self._subscribers.append(client)


class MemoryClient:
    def __init__(self, network: MemoryNetwork, connect: str, identity: bytes) -> None:
        self._network = network
        self._connect = connect
        self.identity = identity
        self.topics: set[bytes] = set()
        self.replies: asyncio.Queue[list[memoryview]] = asyncio.Queue()
        self.broadcasts: asyncio.Queue[list[memoryview]] = asyncio.Queue()

    def connection_problem(self) -> str | None:
        return None

    def subscribe(self, pub_port: int, *, shared: bool = False) -> None:
        self.topics = {TOPIC_ALL, TOPIC_SHARED if shared else TOPIC_WEIGHTS}
        server = self._network._reachable(self._connect)
        if server is not None:
            server._subscribe(self)

    async def send(self, frames: Frames) -> None:
        server = self._network._reachable(self._connect)
        if server is not None and self.identity not in self._network._severed:
            server._take(self, _copied(frames))
        else:
            loop_time = asyncio.get_running_loop().time()
            self._network.lost.append((loop_time, self._connect, _copied(frames)))

    async def recv(self) -> list[memoryview]:
        return await self.replies.get()

    async def recv_broadcast(self) -> list[memoryview]:
        return await self.broadcasts.get()

    def close(self) -> None:
        for server in self._network._servers.values():
            if self in server._subscribers:
                server._subscribers.remove(self)
