"""A standby coordinator: the coordinator's replicas of each version, and the standby's side.

A standby (`tensorbus coordinator ... --standby-of tcp://PRIMARY:PORT`) binds its own
sockets, then follows the coordinator it names:

- Every heartbeat it sends that coordinator a `Follow` (its endpoint, its term, the run it
  follows), and the coordinator sends it a heartbeat of its own, from its tick: either proves
  the coordinator alive, even through a long step. Once the standby holds the version the
  workers have, the coordinator names its endpoint in its Welcomes and heartbeats, so that
  its workers know where to go if it is lost. One standby at a time.
- The coordinator replicates before it publishes: at every version, the run's state (what
  a checkpoint holds: weights, the model's buffers, the optimizer's and scheduler's state,
  the strategy's, each rank's data position, the samples) goes to the standby as a
  `Replica`, its tensors as they lie in memory (bus.tree), and the version is published
  only once the standby has acknowledged it. So every version a worker builds on is the
  standby's: taking over loses no applied update, and no worker replays anything. An
  update taken but not yet applied dies with the coordinator; its worker computes it
  again, from the replicated data position.
- A standby that does not acknowledge within the coordinator's timeout is dropped (said in
  the log), and refused if it follows again: the run goes on without one.
- Once the coordinator has been silent for `--timeout`, the standby takes over from its
  newest replica, in the next term: it serves on its own endpoint, and the workers, which
  lost the coordinator too, move there by themselves (nodes.worker_session). Until then it
  answers workers `not_yet`.
- A coordinator that ends its run (done or failed) tells its standby, which ends with it.
- Terms keep one coordinator: the standby that took over keeps sending Follows of its
  term, and of the run's id, to the old coordinator's endpoint. One that lived on apart (a
  network partition) hears it once the network heals, steps down (nodes.failures.
  SteppedDown, exit status 1), and its workers move to the new one. A coordinator of
  another run at that address (another id) refuses it.

`Standbys` is the coordinator's part, `Following` the standby's until it takes over, and
`StepDownNotice` the new coordinator's call to the old one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tensorbus.bus.buffers import wait_sent
from tensorbus.bus.clock import Clock
from tensorbus.bus.codec import decode, encode
from tensorbus.bus.deadline import at_most
from tensorbus.bus.errors import PeerTimeoutError, RejectedError, WireError
from tensorbus.bus.messages import (
    BUILD,
    Ack,
    Follow,
    Heartbeat,
    Message,
    Reject,
    RejectCode,
    Replica,
    Stop,
)
from tensorbus.bus.pieces import whole
from tensorbus.bus.shared import HostToken, Ref, SegmentCache, SharedWeightPool
from tensorbus.bus.transport import ClientFactory, ClientTransport, ServerTransport
from tensorbus.bus.tree import TreeError, flatten, unflatten
from tensorbus.nodes.failures import TrainingError
from tensorbus.nodes.metrics import Metrics

log = logging.getLogger("tensorbus.coordinator")
ACK_BYTES = 1 << 16  # what the coordinator takes back from its standby: acknowledgements


class FollowError(TrainingError):
    """A standby cannot follow its coordinator (refused, or lost before any replica)."""


@dataclass(frozen=True)
class TakeOver:
    """The standby's coordinator was silent too long: go on from `state` in `term`.
    `generation`: where its weights are the coordinator's own set, that set's generation
    when replicated (0: they came as bytes), which `torn` reads again after the copy."""

    state: dict[str, Any]
    term: int
    silent_s: float
    run: str
    generation: int = 0

    def torn(self) -> bool:
        """Whether the weights, read where they lie, were written since they were replicated."""
        return bool(self.generation) and SegmentCache.generation(
            self.state["weights"][0]) != self.generation


@dataclass(frozen=True)
class Ended:
    """The coordinator ended its run: the standby ends with it."""

    stop: Stop


class Standbys:
    """A coordinator's standby (one at most): where it is, and the replica of each version."""

    def __init__(self, *, term: int, layout: str, timeout_s: float, clock: Clock,
                 client: ClientFactory, metrics: Metrics,
                 shared_pool: SharedWeightPool | None = None) -> None:
        """`shared_pool`: where the coordinator's weight sets lie in shared memory: a standby
        of this host reads the weights there, by reference, instead of taking their bytes."""
        self.term = term  # takeovers before this coordinator's (0: the first coordinator)
        self.run_id = secrets.token_hex(8)  # (a standby that takes over keeps the run's)
        self.endpoint = ""  # the standby's ("": none)
        self.last = ""  # the newest standby's, kept when dropped: where a takeover would be
        self.peer: bytes | None = None  # its connection to our sockets: our beats go there
        self._dropped: dict[str, str] = {}  # endpoints of standbys dropped, and why
        self._layout = layout
        self._timeout_s = timeout_s
        self._clock = clock
        self._client_factory = client
        self._metrics = metrics
        self._shared_pool = shared_pool
        self.by_reference = False  # the standby reads the weights where they lie
        self._client: ClientTransport | None = None
        self._requests = itertools.count(1)
        self.fresh = False  # followed anew: it needs a replica of the current version
        self.replicated = 0  # replicas acknowledged
        self.replicate_s = 0.0  # spent sending them and waiting for their acknowledgements

    @property
    def advertised(self) -> str:
        """The standby's endpoint, for heartbeats and Welcomes, once it holds the version
        the workers have ("" before: a worker would find nothing whole there)."""
        return self.endpoint if not self.fresh else ""

    def refusal(self, follow: Follow) -> str | None:
        """Why `follow` cannot be taken (None: it can; one of a newer term then tells this
        coordinator to step down)."""
        if follow.layout != self._layout:
            return (f"the standby's model has layout {follow.layout}, this coordinator's "
                    f"{self._layout}: start the standby with the same SPEC")
        if not follow.endpoint or follow.endpoint.startswith("inproc://"):
            return f"the standby's endpoint {follow.endpoint!r} is not one workers can move to"
        if follow.run != self.run_id and (follow.run or follow.term > self.term):
            return (f"the standby follows run {follow.run or '(none)'}, this coordinator serves "
                    f"run {self.run_id}")
        if follow.term > self.term:
            return None
        if follow.endpoint in self._dropped:
            return (f"this coordinator dropped the standby at {follow.endpoint} "
                    f"({self._dropped[follow.endpoint]}): start another, at another address")
        if self.endpoint and follow.endpoint != self.endpoint:
            return f"this coordinator has a standby already, at {self.endpoint}"
        return None

    def follow(self, peer: bytes, follow: Follow) -> None:
        """A standby follows at `follow.endpoint`, from connection `peer` (again, each beat)."""
        self.peer = peer
        if follow.endpoint == self.endpoint:
            return
        self._client = self._client_factory(follow.endpoint, max_message_bytes=ACK_BYTES)
        self.endpoint, self.last, self.fresh = follow.endpoint, follow.endpoint, True
        self.by_reference = (self._shared_pool is not None and bool(follow.shared)
                             and HostToken.seen(follow.shared))
        log.info("a standby follows this coordinator from %s%s", follow.endpoint,
                 " (this host: the weights by reference)" if self.by_reference else "")
        self._metrics.write("standby", endpoint=follow.endpoint, by_reference=self.by_reference)

    async def replicate(self, version: int, state: Callable[[], dict[str, Any]]) -> None:
        """Send the standby the state of `version` and wait for its acknowledgement; one
        that does not acknowledge within the timeout is dropped, and the run goes on."""
        if self._client is None:
            return
        started = self._clock.monotonic()
        made = state()
        # A standby of this host reads the weights where they lie (the newest version's set,
        # which no step writes again: nodes.master), with the set's generation to check.
        pool = self._shared_pool if self.by_reference else None
        try:
            skeleton, tensors = flatten(made, most=Replica.MAX_TENSORS - 1, keep=(
                (lambda t: pool.locate(t) is not None) if pool is not None else None))
        except TreeError as e:  # (an optimizer that keeps what is not a tensor or a plain value)
            log.error("this run's state cannot be replicated (%s): going on without a standby", e)
            self.drop(f"this run's state cannot be replicated: {e}")
            return
        generation = pool.generation(made["weights"]) if pool is not None else None
        message = Replica(version=version, term=self.term, run=self.run_id,
                          generation=generation or 0, tensors=(
            torch.frombuffer(bytearray(skeleton), dtype=torch.uint8), *tensors))
        try:
            await self._request(message, f"the replica of version {version}",
                                refer=pool.locate if pool is not None and generation else None)
        except (PeerTimeoutError, WireError, RejectedError) as e:
            log.warning("the standby at %s did not take the replica of version %d (%s): going "
                        "on without a standby (start another with --standby-of)",
                        self.endpoint, version, e)
            self._metrics.write("standby_dropped", endpoint=self.endpoint, version=version,
                                why=str(e))
            self.drop(f"it did not take the replica of version {version}")
            return
        self.fresh = False
        self.replicated += 1
        self.replicate_s += self._clock.monotonic() - started

    async def ended(self, stop: Stop) -> None:
        """The run ended: tell the standby, briefly (it ends with the run, not taking over)."""
        if self._client is None:
            return
        try:
            await self._request(stop, "the end of the run", timeout_s=min(self._timeout_s, 2.0))
        except (PeerTimeoutError, WireError, RejectedError) as e:
            log.info("the standby at %s was not told that the run ended (%s)", self.endpoint, e)
        self.drop()

    async def _request(self, message: Message, what: str, *, timeout_s: float | None = None,
                       refer: Callable[[torch.Tensor], Ref | None] | None = None) -> None:
        """`message` to the standby, answered by an Ack, within the timeout; the frames
        (the state's own memory) let go of before it returns, so that the next step may
        write them."""
        client = self._client
        assert client is not None
        seconds = timeout_s if timeout_s is not None else self._timeout_s
        request = next(self._requests)
        deadline = self._clock.monotonic() + seconds
        peer = f"standby at {self.endpoint}"
        sent = encode(dataclasses.replace(message, request=request, term=self.term), refer=refer)
        try:
            tracker = await at_most(client.send(sent), seconds)
        except TimeoutError:  # (a DEALER whose peer is gone, its queue full, blocks in send)
            raise PeerTimeoutError(peer, f"sending {what}", seconds) from None
        while True:
            left = deadline - self._clock.monotonic()
            if left <= 0:
                raise PeerTimeoutError(peer, what, seconds)
            try:
                frames = await at_most(client.recv(), left)
            except TimeoutError:
                raise PeerTimeoutError(peer, what, seconds) from None
            answer = decode(frames, max_bytes=ACK_BYTES)
            if answer.request != request:
                continue  # the answer to a request given up on
            if isinstance(answer, Reject):
                raise RejectedError(answer.code, answer.detail)
            break
        await wait_sent(tracker, timeout=max(deadline - self._clock.monotonic(), 0.1), what=what)

    def drop(self, why: str = "") -> None:
        """Forget the standby (closing the socket drops what was queued for it: frames of a
        replica given up on are let go of so); `why`, if it failed: it is refused after."""
        if why and self.endpoint:
            self._dropped[self.endpoint] = why
        if self._client is not None:
            self._client.close()
        self._client, self.endpoint, self.fresh, self.peer = None, "", False, None

    def summary(self) -> dict[str, Any]:
        return {"term": self.term, "standby": self.endpoint or None,
                "replicated": self.replicated, "replicate_s": round(self.replicate_s, 6),
                "by_reference": self.by_reference}


