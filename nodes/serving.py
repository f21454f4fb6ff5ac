"""The coordinator's sockets and what hangs on them: bound once, closed once.

`bind` makes the ROUTER and the PUB (bus.transport), the token and the segment cache through
which workers of this host push by reference (bus.shared), and the publisher of versions
(nodes.publisher), and writes where it listens in the metrics. The coordinator receives,
replies and publishes through this part; `close` lets go of it all. It decides nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from tensorbus.bus.buffers import Tracker
from tensorbus.bus.codec import encode
from tensorbus.bus.messages import Message
from tensorbus.bus.shared import HostToken, SegmentCache, sweep
from tensorbus.bus.transport import Hub, ServerFactory, ServerTransport
from tensorbus.nodes.config import CoordinatorConfig
from tensorbus.nodes.metrics import Metrics
from tensorbus.nodes.publisher import Publisher

log = logging.getLogger("tensorbus.coordinator")

# Makes the publisher once the server is bound (from the server and the host token).
MakePublisher = Callable[[ServerTransport, HostToken | None], Publisher]


class Serving:
    def __init__(self, config: CoordinatorConfig, *, transport: ServerFactory, hub: Hub | None,
                 max_bytes: int, workers: int, metrics: Metrics,
                 server: ServerTransport | None = None,
                 term: Callable[[], int] = lambda: 0) -> None:
        """`workers`: the run's starting count (segments are kept for a few each).
        `server`: sockets bound already, to serve on (run.own_loop's, which waited on them
        for a script's model); `config.bind` is not bound then. `term`: the coordinator's
        (nodes.replication), on everything it sends."""
        self._config = config
        self._transport = transport
        self._hub = hub
        self.max_bytes = max_bytes
        self._workers = config.max_workers or workers
        self._metrics = metrics
        self._server: ServerTransport | None = server
        # Workers on this host push by reference (bus.shared): the proof of our /dev/shm
        # we offer them, and the segments of theirs we read from.
        self.host_token: HostToken | None = None
        self.segments: SegmentCache | None = None
        self._publisher: Publisher | None = None
        self._term = term

    def bind(self, make_publisher: MakePublisher) -> str:
        """Bind the sockets, if not done yet; return the endpoint."""
        if self._publisher is None:
            config = self._config
            if self._server is None:
                self._server = self._transport(
                    config.bind, max_message_bytes=self.max_bytes, pub_port=config.pub_port,
                    keys=config.keys, hub=self._hub,
                )
            log.info("listening on %s (broadcasts on port %d)", self.endpoint, self._server.pub_port)
            # (Said in the metrics too: whoever bound port 0 finds the port chosen there.)
            self._metrics.write("listening", endpoint=self.endpoint, pub_port=self._server.pub_port)
            if config.shared_memory:
                try:
                    sweep()  # segments of killed processes: nobody else would unlink them
                    # A few segments a worker: those of workers gone are let go of.
                    self.host_token, self.segments = HostToken(), SegmentCache(2 * self._workers + 2)
                except OSError as e:
                    log.info("workers on this host push bytes, not references: no shared "
                             "memory here (%s)", e)
            self._publisher = make_publisher(self._server, self.host_token)
        return self.endpoint

    @property
    def bound(self) -> bool:
        return self._server is not None

    @property
    def server(self) -> ServerTransport:
        if self._server is None:
            raise RuntimeError("the coordinator is not bound yet: call bind() or run()")
        return self._server

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    @property
    def publisher(self) -> Publisher:
        assert self._publisher is not None, "bind() first"
        return self._publisher

    async def reply(self, peer: bytes, message: Message) -> Tracker | None:
        return await self.server.send(peer, encode(message, term=self._term()))

    async def publish(self, message: Message) -> None:
        await self.server.publish(encode(message, term=self._term()))

    def close(self) -> None:
        """Close the sockets and the token (the counts of refused handshakes go in the
        metrics first)."""
        server = self.server
        if server.rejected:  # CURVE handshakes of unlisted keys, or none
            self._metrics.rejected["handshake"] = server.rejected
        server.close()
        if self.host_token is not None:
            self.host_token.close()
