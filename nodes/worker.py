"""A worker: joins, trains on its shard with compute off the event loop, pushes, follows versions.

The strategy's rhythm, handed over in the Welcome, shapes the loop with no branch on the
strategy's name: compute `local_steps` steps (taking local optimizer steps when the worker
pushes weights), push the gradient or the weights, wait for the answer (which the
coordinator may hold back: the start gate, ssp's bound), then wait for a newer version or
go on with the newest seen.

Three tasks share one loop: the training loop, `_replies` (answers on the DEALER, matched
to requests by id) and `_broadcasts` (versions, heartbeats and stop on the SUB), plus a
heartbeat sender. Compute (data, forward, backward) runs in a thread, so heartbeats go on
while it runs. Weights are only loaded between computes, on the loop, from the newest
version seen: a missed broadcast is noticed from the coordinator's heartbeats, which carry
its version, and fetched with a Pull (the clone pattern).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sized
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from bus.buffers import Tracker, wait_sent
from bus.codec import decode, encode
from bus.deadline import within
from bus.errors import (
    HandshakeError,
    PeerTimeoutError,
    ProtocolVersionError,
    RejectedError,
    WireError,
    quote,
)
from bus.messages import (
    BUILD,
    Ack,
    Heartbeat,
    Join,
    Leave,
    Message,
    Phase,
    Pull,
    Push,
    Ready,
    Reject,
    RejectCode,
    Stop,
    Weights,
    Welcome,
)
from bus.transport import HANDSHAKE_MECHANISM, HANDSHAKE_REFUSED, ZmqClient
from bus.layout import COMPRESSION
from nodes.config import WorkerConfig
from nodes.flat import FlatModel
from strategies.base import PushKind, Wait

log = logging.getLogger("tensorbus.worker")

Data = Callable[[int, int, int], Iterable[Any]]
Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class DataError(Exception):
    """The SPEC's data() failed or yielded something unusable; the message says what."""


class ComputeError(Exception):
    """The SPEC's model or loss raised on a batch; the message says which and what."""


@dataclass(frozen=True)
class WorkerReport:
    rank: int
    pushes: int
    last_loss: float | None
    final_version: int
    rejoins: int = 0  # times it joined again after losing the coordinator or being removed


class _Stopped(Exception):
    """The coordinator said training is over."""


