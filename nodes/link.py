"""A worker's link to one coordinator (or one coordinator shard): requests, answers, versions.

A `Link` owns one DEALER and SUB pair and everything a worker knows of the coordinator at
the other end: when it was last heard, the newest version it announced, the newest weights
received and not yet loaded, and the requests awaiting an answer (matched by id). It loads
weights only into its own part of the worker's flat buffers (its `Shard`: the whole model
when there is one coordinator), and only when the worker asks, between computes.

The worker (`nodes.worker`) drives one link per coordinator shard with one training loop;
the link runs its receive loops as tasks on the same event loop: `_replies` (answers on
the DEALER) for as long as the link is open, and, for one membership (a session),
`_broadcasts` (versions, heartbeats and stop on the SUB), a heartbeat sender and a
watchdog. A missed broadcast is noticed from the coordinator's heartbeats, which carry its
version, and fetched with a Pull (the clone pattern).

A version may come whole (Weights) or as what changed since the one before (Changes,
nodes.changes): the link keeps the newest whole weights not loaded yet and the unbroken
chain of Changes after them, and loads both, in order. Changes that do not follow on
from the newest version it has (one was missed: a subscriber that connected late, or a
full queue) are kept aside, and the whole version is pulled; those that follow on from
it are then taken (`_resyncs`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from tensorbus.bus.buffers import Tracker
from tensorbus.bus.clock import SYSTEM_CLOCK, Clock
from tensorbus.bus.codec import decode, encode
from tensorbus.bus.deadline import within
from tensorbus.bus.errors import (
    HandshakeError,
    PeerTimeoutError,
    ProtocolVersionError,
    RejectedError,
    WireError,
    quote,
)
from tensorbus.bus.layout import Shard
from tensorbus.bus.messages import (
    BUILD,
    Changes,
    Heartbeat,
    Join,
    Leave,
    Message,
    Phase,
    Pull,
    Reject,
    RejectCode,
    Stop,
    Weights,
    Welcome,
)
from tensorbus.bus.pieces import copy_into
from tensorbus.bus.security import ClientKeys
from tensorbus.bus.shared import Probe, Ref, Shelf
from tensorbus.bus.transport import (
    HANDSHAKE_MECHANISM,
    HANDSHAKE_REFUSED,
    ClientFactory,
    ClientTransport,
    Hub,
    ZmqClient,
)
from tensorbus.nodes import changes as changed
from tensorbus.nodes.model_buffers import ModelBuffers

log = logging.getLogger("tensorbus.worker")
_SETS_MAPPED = 16  # the coordinator's weight sets kept mapped (bus.shared.Gallery)
_ASIDE = 64  # Changes kept aside while a missed one is made up for; older ones are let go
JOIN_SAY_S = 10.0  # a join unanswered this long is said in the log, once


@dataclass(frozen=True)
class Newer:
    """A newer version than the one loaded: whole weights (or none), then Changes on top."""

    weights: Weights | Welcome | None
    changes: tuple[Changes, ...]

    @property
    def version(self) -> int:
        return self.changes[-1].version if self.changes else self.weights.version  # type: ignore[union-attr]


class Stopped(Exception):
    """The coordinator said training is over."""


class RunFailedError(Exception):
    """The coordinator ended the run with an error (a worker ends it so too)."""


class Owner(Protocol):
    """What a link needs of its worker: who it is and what it does, for requests and beats,
    and how to end the worker's session when this coordinator is lost or removed us."""

    rank: int
    phase: Phase
    clock: int

    def end_session(self, why: Exception) -> None: ...


