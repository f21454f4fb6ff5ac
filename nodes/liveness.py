"""What a link has heard of its coordinator, and whether the coordinator is still alive.

A `Liveness` is one part of a `Link` (nodes.link): when the coordinator was last heard, the
newest version it announced, and whether it stopped the run (and why, if it failed). For one
membership (a session) it also runs the link's heartbeat sender and its watchdog, which ends
the session once the coordinator has been silent past its timeout. The timings are the
coordinator's own, from its Welcome.

`Owner` is what a link and its parts need of the node that holds them (a worker, or a relay
towards its root); `Stopped` is how the coordinator's stop reaches that node's awaits.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Protocol

from tensorbus.bus.clock import Clock
from tensorbus.bus.codec import encode
from tensorbus.bus.errors import PeerTimeoutError
from tensorbus.bus.messages import Heartbeat, Message, Phase, Stop, Welcome
from tensorbus.bus.transport import ClientTransport


class Stopped(Exception):
    """The coordinator said training is over."""


class Moved(Exception):
    """The coordinator said the run goes on at another coordinator, at `endpoint` (a
    standby that took over: nodes.replication); the worker joins there."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(f"the run moved to the coordinator at {endpoint}")
        self.endpoint = endpoint


class Owner(Protocol):
    """What a link needs of its worker: who it is and what it does, for requests and beats,
    and how to end the worker's session when this coordinator is lost or removed us."""

    rank: int
    phase: Phase
    clock: int

    def end_session(self, why: Exception) -> None: ...


class Liveness:
    """When the coordinator was last heard and what it said of the run; beats and watchdog."""

    def __init__(self, owner: Owner, peer: str, clock: Clock, *, loaded: Callable[[], int]) -> None:
        """`peer` names the coordinator in errors (the link renames it as it moves);
        `loaded` says the version of the link's weights in the model now (each heartbeat
        carries it)."""
        self._owner = owner
        self.peer = peer
        self._clock = clock
        self._loaded = loaded
        self.seen = -math.inf  # when last heard; never: nobody to say goodbye to
        self.coordinator_version = 0  # the newest version it announced
        self.heartbeat_s = 0.5
        self.timeout_s = 10.0
        self.stopped = False
        self.failure: str | None = None  # why the coordinator's run failed, if it said so
        self.standby = ""  # where the coordinator's standby serves, as it last said ("": none)
        # The newest coordinator term heard (nodes.replication): on all the worker sends, so
        # that a coordinator taken over while cut off steps down when it hears one of ours.
        self.term = 0
        self.run = ""  # the run's id, as the last Welcome said it (named in our joins)

    def welcomed(self, welcome: Welcome) -> None:
        """A join was answered: take the coordinator's timings and its version (a restarted
        coordinator may be behind the one before)."""
        self.coordinator_version = welcome.version
        self.heartbeat_s, self.timeout_s = welcome.heartbeat_s, welcome.timeout_s
        self.seen = self._clock.monotonic()
        self.standby = welcome.standby
        self.run = welcome.run

    def stale(self, message: Message) -> bool:
        """Whether `message` comes from a coordinator of a term older than one we heard (one
        taken over while cut off, not told yet): nothing it says counts."""
        return message.term < self.term

    def heard(self, message: Message) -> None:
        self.term = max(self.term, message.term)
        self.seen = self._clock.monotonic()
        self.coordinator_version = max(self.coordinator_version, message.version)
        if isinstance(message, Heartbeat):  # (a coordinator's beat names its standby, or none)
            self.standby = message.standby

    def stopped_by(self, stop: Stop) -> Exception:
        """The coordinator stopped the run, or moved it: what ends the session (Stopped or Moved)."""
        if stop.reason == "moved":
            return Moved(stop.detail)
        self.stopped = True
        if stop.reason == "error":
            self.failure = stop.detail or "no reason given"
        return Stopped()

    def silent_s(self) -> float:
        """Seconds since the coordinator was last heard."""
        return self._clock.monotonic() - self.seen

    async def while_alive(self, future: asyncio.Future[Message], *, waiting_for: str) -> Message:
        """The answer `future` brings, awaited for as long as the coordinator keeps beating."""
        while True:
            done, _ = await asyncio.wait({future}, timeout=self.heartbeat_s)
            if done:
                return future.result()
            silent = self.silent_s()
            if silent > self.timeout_s:
                raise PeerTimeoutError(self.peer, waiting_for, silent)

    async def heartbeats(self, client: ClientTransport) -> None:
        owner = self._owner
        while True:
            beat = Heartbeat(sender=owner.rank, version=self._loaded(), phase=owner.phase.value,
                             clock=owner.clock, term=self.term)
            await client.send(encode(beat))
            await asyncio.sleep(self.heartbeat_s)

    async def watchdog(self) -> None:
        """End the session, whatever it awaits, once the coordinator is silent too long.

        Every wait has its own deadline; this is the one that holds if some wait (a send
        into a socket whose peer is gone, say) has not.
        """
        while True:
            await asyncio.sleep(self.heartbeat_s)
            silent = self.silent_s()
            if silent > self.timeout_s + self.heartbeat_s:
                owner = self._owner
                owner.end_session(PeerTimeoutError(
                    self.peer,
                    f"anything (worker {owner.rank} was {owner.phase.value} at version "
                    f"{self._loaded()})",
                    silent,
                ))
                return