class Worker:
    def __init__(
        self,
        *,
        model: nn.Module,
        data: Data,
        loss: Loss,
        config: WorkerConfig,
        optimizer: OptimizerFactory | None = None,
    ) -> None:
        if config.device != "cpu":
            raise ValueError(f"device {config.device!r}: only cpu workers exist in this release")
        self.config = config
        self.flat = FlatModel(model)
        self._model = model
        self._data = data
        self._loss = loss
        self._make_optimizer = optimizer  # used only when the strategy has workers own one
        self._optimizer: torch.optim.Optimizer | None = None
        self.steps = 0  # local steps computed
        self._client: ZmqClient | None = None
        self._requests = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Message]] = {}
        self.rank = config.rank
        self.phase = Phase.JOINING
        self.version = 0  # the version of the weights in the model now
        self.clock = 0  # pushes made
        self._latest: Weights | None = None  # newest weights received, not yet loaded
        self._newer = asyncio.Event()
        self._stopped = False
        self._coordinator_version = 0
        self._coordinator_seen = -math.inf  # never heard: nobody to say goodbye to
        self._heartbeat_s = 0.5
        self._timeout_s = 10.0
        self._last_loss: float | None = None
        self._request_timeout_s = config.request_timeout_s
        self._ended: asyncio.Future[Exception] | None = None  # set: this session is over
        self._batches: _Epochs | None = None  # the shard's batches, kept across rejoins
        self._shard: tuple[int, int, int] | None = None  # (rank, world size, batch size) of it
        self.rejoins = 0
        self._pub_port: int | None = None
        self._narrow: tuple[torch.Tensor, ...] = ()  # gradients as pushed under --compress

    async def run(self) -> WorkerReport:
        self._client = ZmqClient(self.config.connect, max_message_bytes=self.flat.layout.nbytes + 65536,
                                 keys=self.config.keys)
        tasks = [asyncio.create_task(self._replies())]
        try:
            await self._sessions()
        except _Stopped:
            await self._leave("stopped", "")
        except asyncio.CancelledError:
            await self._leave("interrupted", "")
            raise
        except Exception as e:
            await self._leave("error", str(e))
            raise
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._client.close()
        return WorkerReport(self.rank, self.clock, self._last_loss, self.version, self.rejoins)

    async def _sessions(self) -> None:
        """Join and train; when the coordinator is lost or has removed us, join again.

        The first join may wait `join_timeout_s` (the coordinator may start later); a
        rejoin waits `reconnect_timeout_s` from when the coordinator was last heard (it
        may be restarting from a checkpoint), then gives up with what it waited for.
        """
        welcome = await self._join(self.config.join_timeout_s, "join")
        while True:
            try:
                await self._session(welcome)
                return
            except PeerTimeoutError as e:
                why = f"lost the coordinator ({e})"
            except RejectedError as e:
                if e.code != RejectCode.UNKNOWN_WORKER.value:
                    raise
                why = f"removed by the coordinator ({e.detail})"
            log.warning("worker %d %s at version %d, %s; joining again", self.rank, why,
                        self.version, self.phase.value)
            self.rejoins += 1
            waited = time.monotonic() - self._coordinator_seen
            welcome = await self._join(max(self.config.reconnect_timeout_s - waited, 1.0),
                                       f"rejoin after: {why}")

    async def _session(self, welcome: Welcome) -> None:
        """One membership: train until stopped, lost (PeerTimeoutError) or removed
        (RejectedError unknown_worker), whichever the training loop or the watch sees first."""
        assert self._client is not None
        if welcome.pub_port != self._pub_port:  # connect once: SUB reconnects by itself
            self._client.subscribe(welcome.pub_port)
            self._pub_port = welcome.pub_port
        self._ended = asyncio.get_running_loop().create_future()
        train = asyncio.create_task(self._train(welcome))
        helpers = [asyncio.create_task(c) for c in
                   (self._broadcasts(), self._heartbeats(), self._watchdog())]
        try:
            await asyncio.wait({train, self._ended}, return_when=asyncio.FIRST_COMPLETED)
            if not train.done():
                raise self._ended.result()
            train.result()
        finally:
            for task in (train, *helpers):
                task.cancel()
            await asyncio.gather(train, *helpers, return_exceptions=True)

    def _end_session(self, why: Exception) -> None:
        if self._ended is not None and not self._ended.done():
            self._ended.set_result(why)

    def _enter(self, phase: Phase) -> None:
        log.debug("worker %d: %s -> %s", self.rank, self.phase.value, phase.value)
        self.phase = phase

    # Joining -------------------------------------------------------------------------------

    async def _join(self, within_s: float, what: str) -> Welcome:
        """Ask to join until admitted, refused, or `within_s` has passed, backing off."""
        deadline = time.monotonic() + within_s
        wait = 1.0
        rank = self.rank  # on a rejoin: our old rank, so that our data shard stays ours
        while True:
            join = Join(sender=self.rank, rank=rank, layout=self.flat.layout.digest, build=BUILD)
            try:
                reply = await self._request(join, timeout=min(wait, max(deadline - time.monotonic(), 0.1)))
            except PeerTimeoutError:
                peer = f"coordinator at {self.config.connect}"
                problem = self._client.connection_problem() if self._client else None
                if problem in (HANDSHAKE_REFUSED, HANDSHAKE_MECHANISM):
                    raise HandshakeError(peer, problem) from None  # waiting will not mend it
                if time.monotonic() >= deadline:
                    raise PeerTimeoutError(peer, what, within_s, problem or "") from None
                wait = min(wait * 2, 10.0)
                continue
            except RejectedError as e:
                if e.code == RejectCode.RANK_TAKEN.value and rank != self.config.rank:
                    rank = -1  # our old rank went to another worker; any will do
                    continue
                raise
            if not isinstance(reply, Welcome):
                raise RejectedError("unexpected", f"join answered by {reply.KIND.name}")
            self.rank = reply.rank
            self.version = reply.version
            self.flat.load(reply.tensors)
            self._latest = None
            self._coordinator_version = reply.version  # a restarted coordinator may be behind
            self._heartbeat_s, self._timeout_s = reply.heartbeat_s, reply.timeout_s
            # Past the coordinator's own liveness timeout, a missing answer means it is gone.
            self._request_timeout_s = min(self.config.request_timeout_s, reply.timeout_s)
            self._coordinator_seen = time.monotonic()
            log.info("worker %d joined at version %d (%s)", self.rank, self.version, reply.strategy)
            return reply

    # Training ------------------------------------------------------------------------------

    async def _train(self, welcome: Welcome) -> None:
        wait = Wait(welcome.wait)
        shard = (self.rank, welcome.world_size, welcome.batch_size)
        if (self._batches is None or self._shard != shard
                or self._batches.position != welcome.position):
            # Go on where the coordinator's records say this rank's data had got to: a
            # fresh process, a rejoin on another shard, or a coordinator restarted from a
            # checkpoint (whose records are behind us: the data rewinds with the weights).
            self._enter(Phase.LOADING)
            shards = await asyncio.to_thread(self._load, welcome)
            self._batches = _Epochs(shards, self._describe_data(welcome))
            await asyncio.to_thread(self._batches.skip, welcome.position)
            self._shard = shard
        if PushKind(welcome.push) is PushKind.WEIGHTS and self._optimizer is None:
            make = self._make_optimizer or (lambda ps: torch.optim.SGD(ps, lr=welcome.lr))
            # In a thread: a first optimizer may import for seconds (torch._dynamo), and the
            # loop must keep beating meanwhile.
            self._optimizer = await asyncio.to_thread(make, self._model.parameters())
        # Answered when the coordinator's start gate opens: everyone starts together.
        await self._request(Ready(sender=self.rank, version=self.version,
                                  batches=self._batches.length), patient=True)
        batch_iter = self._batches
        pushed = self.flat.weights if self._optimizer is not None else self.flat.grads
        narrow = COMPRESSION.get(welcome.compress)
        self._narrow = ()
        if narrow is not None and self._optimizer is None:
            # --compress: gradients go out in a narrower dtype, converted by `_compute` into
            # buffers made once (the coordinator adds them into its fp32 ones).
            self._narrow = self.flat.layout.on_wire(narrow).allocate()
            pushed = self._narrow
        sent: Tracker | None = None
        # Where time goes between computes, reported with the next push (telemetry).
        comm_s = wait_s = 0.0
        while True:
            started = time.monotonic()
            # The pushed buffer is written by the next compute or load: the send must be done.
            await wait_sent(sent, timeout=self._timeout_s, what="the last update")
            self._load_latest()
            comm_s += time.monotonic() - started
            self._enter(Phase.COMPUTING)
            began, started = time.time(), time.monotonic()
            loss, samples = await asyncio.to_thread(self._compute, batch_iter, welcome.local_steps)
            compute_s = time.monotonic() - started
            self._last_loss = loss
            self._enter(Phase.PUSHING)
            computed_on = self.version
            push = Push(sender=self.rank, version=computed_on, clock=self.clock, loss=loss,
                        samples=samples, tensors=pushed, began=began, compute_s=compute_s,
                        comm_s=comm_s, wait_s=wait_s)
            self.clock += 1  # counted when sent, so that heartbeats from now on include it
            # The answer may be held back by the strategy (ssp's bound): wait while the
            # coordinator is alive, not against a fixed deadline.
            started = time.monotonic()
            ack, sent = await self._request_tracked(push, patient=True)
            answered = time.monotonic()
            held_s = min(max(ack.held_s, 0.0), answered - started) if isinstance(ack, Ack) else 0.0
            comm_s, wait_s = answered - started - held_s, held_s
            if isinstance(ack, Ack) and ack.dropped:
                log.info("worker %d: update on version %d dropped (%s)", self.rank, computed_on, ack.dropped)
                if ack.version > computed_on:
                    # Late: catch up first (pulling, if the broadcast was missed), or this
                    # worker would compute on the old version again, and again.
                    self._enter(Phase.WAITING)
                    await self._await_version(newer_than=ack.version - 1)
                wait_s += time.monotonic() - answered
                continue  # it does not count for its version: compute again
            # What to wait for is the strategy's (see strategies.base.Wait).
            if wait is Wait.NEWER:
                self._enter(Phase.WAITING)
                await self._await_version(newer_than=computed_on)
            elif wait is Wait.ANSWERED and ack.version > self.version:
                self._enter(Phase.WAITING)
                await self._await_version(newer_than=ack.version - 1)
            wait_s += time.monotonic() - answered

    def _load(self, welcome: Welcome) -> Iterable[Any]:
        try:
            return self._data(self.rank, welcome.world_size, welcome.batch_size)
        except Exception as e:
            raise DataError(f"{self._describe_data(welcome)} raised {type(e).__name__}: {e}") from e

    def _describe_data(self, welcome: Welcome) -> str:
        return f"data(rank={self.rank}, world_size={welcome.world_size}, batch_size={welcome.batch_size})"

    def _compute(self, batches: _Epochs, local_steps: int) -> tuple[float, int]:
        """`local_steps` gradients (each followed by a local optimizer step when this worker
        owns one); the last gradient stays in the flat buffer. Runs in a thread: touches
        only the model. Returns the mean loss and the samples seen."""
        total_loss, samples = 0.0, 0
        for _ in range(local_steps):
            self.config.faults.before_step(self.steps)
            inputs, targets = batches.next()
            self.flat.zero_grad()
            try:
                loss = self._loss(self._model(inputs), targets)
                loss.backward()
            except Exception as e:
                raise ComputeError(
                    f"worker {self.rank}: forward, loss or backward raised {type(e).__name__}: {e}"
                ) from e
            self.flat.gather_grads()
            if self._optimizer is not None:
                self._optimizer.step()
            self.steps += 1
            total_loss += float(loss.detach())
            samples += len(inputs)
        if self._narrow:  # the last push of them is sent: `_train` waited for it
            with torch.no_grad():
                for dst, src in zip(self._narrow, self.flat.grads, strict=True):
                    dst.copy_(src)
        return total_loss / local_steps, samples

    def _load_latest(self) -> None:
        if self._latest is not None and self._latest.version > self.version:
            self.flat.load(self._latest.tensors)
            self.version = self._latest.version
        self._latest = None  # drop the frames as soon as they are copied

    async def _await_version(self, *, newer_than: int) -> None:
        """Wait for a version past `newer_than`, pulling it if the broadcast was missed."""
        while max(self.version, self._latest.version if self._latest else -1) <= newer_than:
            if self._stopped:
                raise _Stopped
            self._newer.clear()
            try:
                await asyncio.wait_for(self._newer.wait(), self._heartbeat_s * 2)
                quiet = False
            except TimeoutError:
                quiet = True
            silent = time.monotonic() - self._coordinator_seen
            if silent > self._timeout_s:
                raise PeerTimeoutError(
                    f"coordinator at {self.config.connect}", f"version {newer_than + 1}", silent
                )
            have = max(self.version, self._latest.version if self._latest else -1)
            # Two quiet heartbeat periods, or a heartbeat announcing a version we lack: ask.
            # A Pull for what we have is answered without tensors, so asking is cheap.
            if quiet or self._coordinator_version > have:
                reply = await self._request(Pull(sender=self.rank, version=have))
                if isinstance(reply, Weights) and reply.tensors:
                    self._keep_newest(reply)

    def _keep_newest(self, weights: Weights) -> None:
        if weights.version > max(self.version, self._latest.version if self._latest else -1):
            self._latest = weights
            self._newer.set()

    # Talking to the coordinator ------------------------------------------------------------

    async def _request(
        self, message: Message, *, timeout: float | None = None, patient: bool = False
    ) -> Message:
        reply, _ = await self._request_tracked(message, timeout=timeout, patient=patient)
        return reply

    async def _request_tracked(
        self, message: Message, *, timeout: float | None = None, patient: bool = False
    ) -> tuple[Message, Tracker | None]:
        """Send a request and wait for its answer: within `timeout` (default: the request
        timeout), or, if `patient`, for as long as the coordinator keeps beating."""
        assert self._client is not None
        request = next(self._requests)
        future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._pending[request] = future
        seconds = timeout if timeout is not None else self._request_timeout_s
        peer = f"coordinator at {self.config.connect}"
        what = f"{message.KIND.name.lower()} (request {request})"
        try:
            # The send has a deadline too: a DEALER whose peer is gone blocks in send.
            tracker = await within(self._client.send(encode(replace(message, request=request))),
                                   seconds, peer=peer, waiting_for=f"sending {what}")
            if patient:
                reply = await self._while_alive(future, waiting_for=what)
            else:
                reply = await within(future, seconds, peer=peer, waiting_for=what)
        finally:
            self._pending.pop(request, None)
        match reply:
            case Stop():
                self._stopped = True
                raise _Stopped
            case Reject(code=code, detail=detail):
                raise RejectedError(code, detail)
        return reply, tracker

    async def _while_alive(self, future: asyncio.Future[Message], *, waiting_for: str) -> Message:
        while True:
            done, _ = await asyncio.wait({future}, timeout=self._heartbeat_s)
            if done:
                return future.result()
            silent = time.monotonic() - self._coordinator_seen
            if silent > self._timeout_s:
                raise PeerTimeoutError(f"coordinator at {self.config.connect}", waiting_for, silent)

    async def _replies(self) -> None:
        assert self._client is not None
        while True:
            frames = await self._client.recv()
            try:
                message = decode(frames, layout=self.flat.layout)
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
                log.warning("worker %d: bad reply from the coordinator: %s", self.rank, e)
                continue
            self._coordinator_seen = time.monotonic()
            self._coordinator_version = max(self._coordinator_version, message.version)
            future = self._pending.get(message.request)
            if future is not None and not future.done():
                future.set_result(message)
            elif isinstance(message, Reject):
                if message.code == RejectCode.UNKNOWN_WORKER.value:
                    # It no longer counts us (removed while silent, or restarted): join
                    # again. Answers to what was queued before a join (beats sent while
                    # the coordinator was away) come before its Welcome: no session to end.
                    self._end_session(RejectedError(message.code, message.detail))
                else:
                    log.warning("worker %d: the coordinator refused a message: %s: %s",
                                self.rank, message.code, message.detail)

    async def _broadcasts(self) -> None:
        assert self._client is not None
        while True:
            frames = await self._client.recv_broadcast()
            try:
                message = decode(frames, layout=self.flat.layout)
            except WireError as e:
                log.warning("worker %d: bad broadcast: %s", self.rank, e)
                continue
            self._coordinator_seen = time.monotonic()
            self._coordinator_version = max(self._coordinator_version, message.version)
            match message:
                case Weights():
                    self._keep_newest(message)
                case Heartbeat() if message.version > self.version:
                    self._newer.set()  # maybe a missed broadcast: let the waiter look
                case Stop():
                    self._stopped = True
                    self._newer.set()

    async def _heartbeats(self) -> None:
        assert self._client is not None
        while True:
            beat = Heartbeat(sender=self.rank, version=self.version, phase=self.phase.value, clock=self.clock)
            await self._client.send(encode(beat))
            await asyncio.sleep(self._heartbeat_s)

    async def _watchdog(self) -> None:
        """End the session, whatever it awaits, once the coordinator is silent too long.

        Every wait has its own deadline; this is the one that holds if some wait (a send
        into a socket whose peer is gone, say) has not.
        """
        while True:
            await asyncio.sleep(self._heartbeat_s)
            silent = time.monotonic() - self._coordinator_seen
            if silent > self._timeout_s + self._heartbeat_s:
                self._end_session(PeerTimeoutError(
                    f"coordinator at {self.config.connect}",
                    f"anything (worker {self.rank} was {self.phase.value} at version {self.version})",
                    silent,
                ))
                return

    async def _leave(self, reason: str, detail: str) -> None:
        """Say goodbye, briefly: the coordinator may already be gone."""
        self._enter(Phase.LEAVING)
        if time.monotonic() - self._coordinator_seen > self._timeout_s:
            return  # it is gone: nobody to tell
        try:
            await self._request(Leave(sender=self.rank, version=self.version, reason=reason,
                                      detail=detail[:1000]), timeout=2.0)
        except (PeerTimeoutError, RejectedError, _Stopped):
            pass