class Link:
    def __init__(
        self,
        endpoint: str,
        shard: Shard,
        weights: tuple[torch.Tensor, ...],
        owner: Owner,
        *,
        request_timeout_s: float,
        keys: ClientKeys | None = None,
        hub: Hub | None = None,
        probe: str = "",
        transport: ClientFactory = ZmqClient,
        clock: Clock = SYSTEM_CLOCK,
        model_buffers: ModelBuffers | None = None,
    ) -> None:
        """`probe`: the worker's bus.shared.Probe offer, named in its Join ("": it pushes
        bytes only). `transport` makes the sockets; `clock` is read for every deadline.
        `model_buffers`: where the buffers published with the weights are loaded (the
        link to the first shard's; None: the coordinator's buffers are not taken here)."""
        self.endpoint = endpoint
        self._probe = probe
        self._hub = hub
        self._transport = transport
        self._clock = clock
        self.layout = shard.layout
        self._weights = weights  # this shard's views of the worker's flat weights
        self.model_buffers = model_buffers
        self._published_buffers: tuple[torch.Tensor, ...] = ()  # the last loaded, kept
        self._owner = owner
        self._keys = keys
        self._client: ClientTransport | None = None
        self._receiving: asyncio.Task[None] | None = None
        self._broken: RuntimeError | None = None  # why the receive loop died, if it did
        self._requests = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Message]] = {}
        self.version = 0  # the version of this shard's weights in the model now
        self._latest: Weights | None = None  # newest weights received, not yet loaded
        self._latest_shared = False  # they came by reference: loaded by load_shared only
        self._chain: list[Changes] = []  # each on top of the last, the first on the newest whole
        self._aside: dict[int, Changes] = {}  # base -> Changes that do not follow on (yet)
        self._gap = asyncio.Event()  # set: a version was missed; pull the whole one
        self._newer = asyncio.Event()
        self.stopped = False
        self.failure: str | None = None  # why the coordinator's run failed, if it said so
        self._coordinator_version = 0
        self.seen = -math.inf  # when last heard; never: nobody to say goodbye to
        self.joined = False  # welcomed once: a worker stopped before that has nobody to leave
        self.heartbeat_s = 0.5
        self.timeout_s = 10.0
        self._config_request_timeout_s = request_timeout_s
        self._request_timeout_s = request_timeout_s
        self._announced_port = 0  # the broadcast port the last Welcome named
        # The coordinator takes tensors by reference, and sees our /dev/shm (bus.shared):
        # it also broadcasts its versions by reference, read through this shelf.
        self.shared = False
        self._shelf: Shelf | None = None
        self.by_reference = 0  # versions loaded from the coordinator's shared memory
        self.torn = 0  # of those, copies thrown away: the set was being written meanwhile

    @property
    def peer(self) -> str:
        return f"coordinator at {self.endpoint}"

    def open(self) -> None:
        self._client = self._transport(self.endpoint, max_message_bytes=self.layout.nbytes + 65536,
                                 keys=self._keys, hub=self._hub)
        self._receiving = asyncio.create_task(self._replies())
        self._receiving.add_done_callback(self._replies_ended)

    def _replies_ended(self, task: asyncio.Task[None]) -> None:
        """A receive loop that died of a bug would leave every request to time out, and a
        join to retry until its deadline: fail them at once, with the cause."""
        if task.cancelled() or task.exception() is None:
            return
        self._broken = RuntimeError(f"worker {self._owner.rank}: receiving answers from the "
                                    f"{self.peer} failed: {task.exception()!r}")
        self._broken.__cause__ = task.exception()
        for future in self._pending.values():
            if not future.done():
                future.set_exception(self._broken)

    async def close(self) -> None:
        if self._receiving is not None:
            self._receiving.cancel()
            await asyncio.gather(self._receiving, return_exceptions=True)
        if self._client is not None:
            self._client.close()

    # Joining -------------------------------------------------------------------------------

    async def join(self, rank: int, within_s: float, what: str, *, any_rank: bool) -> Welcome:
        """Ask to join as `rank` until admitted, refused, or `within_s` has passed, backing
        off; with `any_rank`, take any rank when that one went to another worker."""
        deadline = self._clock.monotonic() + within_s
        wait = 1.0
        say_at = self._clock.monotonic() + JOIN_SAY_S  # say once that nobody answers yet
        while True:
            join = Join(sender=self._owner.rank, rank=rank, layout=self.layout.digest, build=BUILD,
                        shared=self._probe)
            try:
                left = max(deadline - self._clock.monotonic(), 0.1)
                reply = await self.request(join, timeout=min(wait, left))
            except PeerTimeoutError:
                problem = self._client.connection_problem() if self._client else None
                if problem in (HANDSHAKE_REFUSED, HANDSHAKE_MECHANISM):
                    raise HandshakeError(self.peer, problem) from None  # waiting will not mend it
                if self._clock.monotonic() >= deadline:
                    raise PeerTimeoutError(self.peer, what, within_s, problem or "") from None
                if self._clock.monotonic() >= say_at:
                    say_at = math.inf
                    who = f"worker {rank}" if rank >= 0 else "a worker (any rank)"
                    log.warning("%s: no answer to its %s from the %s yet (%s); trying "
                                "for %.0f s in all", who, what.split(" ")[0],
                                self.peer, problem or "is it running?", within_s)
                wait = min(wait * 2, 10.0)
                continue
            except RejectedError as e:
                if e.code == RejectCode.RANK_TAKEN.value and any_rank and rank != -1:
                    rank = -1  # our old rank went to another worker; any will do
                    continue
                raise
            if not isinstance(reply, Welcome):
                raise RejectedError("unexpected", f"join answered by {reply.KIND.name}")
            self.load(reply)
            self.joined = True
            self._latest, self._chain, self._aside = None, [], {}
            self._gap.clear()
            self._coordinator_version = reply.version  # a restarted coordinator may be behind
            self.heartbeat_s, self.timeout_s = reply.heartbeat_s, reply.timeout_s
            # Past the coordinator's own liveness timeout, a missing answer means it is gone.
            self._request_timeout_s = min(self._config_request_timeout_s, reply.timeout_s)
            self.seen = self._clock.monotonic()
            self._announced_port = reply.pub_port
            # In process, frames go by reference already (inproc, zero copy).
            self.shared = (bool(reply.shared and self._probe)
                           and not self.endpoint.startswith("inproc://") and Probe.seen(reply.shared))
            return reply

    def session(self) -> list[Coroutine[Any, Any, None]]:
        """What runs beside the training loop for the membership the last join began:
        receiving broadcasts, beating, watching that the coordinator is alive."""
        assert self._client is not None
        # (It connects once a port: SUB reconnects by itself.)
        self._client.subscribe(self._announced_port, shared=self.shared)
        if self.shared and self._shelf is None:
            self._shelf = Shelf(_SETS_MAPPED)
        return [self._broadcasts(), self._resyncs(), self._heartbeats(), self._watchdog()]

    # Versions ------------------------------------------------------------------------------

    def load(self, weights: Weights | Welcome | Newer) -> None:
        """Copy received weights into this shard's part of the model (one copy, straight
        from the frames), then write the Changes after them, and take their version."""
        if isinstance(weights, Newer):
            if weights.weights is not None:
                self.load(weights.weights)
            for change in weights.changes:
                changed.apply(self._weights, change.tensors)
                self._load_buffers(change)
                self.version = change.version
            return
        self.layout.check([(t.dtype, tuple(t.shape)) for t in weights.tensors])
        with torch.no_grad():
            for dst, src in zip(self._weights, weights.tensors, strict=True):
                copy_into(dst, src)
        self._load_buffers(weights)
        self.version = weights.version

    def _load_buffers(self, message: Message) -> None:
        """The model's buffers published with these weights, if they came with them."""
        if message.state and self.model_buffers is not None:
            self.model_buffers.load(message.state)
            if not self._published_buffers:  # (made once, then written over)
                self._published_buffers = self.model_buffers.copy()
            else:
                for kept, loaded in zip(self._published_buffers, self.model_buffers.flat,
                                        strict=True):
                    kept.copy_(loaded)

    async def load_shared(self) -> None:
        """Load, here on the loop, the newest whole weights if they came by reference (from
        the coordinator's shared memory: bus.shared.Gallery), so that nothing loads them
        off the loop; then `latest` holds none. A copy made while the coordinator wrote the
        set again (its generation moved) is thrown away, and the version's bytes pulled."""
        while self.shared_pending():
            weights = self._latest
            assert weights is not None and self._shelf is not None
            first = weights.tensors[0]
            assert isinstance(first, torch.Tensor)  # (by reference: one view a tensor)
            had = self.version
            self.load(weights)
            whole = Shelf.generation(first) == weights.generation
            self._latest, self._latest_shared = None, False
            del weights, first  # (the references, not the set: it stays mapped)
            if whole:
                self.by_reference += 1
            else:
                self.torn += 1
                log.info("worker %d: the %s rewrote the weights of version %d while they "
                         "were copied: pulling them", self._owner.rank, self.peer, self.version)
                self.version = had  # what the model holds now is nobody's version
                # Changes on top of the torn version wait aside for the version pulled.
                self._aside.update((c.base, c) for c in self._chain)
                self._chain = []
                reply = await self.request(Pull(sender=self._owner.rank, version=had))
                if not (isinstance(reply, Weights) and reply.tensors):
                    raise RejectedError("unexpected", f"a pull of a version past {had} "
                                                      "answered without weights")
                self.load(reply)
                # Changes that follow on from it are taken; the others pulled again.
                self._follow_on()
                if self._aside:
                    self._gap.set()
            # (Newer weights by reference may have come while a pull was awaited.)

    def take_shared(self) -> Weights | None:
        """The newest whole weights, if they came by reference with nothing chained on
        them and their set is not being written again yet: taken as loaded (their
        version), for a worker that computes on them where they lie (nodes.worker,
        `_follow_set`) instead of copying them in (load_shared). None otherwise."""
        weights = self._latest
        if not self.shared_pending() or self._chain or weights is None:
            return None
        first = weights.tensors[0]
        assert isinstance(first, torch.Tensor)  # (by reference: one view a tensor)
        if Shelf.generation(first) != weights.generation:
            return None  # rewritten already: load_shared copies, finds it torn, and pulls
        self._latest, self._latest_shared = None, False
        self._load_buffers(weights)
        self.version = weights.version
        self.by_reference += 1
        return weights

    def give_back(self, weights: Weights) -> None:
        """The model no longer computes on `weights` where they lie (taken with
        take_shared), and its own buffers hold them no more: unless a newer version is
        waiting to be loaded, have load_shared copy them in (or pull their version, if
        their set was written again meanwhile)."""
        if self.newest() > weights.version:
            return  # loaded whole before the next compute
        self._latest, self._latest_shared, self._chain = weights, True, []
        self.by_reference -= 1  # counted again when copied
        # What the model holds now is nobody's version: the one before, so that the
        # version is loaded again (and a Pull asks for it).
        self.version = weights.version - 1

    def shared_pending(self) -> bool:
        """Whether the newest whole weights came by reference and are not loaded yet."""
        return (self._latest_shared and self._latest is not None
                and self._latest.version > self.version)

    def rebind(self, weights: tuple[torch.Tensor, ...]) -> None:
        """This shard's views of the worker's flat weights, where the model now has them
        (a colocated worker moves between weight sets: nodes.handover)."""
        self.layout.check([(t.dtype, tuple(t.shape)) for t in weights])
        self._weights = weights

    def load_latest(self) -> None:
        newer = self.latest()
        if newer is not None:
            self.load(newer)
        self.forget_loaded()  # drop the frames as soon as they are copied

    def latest(self) -> Newer | None:
        """What is newer than the loaded version, if anything: for a worker that loads
        it off the loop (`load` it, then `forget_loaded` on the loop)."""
        if self.newest() <= self.version or self.shared_pending():
            return None  # (weights by reference are for load_shared, on the loop)
        whole = self._latest if self._latest is not None and self._latest.version > self.version else None
        return Newer(whole, tuple(self._chain))

    def forget_loaded(self) -> None:
        """Let go of received weights that are loaded by now: their frames may be the
        sender's own memory (in-process links), which it may not reuse while we hold them."""
        if self._latest is not None and self._latest.version <= self.version:
            self._latest = None
        while self._chain and self._chain[0].version <= self.version:
            del self._chain[0]

    async def load_final(self, *, changed: bool = False) -> None:
        """Once stopped: load the weights of the version the coordinator stopped at, pulling
        them if their broadcast was missed (a stopping coordinator still answers a Pull),
        or if the worker has `changed` the loaded ones since (local optimizer steps)."""
        have = 0 if changed else self.newest()  # (version 0 is never changed: none newer)
        if have < self._coordinator_version:
            try:
                reply = await self.request(Pull(sender=self._owner.rank, version=have),
                                           timeout=min(self._request_timeout_s, 2.0))
                if isinstance(reply, Weights) and reply.tensors:
                    self.load(reply)
            except (PeerTimeoutError, RejectedError, Stopped) as e:
                log.warning("worker %d: could not fetch the final weights of version %d from "
                            "the %s: %s", self._owner.rank, self._coordinator_version, self.peer, e)
        try:
            await self.load_shared()
        except (PeerTimeoutError, RejectedError, Stopped) as e:
            log.warning("worker %d: could not load the final weights from the %s (its "
                        "model holds a torn copy of that range): %s", self._owner.rank,
                        self.peer, e)
        self.load_latest()
        if self._published_buffers and self.model_buffers is not None:
            # A forward begun on the last version before the stop came moved them on.
            self.model_buffers.load(self._published_buffers)

    def newest(self) -> int:
        if self._chain:
            return self._chain[-1].version
        return max(self.version, self._latest.version if self._latest else -1)

    async def await_version(self, *, newer_than: int) -> None:
        """Wait for a version past `newer_than`, pulling it if the broadcast was missed."""
        while self.newest() <= newer_than:
            if self.stopped:
                raise Stopped
            self._newer.clear()
            try:
                await asyncio.wait_for(self._newer.wait(), self.heartbeat_s * 2)
                quiet = False
            except TimeoutError:
                quiet = True
            silent = self._clock.monotonic() - self.seen
            if silent > self.timeout_s:
                raise PeerTimeoutError(self.peer, f"version {newer_than + 1}", silent)
            have = self.newest()
            # Two quiet heartbeat periods, or a heartbeat announcing a version we lack: ask.
            # A Pull for what we have is answered without tensors, so asking is cheap.
            if quiet or self._coordinator_version > have:
                reply = await self.request(Pull(sender=self._owner.rank, version=have))
                if isinstance(reply, Weights) and reply.tensors:
                    self._keep_newest(reply)

    def _keep_newest(self, weights: Weights, *, shared: bool = False) -> None:
        """`shared`: its tensors lie in the coordinator's shared memory (see load_shared)."""
        if weights.version > self.newest():
            self._latest, self._chain = weights, []
            self._latest_shared = shared
            self._follow_on()
            self._newer.set()

    def _take_changes(self, change: Changes) -> None:
        """Chain Changes on if they follow on from the newest version; else keep them
        aside and have the whole version pulled (unless they are old)."""
        if change.version <= self.newest():
            return
        wrong = changed.out_of_range(self.layout, change.tensors)
        if wrong is not None:
            log.warning("worker %d: the %s broadcast changes out of range (%s); ignored",
                        self._owner.rank, self.peer, wrong)
            return
        if change.base != self.newest():
            self._aside[change.base] = change
            while len(self._aside) > _ASIDE:
                del self._aside[min(self._aside)]
            self._gap.set()
            return
        self._chain.append(change)
        self._follow_on()
        self._newer.set()

    def _follow_on(self) -> None:
        """Chain on what was kept aside and now follows on; let go of what is older."""
        while (change := self._aside.pop(self.newest(), None)) is not None:
            self._chain.append(change)
        for base in [b for b in self._aside if b < self.newest()]:
            del self._aside[base]

    # Requests ------------------------------------------------------------------------------

    async def request(
        self, message: Message, *, timeout: float | None = None, patient: bool = False
    ) -> Message:
        reply, _ = await self.request_tracked(message, timeout=timeout, patient=patient)
        return reply

    async def request_tracked(
        self, message: Message, *, timeout: float | None = None, patient: bool = False,
        refer: Callable[[torch.Tensor], Ref | None] | None = None,
    ) -> tuple[Message, Tracker | None]:
        """Send a request and wait for its answer: within `timeout` (default: the request
        timeout), or, if `patient`, for as long as the coordinator keeps beating. Tensors
        that `refer` places go by reference (bus.shared), the others as frames."""
        assert self._client is not None
        if self._broken is not None:
            raise self._broken
        request = next(self._requests)
        future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._pending[request] = future
        seconds = timeout if timeout is not None else self._request_timeout_s
        what = f"{message.KIND.name.lower()} (request {request})"
        try:
            # The send has a deadline too: a DEALER whose peer is gone blocks in send.
            frames = encode(replace(message, request=request), refer=refer)
            tracker = await within(self._client.send(frames),
                                   seconds, peer=self.peer, waiting_for=f"sending {what}")
            if patient:
                reply = await self._while_alive(future, waiting_for=what)
            else:
                reply = await within(future, seconds, peer=self.peer, waiting_for=what)
        finally:
            self._pending.pop(request, None)
        match reply:
            case Stop():
                self._stopped_by(reply)
                raise Stopped
            case Reject(code=code, detail=detail):
                raise RejectedError(code, detail)
        return reply, tracker

    def _stopped_by(self, stop: Stop) -> None:
        self.stopped = True
        if stop.reason == "error":
            self.failure = stop.detail or "no reason given"

    async def _while_alive(self, future: asyncio.Future[Message], *, waiting_for: str) -> Message:
        while True:
            done, _ = await asyncio.wait({future}, timeout=self.heartbeat_s)
            if done:
                return future.result()
            silent = self._clock.monotonic() - self.seen
            if silent > self.timeout_s:
                raise PeerTimeoutError(self.peer, waiting_for, silent)

    async def leave(self, reason: str, detail: str) -> None:
        """Say goodbye, briefly: the coordinator may already be gone."""
        if not self.joined or self._clock.monotonic() - self.seen > self.timeout_s:
            return  # never a member (stopped while joining), or it is gone: nobody to tell
        try:
            await self.request(Leave(sender=self._owner.rank, version=self.version, reason=reason,
                                     detail=detail[:1000]), timeout=2.0)
        except (PeerTimeoutError, RejectedError, Stopped):
            pass

    # Receiving -----------------------------------------------------------------------------

    def _heard(self, message: Message) -> None:
        self.seen = self._clock.monotonic()
        self._coordinator_version = max(self._coordinator_version, message.version)

    async def _replies(self) -> None:
        assert self._client is not None
        while True:
            frames = await self._client.recv()
            try:
                message = decode(frames, layout=self.layout)
            except ProtocolVersionError as e:
                # Another release: nothing it says can be read, so every wait would time
                # out; say why now, to whatever waits for an answer.
                refused = RejectedError(RejectCode.PROTOCOL.value, (
                    f"the coordinator speaks protocol {quote(e.got)}, this worker {e.expected}: "
                    "run the same tensorbus release on the coordinator and every worker"))
                for future in self._pending.values():
                    if not future.done():
                        future.set_exception(refused)
                continue
            except WireError as e:
                log.warning("worker %d: bad reply from the %s: %s", self._owner.rank, self.peer, e)
                continue
            del frames  # the message holds what it needs of them (see _broadcasts)
            self._heard(message)
            waiting = self._pending.get(message.request)
            if waiting is not None and not waiting.done():
                waiting.set_result(message)
            elif isinstance(message, Reject):
                if message.code == RejectCode.UNKNOWN_WORKER.value:
                    # It no longer counts us (removed while silent, or restarted): join
                    # again. Answers to what was queued before a join (beats sent while
                    # the coordinator was away) come before its Welcome: no session to end.
                    self._owner.end_session(RejectedError(message.code, message.detail))
                elif message.request:
                    # The answer to a request given up on (a join retried under load, say):
                    # the retry's answer says the same, and is the one acted on.
                    log.debug("worker %d: the %s refused request %d, answered too late: %s: %s",
                              self._owner.rank, self.peer, message.request, message.code,
                              message.detail)
                else:
                    log.warning("worker %d: the %s refused a message: %s: %s",
                                self._owner.rank, self.peer, message.code, message.detail)

    async def _broadcasts(self) -> None:
        assert self._client is not None
        while True:
            frames = await self._client.recv_broadcast()
            try:
                message = decode(frames, layout=self.layout, shelf=self._shelf)
            except WireError as e:
                log.warning("worker %d: bad broadcast: %s", self._owner.rank, e)
                continue
            self._heard(message)
            match message:
                case Weights():
                    first = message.tensors[0] if message.tensors else None
                    self._keep_newest(message, shared=self._shelf is not None
                                      and self._shelf.holds(first))
                    del first
                case Changes():
                    self._take_changes(message)
                case Heartbeat() if message.version > self.version:
                    self._newer.set()  # maybe a missed broadcast: let the waiter look
                case Stop():
                    self._stopped_by(message)
                    self._newer.set()
                    # At once, whatever the worker is doing (loading its data, say): not at
                    # its next request, which may be long in coming.
                    self._owner.end_session(Stopped())
            # Let go of the frames now, not when the next broadcast comes: sent in-process,
            # they are the coordinator's snapshot, which it may not reuse while we hold it.
            del frames, message

    async def _resyncs(self) -> None:
        """Pull the whole version when Changes were missed (they no longer follow on)."""
        while True:
            await self._gap.wait()
            self._gap.clear()
            log.debug("worker %d missed a version after %d: pulling the whole one",
                      self._owner.rank, self.newest())
            try:
                reply = await self.request(Pull(sender=self._owner.rank, version=self.newest()))
            except (PeerTimeoutError, RejectedError) as e:
                # The watchdog ends the session if the coordinator is gone; the next
                # Changes that do not follow on ask again.
                log.warning("worker %d: could not pull the weights it missed from the %s: %s",
                            self._owner.rank, self.peer, e)
                continue
            except Stopped:
                return
            if isinstance(reply, Weights) and reply.tensors:
                self._keep_newest(reply)
            if not self._aside:  # what did not follow on while we asked does now
                self._gap.clear()

    async def _heartbeats(self) -> None:
        assert self._client is not None
        owner = self._owner
        while True:
            beat = Heartbeat(sender=owner.rank, version=self.version, phase=owner.phase.value,
                             clock=owner.clock)
            await self._client.send(encode(beat))
            await asyncio.sleep(self.heartbeat_s)

    async def _watchdog(self) -> None:
        """End the session, whatever it awaits, once the coordinator is silent too long.

        Every wait has its own deadline; this is the one that holds if some wait (a send
        into a socket whose peer is gone, say) has not.
        """
        while True:
            await asyncio.sleep(self.heartbeat_s)
            silent = self._clock.monotonic() - self.seen
            if silent > self.timeout_s + self.heartbeat_s:
                owner = self._owner
                self._owner.end_session(PeerTimeoutError(
                    self.peer,
                    f"anything (worker {owner.rank} was {owner.phase.value} at version {self.version})",
                    silent,
                ))
                return