class Following:
    """A standby before it takes over: Follows to its coordinator every heartbeat, the
    replicas taken on its own server, workers answered `not_yet`."""

    def __init__(self, primary: str, *, endpoint: str, layout: str, server: ServerTransport,
                 client: ClientFactory, clock: Clock, heartbeat_s: float, timeout_s: float,
                 first_answer_s: float, max_bytes: int,
                 check: Callable[[dict[str, Any]], str | None]) -> None:
        """`first_answer_s`: how long the coordinator may take to answer a first time (it
        may start after us); then it is lost once silent for `timeout_s`. `check`: why
        the first replica's state is not one we could take over from (None: it is)."""
        self._primary = primary
        self._endpoint = endpoint
        self._layout = layout
        self._server = server
        self._client_factory = client
        self._clock = clock
        self._heartbeat_s = heartbeat_s
        self._timeout_s = timeout_s
        self._max_bytes = max_bytes
        self._first_answer_s = first_answer_s
        self._check = check
        self._run = ""  # the run followed, as the replicas name it
        self._newest: Replica | None = None
        self._heard: float | None = None  # when the coordinator was last heard (None: never)
        self._began = clock.monotonic()
        self._outcome: asyncio.Future[TakeOver | Ended] | None = None
        self._pending_stop = ""  # a stop asked for before run() began
        self._segments = SegmentCache(4)  # the coordinator's weight sets, read by reference
        self.replicas = 0

    async def run(self) -> TakeOver | Ended:
        """Follow until the coordinator is silent for the timeout (TakeOver) or ends its
        run (Ended); FollowError if it refuses us, or is lost before any replica."""
        self._outcome = asyncio.get_running_loop().create_future()
        if self._pending_stop:
            self.stop(self._pending_stop)
        try:
            token: HostToken | None = HostToken()  # (a coordinator of this host sends references)
        except OSError:
            token = None
        client = self._client_factory(self._primary, max_message_bytes=ACK_BYTES)
        offer = token.offer if token is not None else ""
        tasks = [asyncio.create_task(c) for c in (self._probe(client, offer), self._answers(client),
                                                  self._serve(), self._watch())]
        for task in tasks:  # (one that fails ends the following, with its error)
            task.add_done_callback(self._ended)
        try:
            return await self._outcome
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            client.close()
            if token is not None:
                token.close()

    def _ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.debug("standby: %s failed", task.get_coro(), exc_info=task.exception())
            self._end(task.exception())  # type: ignore[arg-type]

    def stop(self, why: str) -> None:
        """Stop following (a signal): as if the coordinator had ended its run."""
        self._end(Ended(Stop(reason="done", detail=why)))

    def _end(self, outcome: TakeOver | Ended | Exception) -> None:
        if self._outcome is None:
            if isinstance(outcome, Ended):
                self._pending_stop = outcome.stop.detail
            return
        if self._outcome.done():
            return
        if isinstance(outcome, Exception):
            self._outcome.set_exception(outcome)
        else:
            self._outcome.set_result(outcome)

    async def _probe(self, client: ClientTransport, offer: str) -> None:
        for request in itertools.count(1):
            follow = Follow(request=request, endpoint=self._endpoint, term=0, layout=self._layout,
                            build=BUILD, shared=offer, run=self._run)
            # A DEALER whose peer is gone blocks in send: given up after a beat (the watch
            # decides).
            with contextlib.suppress(TimeoutError):
                await at_most(client.send(encode(follow)), self._heartbeat_s)
            await asyncio.sleep(self._heartbeat_s)

    async def _answers(self, client: ClientTransport) -> None:
        while True:
            frames = await client.recv()
            try:
                answer = decode(frames, max_bytes=ACK_BYTES)
            except WireError as e:
                log.warning("standby: a bad answer from the coordinator at %s: %s", self._primary, e)
                continue
            match answer:
                case Ack() | Heartbeat():  # (its beats come through its steps)
                    self._heard = self._clock.monotonic()
                case Stop():
                    self._end(Ended(answer))
                case Reject(code=code, detail=detail):
                    self._end(FollowError(f"the coordinator at {self._primary} refused this "
                                          f"standby: {code}: {detail}"))

    async def _serve(self) -> None:
        """Replicas and the run's end from the coordinator; workers told to ask again."""
        server = self._server
        while True:
            peer, frames = await server.recv()
            try:
                message = decode(frames, max_bytes=self._max_bytes, segments=self._segments)
            except WireError as e:
                await server.send(peer, encode(Reject(request=e.request, code=e.code.value,
                                                      detail=str(e)[:1000]), term=self._term))
                continue
            match message:
                case Replica():
                    if self._newest is None:  # the first: one we could take over from?
                        self._take_first(message)
                    if self._newest is None or message.version >= self._newest.version:
                        self._newest = message
                        self._run = message.run
                    self.replicas += 1
                    self._heard = self._clock.monotonic()
                    await server.send(peer, encode(Ack(request=message.request,
                                                       version=message.version), term=self._term))
                case Stop():
                    await server.send(peer, encode(Ack(request=message.request,
                                                       version=message.version), term=self._term))
                    self._end(Ended(message))
                case Heartbeat():
                    pass  # a worker's beat, sent before it heard that its coordinator is back
                case _ if message.request:
                    await server.send(peer, encode(Reject(
                        request=message.request, code=RejectCode.NOT_YET.value,
                        detail=f"a standby of the coordinator at {self._primary}, not serving "
                               "yet: it takes over if that coordinator is lost"), term=self._term))
            del frames, message

    @property
    def _term(self) -> int:
        """The term of the coordinator followed, on what we answer (workers drop the
        answers of an older one)."""
        return self._newest.term if self._newest is not None else 0

    def _take_first(self, replica: Replica) -> None:
        """Check the first replica now, not at a takeover, with the workers moved already."""
        try:
            refused = self._check(replica_state(replica))
        except TreeError as e:
            refused = f"it cannot be read: {e}"
        if refused is not None:
            self._end(FollowError(f"the coordinator at {self._primary} runs what this standby "
                                  f"could not take over: {refused}"))

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_s)
            now = self._clock.monotonic()
            if self._heard is None:
                if now - self._began > self._first_answer_s:
                    self._end(FollowError(
                        f"the coordinator at {self._primary} did not answer within "
                        f"{self._first_answer_s:.0f} s: is it running, and started with the same "
                        "SPEC? (--join-timeout waits longer)"))
                    return
                continue
            silent = now - self._heard
            if silent <= self._timeout_s:
                continue
            if self._newest is None:
                self._end(FollowError(
                    f"lost the coordinator at {self._primary} (silent for {silent:.1f} s) "
                    "before it sent any replica: nothing to take over"))
                return
            try:
                state = replica_state(self._newest)
            except TreeError as e:
                self._end(FollowError(f"the newest replica (version {self._newest.version}) "
                                      f"cannot be read: {e}"))
                return
            self._end(TakeOver(state, self._newest.term + 1, silent, self._newest.run,
                               self._newest.generation))
            return