class _Epochs:
    """Batches from a re-iterable shard, epoch after epoch, checked for shape."""

    def __init__(self, shards: Iterable[Any], described: str) -> None:
        self._shards = shards
        self._described = described
        self._it: Iterator[Any] = iter(shards)
        self.length = len(shards) if isinstance(shards, Sized) else -1  # -1: unknown
        self.position = 0  # batches taken since the first

    def skip(self, batches: int) -> None:
        """Move `batches` on from the start: where a restarted run left this shard. Whole
        epochs of a sized shard are skipped by starting the next one (each iter() of a
        SPEC's data may be a new epoch order) without reading their batches."""
        if self.length > 0:
            for _ in range(batches // self.length):
                self._it = iter(self._shards)
            self.position = batches - batches % self.length
        while self.position < batches:
            self.next()

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            try:
                batch = next(self._it)
            except StopIteration:
                self._it = iter(self._shards)
                batch = next(self._it)
        except StopIteration:
            raise DataError(f"{self._described} yielded no batches: every rank needs at least "
                            "one; use fewer workers, a smaller --batch-size, or more data") from None
        except Exception as e:
            raise DataError(f"iterating {self._described} raised {type(e).__name__}: {e}") from e
        self.position += 1
        if not (isinstance(batch, tuple | list) and len(batch) == 2
                and all(isinstance(t, torch.Tensor) for t in batch)):
            raise DataError(f"{self._described} must yield (input, target) tensor pairs, "
                            f"got {type(batch).__name__}")
        return batch[0], batch[1]
