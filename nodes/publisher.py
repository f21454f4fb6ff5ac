"""How a coordinator's versions reach its workers: broadcast as they are made, and sent to
a worker that pulls or joins.

- Each new version is broadcast: what changed since the last one published, where that is
  little (top-k updates: `bus.messages.Changes`; streaming averaging's one fragment:
  `bus.messages.Fragment`), or else the master weights themselves (nodes.master's
  snapshot, no copy), with the model's buffers behind them.
- One broadcast is on its way out at a time. A version made while the last broadcast is
  still being sent waits (`_later`) and goes once it is out, if no newer one came
  meanwhile: a worker loads the newest weights, never a queue of old ones, and under async
  updates can come faster than the PUB sends the model.
- Workers of this host (bus.shared) get the weights by reference under their own topic:
  where the set lies in the coordinator's shared memory, or else its bytes.
- A Pull or a Welcome gets the newest version, made current first (`refresh`).

No step writes a snapshot's buffers while a send reads them (`tracked`: nodes.master).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import replace

import torch

from tensorbus.bus.buffers import Tracker
from tensorbus.bus.clock import Clock
from tensorbus.bus.codec import encode
from tensorbus.bus.messages import Changes, Fragment, Message, Weights, Welcome
from tensorbus.bus.shared import HostToken, SharedWeightPool
from tensorbus.bus.transport import TOPIC_SHARED, TOPIC_WEIGHTS, ServerTransport
from tensorbus.nodes.master import AllDone, Master, tracked
from tensorbus.nodes.metrics import Metrics


class Publisher:
    def __init__(
        self, master: Master, server: ServerTransport, *, step_lock: asyncio.Lock, clock: Clock,
        heartbeat_s: float, metrics: Metrics, shared_pool: SharedWeightPool | None,
        host_token: HostToken | None,
        version: Callable[[], int], stopping: Callable[[], bool],
        buffers: Callable[[], tuple[torch.Tensor, ...]],
        background: Callable[[Awaitable[None]], asyncio.Task[None]],
        term: Callable[[], int] = lambda: 0,
    ) -> None:
        """`version`: the coordinator's newest; `term`: its term, on all it sends;
        `stopping`: whether it is stopping (no broadcast waits then); `buffers`: the
        model's, to go with the weights; `background`: runs a task whose failure fails
        the run (Coordinator._guard)."""
        self._master = master
        self._server = server
        self._step_lock = step_lock  # never copy weights that a step is writing
        self._clock = clock
        self._heartbeat_s = heartbeat_s
        self._metrics = metrics
        self._shared_pool = shared_pool
        self._host_token = host_token
        self._version = version
        self._stopping = stopping
        self._buffers = buffers
        self._background = background
        self._term = term
        self._broadcast: AllDone | Tracker | None = None  # the last broadcast, until sent
        self._later: asyncio.Task[None] | None = None  # a broadcast waiting for the last one

    @property
    def later(self) -> asyncio.Task[None] | None:
        """A broadcast waiting for the last one to be out (for the coordinator to end)."""
        return self._later

    async def publish(self) -> None:
        """Broadcast the newest version, or, while the last broadcast is still on its way
        out, have it go once that is out."""
        if self._broadcast is not None and not self._broadcast.done:
            if self._later is None or self._later.done():
                self._later = self._background(self._publish_later())
            return
        await self._publish_now()

    async def _publish_later(self) -> None:
        # Not for longer than a heartbeat: a stopped subscriber's queue may hold the last
        # broadcast until the PUB drops it, and the others must not wait on that.
        delay, until = 0.0002, self._clock.monotonic() + self._heartbeat_s
        while (self._broadcast is not None and not self._broadcast.done
               and self._clock.monotonic() < until):
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.001)
        async with self._step_lock:
            snapshot = self._master.snapshot
            if not self._stopping() and snapshot is not None and snapshot.version < self._version():
                await self._publish_now()

    async def _publish_now(self) -> None:
        server, version, term = self._server, self._version(), self._term()
        self._metrics.broadcasts += 1
        old = self._master.snapshot
        changes = self._master.changes(version)
        if changes is not None:
            assert old is not None
            message: Message = Changes(version=version, base=old.version, tensors=changes,
                                       state=self._buffers())
            self._master.advance_snapshot(changes, version, self._shared_pool)
            self._broadcast = await server.publish(encode(message, term=term))
            return
        fragment = self._master.fragment(version)
        if fragment is not None:
            # Streaming averaging: only this fragment changed; its bytes go, to every worker.
            snapshot = self._master.take_snapshot(version)
            part = Fragment(version=version, fragment=fragment, state=self._buffers(),
                            tensors=self._master.fragments[fragment].take(snapshot.buffers))
            self._broadcast = await tracked(snapshot, server.publish(encode(part, term=term)))
            return
        snapshot = self._master.take_snapshot(version)
        weights = Weights(version=snapshot.version, tensors=snapshot.buffers, state=self._buffers())
        sends: list[Tracker | None] = []
        if server.wants(TOPIC_WEIGHTS):  # (made only for someone: bus.transport)
            sends.append(await tracked(snapshot, server.publish(encode(weights, term=term),
                                                                TOPIC_WEIGHTS)))
        if self._host_token is not None and server.wants(TOPIC_SHARED):
            # For the workers of this host (bus.transport's topics): where the set lies in
            # our shared memory, and its generation, or else its bytes too.
            shared_pool = self._shared_pool
            generation = shared_pool.generation(snapshot.buffers) if shared_pool is not None else None
            frames = (encode(replace(weights, generation=generation), refer=shared_pool.locate,
                             term=term)
                      if shared_pool is not None and generation is not None
                      else encode(weights, term=term))
            sends.append(await tracked(snapshot, server.publish(frames, TOPIC_SHARED)))
        self._broadcast = AllDone(sends)

    async def refresh(self) -> None:
        """Make the snapshot current where a broadcast is waiting (see `publish`), so that
        a Pull or a Welcome gets the newest version, not the one still on its way out."""
        snapshot = self._master.snapshot
        if snapshot is not None and snapshot.version < self._version():
            async with self._step_lock:
                if self._master.snapshot is not None and self._master.snapshot.version < self._version():
                    self._master.take_snapshot(self._version())

    async def send(self, peer: bytes, message: Welcome | Weights) -> None:
        """`message` with the newest weights (and buffers), to `peer`."""
        snapshot = self._master.snapshot
        assert snapshot is not None
        message = replace(message, version=snapshot.version, tensors=snapshot.buffers,
                          state=self._buffers())
        await tracked(snapshot, self._server.send(peer, encode(message, term=self._term())))
