"""A worker's link to one coordinator (or one coordinator shard): requests and their answers.

A `Link` owns one DEALER and SUB pair. It sends requests and matches their answers by id
(`request`, `request_tracked`), joins (`join`), and runs its receive loops as tasks on the
worker's event loop: `_replies` (answers on the DEALER) for as long as the link is open,
and, for one membership (a session), `_broadcasts` (versions, heartbeats and stop on the
SUB). What it hears it hands to its two parts:

- `liveness` (nodes.liveness): when the coordinator was last heard, the newest version it
  announced, whether it stopped the run; the session's heartbeat sender and watchdog.
- `versions` (nodes.version_chain): the weights and Changes received and their loading into
  this link's part of the worker's flat buffers (its `Shard`: the whole model when there is
  one coordinator), only when the worker asks, between computes. A missed broadcast is
  noticed from the coordinator's heartbeats, which carry its version, and fetched with a
  Pull (the clone pattern).

The worker (`nodes.worker`) drives one link per coordinator shard with one training loop;
the relay (`nodes.relay`) holds one towards its root. Both load and await versions through
the link's chain (`link.versions.load`, `link.versions.await_version`, ...).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any

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
from tensorbus.bus.layout import Layout, Shard
from tensorbus.bus.messages import (
    BUILD,
    Changes,
    Fragment,
    Heartbeat,
    Join,
    Leave,
    Message,
    Reject,
    RejectCode,
    Stop,
    Weights,
    Welcome,
)
from tensorbus.bus.security import ClientKeys
from tensorbus.bus.shared import HostToken, Ref, SegmentCache
from tensorbus.bus.transport import (
    HANDSHAKE_MECHANISM,
    HANDSHAKE_REFUSED,
    ClientFactory,
    ClientTransport,
    Hub,
    ZmqClient,
)
from tensorbus.nodes.liveness import Liveness, Moved, Owner, Stopped
from tensorbus.nodes.model_buffers import ModelBuffers
from tensorbus.nodes.version_chain import VersionChain

log = logging.getLogger("tensorbus.worker")
_SETS_MAPPED = 16  # the coordinator's weight sets kept mapped (bus.shared.SharedWeightPool)
JOIN_SAY_S = 10.0  # a join unanswered this long is said in the log, once
NOT_YET_S = 0.2  # between joins a standby answered `not_yet` (it takes over within a beat)


class RunFailedError(Exception):
    """The coordinator ended the run with an error (a worker ends it so too)."""


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
        host_token: str = "",
        transport: ClientFactory = ZmqClient,
        clock: Clock = SYSTEM_CLOCK,
        model_buffers: ModelBuffers | None = None,
    ) -> None:
        """`host_token`: the worker's bus.shared.HostToken offer, named in its Join ("": it pushes
        bytes only). `transport` makes the sockets; `clock` is read for every deadline.
        `model_buffers`: where the buffers published with the weights are loaded (the
        link to the first shard's; None: the coordinator's buffers are not taken here)."""
        self.endpoint = endpoint
        self._host_token = host_token
        self._hub = hub
        self._transport = transport
        self._clock = clock
        self.layout = shard.layout
        self.model_buffers = model_buffers
        self._owner = owner
        self._keys = keys
        self._client: ClientTransport | None = None
        self._receiving: asyncio.Task[None] | None = None
        self._broken: RuntimeError | None = None  # why the receive loop died, if it did
        self._requests = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Message]] = {}
        self.joined = False  # welcomed once: a worker stopped before that has nobody to leave
        self._config_request_timeout_s = request_timeout_s
        self.request_timeout_s = request_timeout_s
        self._announced_port = 0  # the broadcast port the last Welcome named
        self._moved_from = ""  # the coordinator left for its standby (move_to's back_to)
        # The coordinator takes tensors by reference, and sees our /dev/shm (bus.shared):
        # it also broadcasts its versions by reference, read through this segment cache.
        self.shared = False
        self._segments: SegmentCache | None = None
        # A pipeline stage's worker names its stage and its inbox in its Join (set by
        # nodes.stage_worker before it joins); a worker of the whole model is stage 0 of 1.
        self.stage, self.stages, self.inbox = 0, 1, ""
        self._fragment_layouts: tuple[Layout, ...] = ()  # what Fragment broadcasts must be
        self.liveness = Liveness(owner, self.peer, clock, loaded=lambda: self.versions.version)
        self.versions = VersionChain(self.layout, weights, owner, self.peer,
                                                self.liveness, self, model_buffers)

    @property
    def peer(self) -> str:
        return f"coordinator at {self.endpoint}"

    # What the parts know, read on the link by the worker and the relay.

    @property
    def version(self) -> int:
        """The version of this shard's weights in the model now."""
        return self.versions.version

    @property
    def by_reference(self) -> int:
        """Versions loaded from the coordinator's shared memory."""
        return self.versions.by_reference

    @property
    def torn(self) -> int:
        """Of those, copies thrown away: the set was being written meanwhile."""
        return self.versions.torn

    @property
    def seen(self) -> float:
        """When the coordinator was last heard (-inf: never)."""
        return self.liveness.seen

    @property
    def heartbeat_s(self) -> float:
        return self.liveness.heartbeat_s

    @property
    def timeout_s(self) -> float:
        return self.liveness.timeout_s

    @property
    def stopped(self) -> bool:
        """Whether the coordinator said training is over."""
        return self.liveness.stopped

    @property
    def failure(self) -> str | None:
        """Why the coordinator's run failed, if it said so."""
        return self.liveness.failure

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

    async def move_to(self, endpoint: str, *, back_to: str = "") -> None:
        """Talk to the coordinator at `endpoint` from now on (a standby that took the run
        over: nodes.replication), with new sockets; join it next. `back_to`: where to go
        back to if it answers `not_yet` for as long as a coordinator's timeout (the one we
        left, still alive: it was us who could not reach it)."""
        await self.close()
        log.info("worker %d moves from the %s to the coordinator at %s", self._owner.rank,
                 self.peer, endpoint)
        self._moved_from, self.endpoint = back_to, endpoint
        self.liveness.peer = self.versions.peer = self.peer
        self._client, self._receiving, self._broken = None, None, None
        self.joined, self.shared, self._announced_port = False, False, 0
        self.open()

    # Joining -------------------------------------------------------------------------------

    async def join(self, rank: int, within_s: float, what: str, *, any_rank: bool) -> Welcome:
        """Ask to join as `rank` until admitted, refused, or `within_s` has passed, backing
        off; with `any_rank`, take any rank when that one went to another worker."""
        deadline = self._clock.monotonic() + within_s
        wait = 1.0
        say_at = self._clock.monotonic() + JOIN_SAY_S  # say once that nobody answers yet
        not_yet_since: float | None = None  # a standby answered not_yet since then
        unanswered_since: float | None = None  # no answer at all since then
        while True:
            join = Join(sender=self._owner.rank, rank=rank, layout=self.layout.digest, build=BUILD,
                        shared=self._host_token, stage=self.stage, stages=self.stages,
                        inbox=self.inbox, run=self.liveness.run)
            try:
                left = max(deadline - self._clock.monotonic(), 0.1)
                reply = await self.request(join, timeout=min(wait, left))
            except PeerTimeoutError:
                problem = self._client.connection_problem() if self._client else None
                if problem in (HANDSHAKE_REFUSED, HANDSHAKE_MECHANISM):
                    raise HandshakeError(self.peer, problem) from None  # waiting will not mend it
                if self._clock.monotonic() >= deadline:
                    raise PeerTimeoutError(self.peer, what, within_s, problem or "") from None
                now = self._clock.monotonic()
                unanswered_since = now if unanswered_since is None else unanswered_since
                standby = self.liveness.standby
                if standby and standby != self.endpoint:  # (it may have taken the run over)
                    await self.move_to(standby, back_to=self.endpoint)
                    unanswered_since = None
                elif (self._moved_from and self._moved_from != self.endpoint
                      and now - unanswered_since > self.liveness.timeout_s):
                    # The coordinator we moved to has not answered for as long as a
                    # coordinator's timeout, and names no standby: the one we left may be
                    # back (it has removed us by now). If it was taken over meanwhile, our
                    # join's newer term makes it step down and send us on (a Stop that moves us).
                    await self.move_to(self._moved_from, back_to=self.endpoint)
                    unanswered_since = None
                if self._clock.monotonic() >= say_at:
                    say_at = math.inf
                    who = f"worker {rank}" if rank >= 0 else "a worker (any rank)"
                    log.warning("%s: no answer to its %s from the %s yet (%s); trying "
                                "for %.0f s in all", who, what.split(" ")[0],
                                self.peer, problem or "is it running?", within_s)
                wait = min(wait * 2, 10.0)
                continue
            except Moved as e:  # (one that stepped down, at our newer term: where to go)
                await self.move_to(e.endpoint)
                continue
            except RejectedError as e:
                if e.code == RejectCode.RANK_TAKEN.value and any_rank and rank != -1:
                    rank = -1  # our old rank went to another worker; any will do
                    continue
                if (e.code == RejectCode.RANK_TAKEN.value and self._moved_from
                        and self._clock.monotonic() < deadline):
                    # Back at a coordinator we left, which counts us still: it removes us
                    # once we have been silent there for its timeout. Ask again until then.
                    await asyncio.sleep(NOT_YET_S)
                    continue
                if e.code == RejectCode.NOT_YET.value:  # a standby, about to take over?
                    now = self._clock.monotonic()
                    if now >= deadline:
                        raise PeerTimeoutError(self.peer, what, within_s, e.detail) from None
                    not_yet_since = now if not_yet_since is None else not_yet_since
                    if self._moved_from and now - not_yet_since > self.liveness.timeout_s:
                        # It hears its coordinator still: back to that one, which we lost.
                        await self.move_to(self._moved_from, back_to=self.endpoint)
                        not_yet_since = None
                    await asyncio.sleep(NOT_YET_S)
                    continue
                raise
            if not isinstance(reply, Welcome):
                raise RejectedError("unexpected", f"join answered by {reply.KIND.name}")
            self.versions.welcomed(reply)
            # Streaming averaging: the fragments its broadcasts are of (as the codec checks).
            self.versions.fragments = (self.layout.fragments(reply.fragments)
                                       if reply.fragments else ())
            self._fragment_layouts = tuple(f.layout for f in self.versions.fragments)
            self.joined = True
            self.liveness.welcomed(reply)
            # Past the coordinator's own liveness timeout, a missing answer means it is gone.
            self.request_timeout_s = min(self._config_request_timeout_s, reply.timeout_s)
            self._announced_port = reply.pub_port
            # In process, frames go by reference already (inproc, zero copy).
            self.shared = (bool(reply.shared and self._host_token)
                           and not self.endpoint.startswith("inproc://") and HostToken.seen(reply.shared))
            return reply

    def session(self) -> list[Coroutine[Any, Any, None]]:
        """What runs beside the training loop for the membership the last join began:
        receiving broadcasts, beating, watching that the coordinator is alive."""
        assert self._client is not None
        # (It connects once a port: SUB reconnects by itself.)
        self._client.subscribe(self._announced_port, shared=self.shared)
        if self.shared and self._segments is None:
            self._segments = SegmentCache(_SETS_MAPPED)
        return [self._broadcasts(), self.versions.resyncs(), self.liveness.heartbeats(self._client),
                self.liveness.watchdog()]

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
        seconds = timeout if timeout is not None else self.request_timeout_s
        what = f"{message.KIND.name.lower()} (request {request})"
        try:
            # The send has a deadline too: a DEALER whose peer is gone blocks in send.
            frames = encode(replace(message, request=request, term=self.liveness.term), refer=refer)
            tracker = await within(self._client.send(frames),
                                   seconds, peer=self.peer, waiting_for=f"sending {what}")
            if patient:
                reply = await self.liveness.while_alive(future, waiting_for=what)
            else:
                reply = await within(future, seconds, peer=self.peer, waiting_for=what)
        finally:
            self._pending.pop(request, None)
        match reply:
            case Stop():
                raise self.liveness.stopped_by(reply)
            case Reject(code=code, detail=detail):
                raise RejectedError(code, detail)
        return reply, tracker

    async def leave(self, reason: str, detail: str) -> None:
        """Say goodbye, briefly: the coordinator may already be gone."""
        if not self.joined or self.liveness.silent_s() > self.liveness.timeout_s:
            return  # never a member (stopped while joining), or it is gone: nobody to tell
        try:
            await self.request(Leave(sender=self._owner.rank, version=self.version, reason=reason,
                                     detail=detail[:1000]), timeout=2.0)
        except (PeerTimeoutError, RejectedError, Stopped):
            pass

    # Receiving -----------------------------------------------------------------------------

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
            if self.liveness.stale(message):
                self._stale(message)
                continue
            self.liveness.heard(message)
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

    def _stale(self, message: Message) -> None:
        log.warning("worker %d: ignored a %s of term %d from the %s: term %d took the run over",
                    self._owner.rank, message.KIND.name, message.term, self.peer, self.liveness.term)

    async def _broadcasts(self) -> None:
        assert self._client is not None
        versions = self.versions
        while True:
            frames = await self._client.recv_broadcast()
            try:
                message = decode(frames, layout=self.layout, segments=self._segments,
                                 fragments=self._fragment_layouts)
            except WireError as e:
                log.warning("worker %d: bad broadcast: %s", self._owner.rank, e)
                continue
            if self.liveness.stale(message):
                self._stale(message)
                continue
            self.liveness.heard(message)
            match message:
                case Weights():
                    first = message.tensors[0] if message.tensors else None
                    versions.keep_newest(message, shared=self._segments is not None
                                         and self._segments.holds(first))
                    del first
                case Changes() | Fragment():
                    versions.take_changes(message)
                case Heartbeat() if message.version > versions.version:
                    versions.wake_waiter()  # maybe a missed broadcast: let the waiter look
                case Stop():
                    ended = self.liveness.stopped_by(message)
                    versions.wake_waiter()
                    # At once, whatever the worker is doing (loading its data, say): not at
                    # its next request, which may be long in coming.
                    self._owner.end_session(ended)
            # Let go of the frames now, not when the next broadcast comes: sent in-process,
            # they are the coordinator's snapshot, which it may not reuse while we hold it.
            del frames, message