def replica_state(replica: Replica) -> dict[str, Any]:
    """The state a Replica carries (bus.tree), its tensors joined where they came in frames."""
    if not replica.tensors:
        raise TreeError("a replica without its tree")
    skeleton, *tensors = (whole(t) for t in replica.tensors)
    if skeleton.dtype != torch.uint8 or skeleton.dim() != 1:
        raise TreeError(f"a replica's tree must be uint8 bytes, not {skeleton.dtype}{list(skeleton.shape)}")
    state = unflatten(skeleton.numpy().tobytes(), tensors)
    if not isinstance(state, dict) or "version" not in state:
        raise TreeError("a replica's tree is not a coordinator's state")
    return state


class StepDownNotice:
    """A standby that took over, calling on the coordinator it followed: Follows of its
    term to that endpoint, every heartbeat, until one is answered (that coordinator, back
    from a partition, then steps down)."""

    def __init__(self, former: str, *, endpoint: str, term: int, run: str, layout: str,
                 client: ClientFactory, heartbeat_s: float) -> None:
        self._former = former
        self._run = run
        self._endpoint = endpoint
        self._term = term
        self._layout = layout
        self._client_factory = client
        self._heartbeat_s = heartbeat_s

    async def run(self) -> None:
        client = self._client_factory(self._former, max_message_bytes=ACK_BYTES)
        try:
            for request in itertools.count(1):
                follow = Follow(request=request, endpoint=self._endpoint, term=self._term,
                                layout=self._layout, build=BUILD, run=self._run)
                try:
                    await at_most(client.send(encode(follow)), self._heartbeat_s)
                    answer = decode(await at_most(client.recv(), self._heartbeat_s),
                                    max_bytes=ACK_BYTES)
                except (TimeoutError, WireError):
                    continue
                if isinstance(answer, Ack | Stop):
                    log.warning("the coordinator at %s, which this one took over from, was "
                                "still running: it steps down", self._former)
                    return
        finally:
            client.close()
