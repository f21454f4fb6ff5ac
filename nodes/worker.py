"""A worker: joins, trains on its shard with compute off the event loop, pushes, follows versions.

The strategy's rhythm, handed over in the Welcome, shapes the loop with no branch on the
strategy's name: compute `local_steps` steps (taking local optimizer steps when the worker
pushes weights), push the gradient or the weights, wait for the answer (which the
coordinator may hold back: the start gate, ssp's bound), then wait for a newer version or
go on with the newest seen.

The worker talks to its coordinator through a `Link` (nodes.link): requests, answers,
broadcasts, heartbeats and versions. With a sharded parameter server it holds one link per
shard, each owning a range of the flat parameters; a push sends each shard its range, all
at once, and the worker goes on when every shard has answered (and, where the strategy
waits, published a newer version). Compute (data, forward, backward) runs in a thread, so
heartbeats go on while it runs. Weights are only loaded between computes, on the loop,
from the newest version each link has seen; with one coordinator on this host, whose
versions come by reference, the model computes on the newest where the coordinator made it,
in its shared memory, without copying it in, and computes again, on a copy, if that set
was written meanwhile (`_follow_set`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import math
import random
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sized
from dataclasses import dataclass, replace
from typing import Any, TypeVar, cast

import numpy
import torch
from torch import nn

from tensorbus.bus.buffers import Tracker, wait_sent
from tensorbus.bus.clock import SYSTEM_CLOCK, Clock, working
from tensorbus.bus.errors import PeerTimeoutError, RejectedError
from tensorbus.bus.layout import Compression
from tensorbus.bus.messages import Ack, Message, Phase, Push, Ready, RejectCode, Weights, Welcome
from tensorbus.bus.shared import Arena, Probe, Ref, Shelf, sweep
from tensorbus.bus.transport import ClientFactory, Hub, ZmqClient
from tensorbus.nodes.compute import ComputeThread
from tensorbus.nodes.config import WorkerConfig
from tensorbus.nodes.flat import FlatModel
from tensorbus.nodes.handover import Handover
from tensorbus.nodes.link import Link, Newer, RunFailedError, Stopped
from tensorbus.nodes.optimizers import OptimizerFactory, make_optimizer
from tensorbus.nodes.outbox import Keeping, Outbox
from tensorbus.nodes.precision import LossScale, Precision
from tensorbus.nodes.schedules import Schedule, SchedulerFactory, make_schedule
from tensorbus.strategies.base import PushKind, Wait

log = logging.getLogger("tensorbus.worker")
_T = TypeVar("_T")
# fp16 steps in a row skipped for an overflow, after which the gradient goes as it is.
_MAX_OVERFLOWS = 32
FINISHING_SAY_S = 5.0  # a failed worker waiting longer for its compute thread says so
# After a compute on a coordinator's weight set that was written again meanwhile (done
# again), the next computes copy their weights in before one computes in place again: 2
# after a first, twice as many after each redo of the first in place after them (up to
# 64), so that a worker often slower than the sets are reused wastes few computes, and one
# held up once soon computes in place again.
COPY_AFTER_REDO = (2, 64)

Data = Callable[[int, int, int], Iterable[Any]]
Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


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
    by_reference: int = 0  # versions loaded from a coordinator's shared memory (bus.shared)
    torn: int = 0  # of those, copies thrown away and pulled again: the set was rewritten
    redone: int = 0  # computes on a coordinator's set rewritten meanwhile: done again


class Worker:
    def __init__(
        self,
        *,
        model: nn.Module,
        data: Data,
        loss: Loss,
        config: WorkerConfig,
        optimizer: OptimizerFactory | None = None,
        hub: Hub | None = None,
        handover: Handover | None = None,
        transport: ClientFactory = ZmqClient,
        clock: Clock = SYSTEM_CLOCK,
        scheduler: SchedulerFactory | None = None,
    ) -> None:
        """`hub`: this process's shared ZeroMQ context, needed for an inproc:// endpoint
        (the coordinator shard this worker hosts: see nodes.colocated). `handover`: the
        weight sets that shard makes its versions in, for the model to compute on without
        copying its range (nodes.handover); used on the CPU, when the worker pushes
        gradients. `transport` makes the links' sockets (bus.memory's for one-loop tests);
        `clock` is read for every deadline and record (bus.clock). `scheduler`: the SPEC's,
        stepped here on the worker's own optimizer (average's; nodes.schedules)."""
        self.config = config
        self._clock = clock
        self.device = torch.device(config.device)
        self.flat = FlatModel(model, self.device)  # moves the model to the device
        self._model = model
        self._data = data
        self._loss = loss
        self._make_optimizer = optimizer  # used only when the strategy has workers own one
        self._optimizer: torch.optim.Optimizer | None = None
        self._clip = 0.0  # the gradient norm its own steps clip to (average's); 0: none
        self._precision = Precision.FULL  # the run's, from the Welcome (nodes.precision)
        self._scale: LossScale | None = None  # fp16's loss scale, kept across rejoins
        self._make_scheduler = scheduler
        self._unused = 0  # samples an epoch leaves out, as its data says (Ready.unused)
        self._schedule: Schedule | None = None  # on its own optimizer, if it has one
        self.steps = 0  # local steps computed
        self.rank = config.rank
        self.phase = Phase.JOINING
        self.clock = 0  # pushes made
        count = len(config.endpoints)
        # Shared memory (bus.shared): our probe, which a coordinator on this host reads.
        self._probe = _probe() if config.shared_memory and self.device.type == "cpu" else None
        # One link a coordinator shard, each owning its range of the flat parameters (the
        # whole model when there is one coordinator).
        self._shards = [self.flat.layout.shard(i, count) for i in range(count)]
        self.links = [
            Link(endpoint, shard, shard.take(self.flat.weights), self,
                 request_timeout_s=config.request_timeout_s, keys=config.keys, hub=hub,
                 probe=self._probe.offer if self._probe is not None else "",
                 transport=transport, clock=clock,
                 # (The buffers travel to and from the first shard only.)
                 model_buffers=self.flat.model_buffers if i == 0 and self.flat.model_buffers else None)
            for i, (endpoint, shard) in enumerate(zip(config.endpoints, self._shards, strict=True))
        ]
        self._last_loss: float | None = None
        self._ended: asyncio.Future[Exception] | None = None  # set: this session is over
        self._batches: _Epochs | None = None  # the shard's batches, kept across rejoins
        self._shard: tuple[int, int, int] | None = None  # (rank, world size, batch size) of it
        self.rejoins = 0
        self._outbox: Outbox | None = None  # what pushes carry (made when training starts)
        self._forward: tuple[float, int] = (math.nan, 0)  # the last forward's loss, samples
        self._on_range: Callable[[int], None] | None = None  # set while the last backward runs
        self.flat.watch([shard.spans for shard in self._shards], self._range_done)
        self._handover = handover if self.device.type == "cpu" else None
        self._sharing = False  # this session binds the model to the handover's sets
        self._own = self.flat.weights  # the model's private buffers
        # The gradient sets in shared memory, once a coordinator on this host takes them by
        # reference (bus.shared); None: not yet, or not possible here (_shared_grads).
        self._arena: Arena | None = None
        self._keeping: Keeping | None = None  # the arena's, for the outbox's narrow buffers
        self._no_arena = self._probe is None
        # The model may compute on versions where the coordinator made them (_follow_set).
        self._in_place = False
        self._on_set: _OnSet | None = None  # the coordinator's set the model computes on now
        self._copying = 0  # computes left that copy their weights in (COPY_AFTER_REDO)
        self._backoff = 0  # how many the last redo had copy (0: the last in place held)
        self.redone = 0
        self._again: tuple[torch.Tensor, torch.Tensor] | None = None  # the batch to redo
        self._running: asyncio.Task[Any] | None = None  # the task in run(), for request_stop
        # Steps are computed on one thread of their own, a run's (torch keeps per-thread
        # state, such as grad mode, and one step runs at a time): nodes.compute.
        self._compute_thread = ComputeThread("tensorbus-compute")
        self.stopped_by: str | None = None  # why request_stop ended the run, once it did

    @property
    def name(self) -> str:
        """How logs and messages name this worker: by its rank, once it has one."""
        return f"worker {self.rank}" if self.rank >= 0 else "a worker with no rank yet"

    @property
    def version(self) -> int:
        """The version of the weights in the model now (the oldest shard's, when sharded)."""
        return min(link.version for link in self.links)

    def request_stop(self, why: str) -> None:
        """Leave the run now (a signal: see run.signals): `run()` tells every coordinator
        shard why, lets go of its shared memory and raises CancelledError. The coordinator
        goes on without this worker, as for any worker that leaves."""
        if self._running is not None and not self._running.done() and self.stopped_by is None:
            self.stopped_by = why
            self._running.cancel()

    async def run(self) -> WorkerReport:
        self._running = asyncio.current_task()
        self._compute_thread = ComputeThread(f"tensorbus-compute-{self.rank}")
        for link in self.links:
            link.open()
        try:
            await self._sessions()
        except Stopped:
            # Every worker ends holding the final model (as every rank of DDP does).
            changed = self._optimizer is not None  # local steps since the last load
            self._leave_set(keep=True)  # off the coordinator's set: copied in below
            self._bind(self._own)  # loaded below in place: off the shard's sets first
            await asyncio.gather(*(link.load_final(changed=changed) for link in self.links))
            await self._leave("stopped", "")
            for link in self.links:
                if link.failure is not None:
                    raise RunFailedError(f"the {link.peer} ended the run with an error: "
                                         f"{link.failure}") from None
        except asyncio.CancelledError:
            await self._leave("interrupted", self.stopped_by or "")
            raise
        except Exception as e:
            await self._leave("error", str(e))
            raise
        finally:
            self._compute_thread.shutdown()
            self._off_set()
            for link in self.links:
                await link.close()
            # The files go; the buffers stay mapped while used.
            for shared in (self._arena, self._probe):
                if shared is not None:
                    shared.close()
            if self._probe is not None:
                sweep()  # a coordinator killed (which we may have outlived) left its own
        return WorkerReport(self.rank, self.clock, self._last_loss, self.version, self.rejoins,
                            by_reference=sum(link.by_reference for link in self.links),
                            torn=sum(link.torn for link in self.links), redone=self.redone)

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
            waited = self._clock.monotonic() - min(link.seen for link in self.links)
            welcome = await self._join(max(self.config.reconnect_timeout_s - waited, 1.0),
                                       f"rejoin (after: {why})")

    async def _session(self, welcome: Welcome) -> None:
        """One membership: train until stopped, lost (PeerTimeoutError) or removed
        (RejectedError unknown_worker), whichever the training loop or a link sees first."""
        self._ended = asyncio.get_running_loop().create_future()
        train = asyncio.create_task(self._train(welcome))
        helpers = [asyncio.create_task(c) for link in self.links for c in link.session()]
        try:
            either: set[asyncio.Future[Any]] = {train, self._ended}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if not train.done():
                raise self._ended.result()
            train.result()
        finally:
            for task in (train, *helpers):
                task.cancel()
            await asyncio.gather(train, *helpers, return_exceptions=True)

    def _off_loop(self, work: Callable[..., _T], *args: Any) -> asyncio.Future[_T]:
        """`work(*args)` on the compute thread, so that heartbeats go on meanwhile. (Not the
        loop's default executor: closing the loop waits for its threads, with no deadline.)"""
        return working(asyncio.wrap_future(self._compute_thread.submit(work, *args)))

    def end_session(self, why: Exception) -> None:
        if isinstance(why, Stopped) and not all(link.stopped for link in self.links):
            return  # (a shard that stopped before the others: theirs are yet to come)
        if self._ended is not None and not self._ended.done():
            self._ended.set_result(why)

    def _enter(self, phase: Phase) -> None:
        log.debug("worker %d: %s -> %s", self.rank, self.phase.value, phase.value)
        self.phase = phase

    async def _join(self, within_s: float, what: str) -> Welcome:
        """Join every link: the first decides our rank (on a rejoin: our old one, so that
        our data shard stays ours; any, if another worker has it now), the other shards
        are asked for that rank. Returns the first shard's Welcome."""
        self._sharing = False
        self._off_set()  # (what it computed on stays the model's if no Welcome comes)
        self._bind(self._own)  # the Welcome's weights are loaded in place: see nodes.handover
        first, *others = self.links
        # A rank asked for by the user is theirs to fix if taken; a rank we had before, not.
        welcome = await first.join(self.rank, within_s, what, any_rank=self.rank != self.config.rank)
        self.rank = welcome.rank
        if others:
            welcomes = await asyncio.gather(*(
                link.join(self.rank, within_s, what, any_rank=False) for link in others))
            for link, other in zip(others, welcomes, strict=True):
                _check_same_run(welcome, other, first.endpoint, link.endpoint)
        log.info("worker %d joined at version %d (%s)", self.rank, self.version, welcome.strategy)
        # Loaded by now: kept for the session without its frames, which may be the sender's
        # own memory (an in-process shard's snapshot, which it may not reuse while held).
        return replace(welcome, tensors=(), state=())

    # Training ------------------------------------------------------------------------------

    async def _train(self, welcome: Welcome) -> None:
        self._model.train()  # dropout on, BatchNorm's statistics moving: whatever it was given
        wait = Wait(welcome.wait)
        shard = (self.rank, welcome.world_size, welcome.batch_size)
        if (self._batches is None or self._shard != shard
                or self._batches.position != welcome.position):
            # Go on where the coordinator's records say this rank's data had got to: a
            # fresh process, a rejoin on another shard, or a coordinator restarted from a
            # checkpoint (whose records are behind us: the data rewinds with the weights).
            self._enter(Phase.LOADING)
            seed_generators(welcome.seed, self.rank)  # before data(), which may shuffle
            shards = await self._off_loop(self._load, welcome)
            unused = getattr(shards, "unused", 0)
            self._unused = unused if isinstance(unused, int) and unused > 0 else 0
            self._batches = _Epochs(shards, self._describe_data(welcome),
                                    anew=_on_loop(asyncio.get_running_loop()),
                                    again=functools.partial(self._load, welcome))
            self._again = None
            await self._off_loop(self._batches.skip, welcome.position)
            self._shard = shard
        weights_pushed = PushKind(welcome.push) is PushKind.WEIGHTS
        # A worker that steps its own weights may not compute on the shard's sets.
        self._sharing = self._handover is not None and not weights_pushed
        if weights_pushed and self._optimizer is None:
            make = self._make_optimizer or (lambda ps: torch.optim.SGD(ps, lr=welcome.lr))
            # In a thread: a first optimizer may import for seconds (torch._dynamo), and the
            # loop must keep beating meanwhile.
            self._optimizer = await self._off_loop(make_optimizer, make,
                                                   self._model.parameters())
            if self._make_scheduler is not None:
                self._schedule = make_schedule(self._make_scheduler, self._optimizer)
        self._clip = welcome.clip_grad_norm if weights_pushed else 0.0
        try:
            self._precision = Precision.parse(welcome.precision)
            self._precision.check(self.device)
        except ValueError as e:
            raise ComputeError(f"worker {self.rank}: {e}") from None
        if self._precision is Precision.FP16 and self._scale is None:
            self._scale = LossScale()
        # Async holds nobody back: the next gradient is computed, into the other set of
        # buffers, while this one is on the wire (its answers are taken meanwhile).
        pipelined = wait is Wait.NOTHING and not weights_pushed
        # By reference, the buffers pushed are read where they lie until the step that
        # takes them, or until copied out (bus.shared, Ownership): only where the loop
        # waits for that before the next backward writes them again, and only gradients
        # (not weights). Sync waits for a newer version; async and ssp write a set again
        # once its push is answered, which a coordinator does after the step for a push by
        # reference (ssp's answer may wait longer, for the slowest). The gradient sets are
        # moved there before Ready: not on training time, and in a thread (the loop beats
        # on). `--compress bf16|fp16` pushes its narrow copies instead, one per gradient
        # set, which the Outbox makes there (the sets stay private); top-k's indices are
        # integers, which go as bytes.
        compression = Compression.parse(welcome.compress)
        refer = (await self._off_loop(functools.partial(
            self._shared_grads, dense=compression.dtype is None))
                 if not weights_pushed and compression.topk is None
                 and any(link.shared for link in self.links) else None)
        # Answered when the coordinators' start gates open: everyone starts together.
        await asyncio.gather(*(
            link.request(Ready(sender=self.rank, version=link.version,
                               batches=self._batches.length, unused=self._unused), patient=True)
            for link in self.links))
        if pipelined:
            self.flat.use_grad_sets(2)
        # Each shard's part is pushed as soon as backward has finished it, overlapping the
        # rest of backward, where what is pushed is one backward's gradient.
        early = not weights_pushed and welcome.local_steps == 1
        # One coordinator on this host, whose versions come by reference: the model
        # computes on each where the coordinator made it, not on a copy (_follow_set).
        self._in_place = (early and len(self.links) == 1 and self.links[0].shared
                          and self._handover is None and self.device.type == "cpu"
                          and compression.topk is None)
        # What goes on the wire, per gradient set and shard, filled as backward finishes
        # each range: gradients as they are, narrowed or top-k (--compress), or weights.
        outbox = self._make_outbox(compression, weights_pushed, shared=refer is not None)
        self._outbox, parts = outbox, outbox.parts
        sent: list[list[Tracker | None]] = [[] for _ in parts]  # each set's last sends
        # Where time goes between computes, reported with the next push (telemetry).
        comm_s = wait_s = 0.0
        previous: _InFlight | None = None  # pipelined: the last push, not yet answered
        while True:
            started = self._clock.monotonic()
            if pipelined:
                self.flat.swap()
            current = 0 if weights_pushed else self.flat.current
            # The buffers about to be written must be off the wire.
            for tracker in sent[current]:
                await wait_sent(tracker, timeout=self.links[0].timeout_s, what="the last update")
            comm_s += self._clock.monotonic() - started
            self._enter(Phase.COMPUTING)
            began, started = self._clock.wall(), self._clock.monotonic()
            # Weights broadcast by reference are computed on where they lie, or loaded
            # here, on the loop, which can pull them again if the copy was torn
            # (Link.load_shared); the newest weights each link has besides are loaded by
            # the compute thread, first.
            if self._in_place:
                self._follow_set()
            while any(link.shared_pending() for link in self.links):  # (a pull lets more in)
                for link in self.links:
                    await link.load_shared()
            latest = [link.latest() for link in self.links]
            computed_on = [w.version if w is not None else link.version
                           for link, w in zip(self.links, latest, strict=True)]
            loop = asyncio.get_running_loop()
            ready = [loop.create_future() for _ in self.links]
            clock = self.clock  # what this push counts (the clock moves on once it is sent)
            if delay := self.config.faults.delay(welcome.local_steps):
                # A straggler on purpose (nodes.faults): on the weights it holds now, and
                # on the coordinator's set where it computes in place.
                await asyncio.sleep(delay)
            compute, ended = _in_thread(loop, self._compute_thread, functools.partial(
                self._compute, latest, welcome.local_steps, current,
                functools.partial(_announce, loop, ready) if early else None,
                functools.partial(loop.call_soon_threadsafe, self._forget_loaded)))
            del latest  # the compute thread lets go of the frames once they are loaded
            async with _finishing(ended, lambda: self.stopped_by is not None):
                if previous is not None:
                    # The last push's answers, taken while this gradient is computed.
                    answers = await previous.answers
                    sent[previous.current] = [tracker for _, tracker in answers]
                    waits = self._waits([a for a, _ in answers], previous.computed_on, wait)
                    await asyncio.gather(*(link.await_version(newer_than=v) for link, v in waits))
                    previous = None
                pushes = asyncio.ensure_future(asyncio.gather(*(
                    self._push_when_ready(link, ready[i], compute, computed_on[i], clock,
                                          parts[current][i], began, started, comm_s, wait_s,
                                          refer if link.shared else None)
                    for i, link in enumerate(self.links))))
                async with _cancelling(pushes):
                    try:
                        self._last_loss = (await compute)[0]
                    except _Rewritten:
                        # Nothing was pushed (its part was not made ready): the same batch
                        # again, on the newest version, copied in (_redo).
                        pushes.cancel()
                        await asyncio.gather(pushes, return_exceptions=True)
                        self._redo()
                        continue
                    if self._on_set is not None:
                        self._backoff = 0  # computed in place, on a set left alone
                    computed = self._clock.monotonic()
                    self.clock += 1  # counted once sent: heartbeats from now on include it
                    self._enter(Phase.PUSHING)
                    if pipelined:
                        previous = _InFlight(pushes, computed_on, current)
                        comm_s = wait_s = 0.0
                        continue
                    answers = await pushes
            answered = self._clock.monotonic()
            sent[current] = [tracker for _, tracker in answers]
            acks = [ack for ack, _ in answers]
            # Held back by the strategy (ssp's bound) for as long as the longest-holding shard.
            # (Pushes that left during backward overlapped it: only what is left counts.)
            held_s = min(max(max(a.held_s, 0.0) if isinstance(a, Ack) else 0.0 for a in acks),
                         answered - computed)
            comm_s, wait_s = answered - computed - held_s, held_s
            waits = self._waits(acks, computed_on, wait)
            if waits:
                self._enter(Phase.WAITING)
                await asyncio.gather(*(link.await_version(newer_than=v) for link, v in waits))
            wait_s += self._clock.monotonic() - answered

    async def _push_when_ready(
        self, link: Link, ready: asyncio.Future[None], compute: asyncio.Future[tuple[float, int]],
        version: int, clock: int, part: tuple[torch.Tensor, ...], began: float, started: float,
        comm_s: float, wait_s: float, refer: Callable[[torch.Tensor], Ref | None] | None,
    ) -> tuple[Message, Tracker | None]:
        """Send this shard its part once backward has finished it (or the compute is over)
        and return its answer. The answer may be held back by the strategy (ssp's bound):
        it is awaited while the coordinator is alive, not against a fixed deadline."""
        either: set[asyncio.Future[Any]] = {ready, compute}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if compute.done():
            loss, samples = compute.result()
        else:
            loss, samples = self._forward
        assert self._batches is not None
        push = Push(sender=self.rank, version=version, clock=clock, loss=loss,
                    samples=samples, tensors=part, began=began,
                    compute_s=self._clock.monotonic() - started, comm_s=comm_s, wait_s=wait_s,
                    batches=self._batches.length,
                    overflows=self._scale.skipped if self._scale is not None else 0,
                    state=link.model_buffers.copy() if link.model_buffers is not None else ())
        return await link.request_tracked(push, patient=True, refer=refer)

    def _make_outbox(self, compression: Compression, weights: bool, *, shared: bool) -> Outbox:
        """The Outbox, its narrow copies (--compress bf16|fp16) in shared memory if
        `shared` and there is room (else private: their pushes carry the bytes)."""
        if shared and self._keeping is not None and compression.dtype is not None:
            try:
                return Outbox(self.flat, self._shards, compression, weights=weights,
                              allocate=self._keeping.round())
            except OSError as e:
                log.warning("worker %d: pushes carry their bytes: no room for their %s copies "
                            "in shared memory (%s)", self.rank, compression.dtype, e)
        return Outbox(self.flat, self._shards, compression, weights=weights)

    def _shared_grads(self, *, dense: bool = True) -> Callable[[torch.Tensor], Ref | None] | None:
        """Where the tensors pushed by reference lie in shared memory, or None if there is
        no room there: pushes then carry the bytes. `dense`: the gradient sets themselves
        (moved there on first use); else only what the Outbox makes there (narrow copies:
        a later join that pushes the sets as they are then sends their bytes)."""
        if self._arena is None and not self._no_arena:
            arena = Arena()
            try:
                if dense:
                    self.flat.share_grads(arena.allocate)
            except OSError as e:
                arena.close()
                self._no_arena = True
                log.warning("worker %d: pushes carry their bytes: no room for the gradients "
                            "in shared memory (%s)", self.rank, e)
            else:
                self._arena = arena
                self._keeping = Keeping(arena.allocate)
        return self._arena.locate if self._arena is not None else None

    def _waits(self, acks: list[Message], computed_on: list[int], wait: Wait) -> list[tuple[Link, int]]:
        """What to wait for, shard by shard, once pushes are answered: the strategy's rhythm
        (see strategies.base.Wait); an update dropped as late waits for the version it
        missed, then computes again (it does not count for its version)."""
        waits: list[tuple[Link, int]] = []
        for link, ack, version in zip(self.links, acks, computed_on, strict=True):
            if isinstance(ack, Ack) and ack.dropped:
                log.info("worker %d: update on version %d dropped by the %s (%s)",
                         self.rank, version, link.peer, ack.dropped)
                if ack.version > version:
                    # Late: catch up first (pulling, if the broadcast was missed), or this
                    # worker would compute on the old version again, and again.
                    waits.append((link, ack.version - 1))
            elif wait is Wait.NEWER:
                waits.append((link, version))
            elif wait is Wait.ANSWERED and ack.version > link.newest():
                waits.append((link, ack.version - 1))
        return waits

    def _load(self, welcome: Welcome) -> Iterable[Any]:
        try:
            return self._data(self.rank, welcome.world_size, welcome.batch_size)
        except Exception as e:
            raise DataError(f"{self._describe_data(welcome)} raised {type(e).__name__}: {e}") from e

    def _describe_data(self, welcome: Welcome) -> str:
        return f"data(rank={self.rank}, world_size={welcome.world_size}, batch_size={welcome.batch_size})"

    def _compute(
        self, latest: list[Newer | None], local_steps: int, current: int,
        announce: Callable[[int], None] | None, loaded: Callable[[], object] | None = None,
    ) -> tuple[float, int]:
        """Load the newest weights each link has, then compute `local_steps` gradients
        (each followed by a local optimizer step when this worker owns one) into gradient
        set `current`. Each shard's range of the last gradient is made ready to send
        (see nodes.outbox: converted or sparsified, copied to the host on a GPU) as soon as backward has
        finished it, and `announce`d, so that it can go out while backward goes on. Runs in
        a thread: touches only the model. Returns the mean loss and the samples seen."""
        if self._sharing:
            self._follow_handover(latest)
        for i, link in enumerate(self.links):
            weights, latest[i] = latest[i], None  # hold no frames once loaded (see below)
            if weights is not None:
                link.load(weights)
            del weights
        if loaded is not None:
            loaded()  # the links let go of the frames too: their senders may reuse them
        finished: set[int] = set()
        on_set = self._on_set
        rewritten: list[int] = []

        def finish(i: int) -> None:
            if i not in finished:
                finished.add(i)
                if on_set is not None and Shelf.generation(on_set.first) != on_set.generation:
                    # The gradient is made (every weight it read, read): had the set been
                    # written meanwhile, its counter would have moved by now (bus.shared).
                    rewritten.append(i)
                    return
                assert self._outbox is not None
                self._outbox.fill(i, current)
                if announce is not None:
                    announce(i)

        total_loss, samples = 0.0, 0
        scale, overflows = self._scale, 0
        step = 0
        while step < local_steps:
            self.config.faults.before_step(self.steps)
            inputs, targets = self._again or self._batches_next()
            self._again = None
            self.flat.begin_backward()
            pushes_gradient = step == local_steps - 1 and self._optimizer is None
            # (A scaled gradient is ready to send once unscaled, after backward.)
            self._on_range = finish if pushes_gradient and scale is None else None
            try:
                with self._precision.autocast(self.device):
                    loss = self._loss(self._model(inputs), targets)
                if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
                    raise _NotALoss(loss)
                figure = float(loss.detach())
                self._forward = (figure, len(inputs))  # what an early push reports
                (loss * scale.scale if scale is not None else loss).backward()
            except _NotALoss as e:
                raise ComputeError(
                    f"worker {self.rank}: loss(output, target) returned {e}, not a tensor of one "
                    "element: return the loss over the batch as a tensor (its mean, as "
                    "torch.nn.functional.cross_entropy gives)") from None
            except Exception as e:
                raise ComputeError(
                    f"worker {self.rank}: forward, loss or backward raised {type(e).__name__}: {e}"
                ) from e
            finally:
                self._on_range = None
            self.flat.gather_grads()
            if scale is not None and not scale.unscale(self.flat.grads):
                overflows += 1
                # Skipped: the next batch instead, on the same weights. Where overflows
                # go on and on (the scale is far below 1), the model itself is not
                # finite: the gradient goes as it is, for the coordinator to judge.
                if overflows < _MAX_OVERFLOWS:
                    self.steps += 1
                    continue
            if self._optimizer is not None:
                if self._clip:
                    self.flat.clip_grads(self._clip)
                self._optimizer.step()
                if self._schedule is not None:  # (its epochs: passes over its shard)
                    batches = self._batches
                    assert batches is not None
                    self._schedule.after_step(
                        batches.position // batches.length if batches.length > 0 else None)
            self.steps += 1
            step += 1
            total_loss += figure
            samples += len(inputs)
        if self._optimizer is not None:
            self.flat.stage(weights=True)
        else:
            for i in range(len(self._shards)):  # those backward did not report (no hook ran)
                finish(i)
        if rewritten:  # (in place, local_steps is 1: this batch is the compute's only one)
            self.steps -= local_steps
            self._again = (inputs, targets)
            raise _Rewritten
        return total_loss / local_steps, samples

    def _follow_set(self) -> None:
        """Before a compute, where the model may compute in place (`_in_place`): bind it
        to the coordinator's set that the newest version came in (a copy of the model saved
        a compute), or back to its own buffers for a version that comes otherwise.

        The coordinator does not know that the set is read: its pool writes a set again
        some versions after publishing it (bus.shared, Gallery), bumping its counter first.
        The compute reads the counter again once the gradient is made, before it is made
        ready to push (`_compute`): moved, and the gradient is thrown away and computed
        again (`_redo`). The set is mapped read-only here: nothing in the worker writes
        the model's weights while they lie there (each load goes to its own buffers)."""
        link = self.links[0]
        if self._copying:
            self._copying -= 1
            return
        taken = link.take_shared()
        if taken is not None:
            # By reference, each tensor is one view of the set (never in pieces).
            assert all(isinstance(t, torch.Tensor) for t in taken.tensors)
            tensors = cast(tuple[torch.Tensor, ...], tuple(taken.tensors))
            self.flat.rebind(tensors)
            link.rebind(tensors)
            self._on_set = _OnSet(taken, tensors[0], taken.generation)
        elif self._on_set is not None and link.newest() > link.version:
            self._leave_set(keep=False)  # what comes is loaded whole

    def _leave_set(self, *, keep: bool) -> None:
        """Bind the model back to its own buffers, if it computes on a coordinator's set;
        `keep`: the version it held is to be copied in before the next compute (unless a
        newer one comes first: Link.give_back)."""
        on, self._on_set = self._on_set, None
        if on is None:
            return
        self.flat.rebind(self._own)
        link = self.links[0]
        link.rebind(self._own)
        if keep:
            link.give_back(on.weights)

    def _off_set(self) -> None:
        """As the worker ends, in any way: a model still bound to a coordinator's set (a
        failed run) gets its own buffers back, holding what the set holds now, so that
        whoever uses the model after (from Python) may write its weights."""
        on = self._on_set
        if on is not None:
            with torch.no_grad():
                for own, where in zip(self._own, self.flat.weights, strict=True):
                    own.copy_(where)
            self._leave_set(keep=False)

    def _redo(self) -> None:
        """After a compute on a coordinator's set that was written again meanwhile: the
        next ones copy their weights in (COPY_AFTER_REDO), the first the newest version."""
        on = self._on_set
        assert on is not None
        log.info("worker %d: the %s wrote the weights of version %d again while they were "
                 "computed on: computing again on the newest version", self.rank,
                 self.links[0].peer, on.weights.version)
        self.redone += 1
        first, most = COPY_AFTER_REDO
        self._backoff = self._copying = min(max(2 * self._backoff, first), most)
        self._leave_set(keep=True)

    def _follow_handover(self, latest: list[Newer | None]) -> None:
        """Before loading `latest`, beside a colocated shard: bind the model to the set
        the shard made its newest version in (its range is then in place), or back to
        its own buffers for anything else from that shard (see nodes.handover)."""
        assert self._handover is not None
        local = latest[self._handover.index]
        if local is None:
            return  # nothing new from the shard beside us: its range stays where it is
        found = (self._handover.holding(local.weights.tensors)
                 if local.weights is not None and not local.changes else None)
        self._bind(found if found is not None else self._own, latest)

    def _bind(self, weights: tuple[torch.Tensor, ...],
              latest: list[Newer | None] | None = None) -> None:
        """Make `weights` (the model's own buffers, or a handover set) the model's, carrying
        over every range that `latest` (nothing, if not given) does not load whole."""
        current = self.flat.weights
        if weights is current:
            return
        assert self._handover is not None  # only the handover gives the model other sets
        with torch.no_grad():
            for i, shard in enumerate(self._shards):
                newer = latest[i] if latest is not None else None
                if newer is None or newer.weights is None:
                    for dst, src in zip(shard.take(weights), shard.take(current), strict=True):
                        dst.copy_(src)
        self.flat.rebind(weights)
        for link, shard in zip(self.links, self._shards, strict=True):
            link.rebind(shard.take(weights))
        # Last: the shard may reuse the set we leave as soon as this says we left it.
        self._handover.bind(None if weights is self._own else weights)

    def _forget_loaded(self) -> None:
        for link in self.links:
            link.forget_loaded()

    def _range_done(self, i: int) -> None:
        """Called on the backward thread when shard i's range has all its gradients."""
        on_range = self._on_range
        if on_range is not None:
            on_range(i)

    def _batches_next(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._batches is not None
        inputs, targets = self._batches.next()
        if self.device.type != "cpu":
            inputs = inputs.to(self.device, non_blocking=True)
            targets = targets.to(self.device, non_blocking=True)
        return inputs, targets

    async def _leave(self, reason: str, detail: str) -> None:
        """Say goodbye to every coordinator shard, briefly: they may already be gone."""
        self._enter(Phase.LEAVING)
        await asyncio.gather(*(link.leave(reason, detail) for link in self.links))


def _check_same_run(first: Welcome, other: Welcome, first_at: str, other_at: str) -> None:
    """Shards of one parameter server must run the same strategy on the same terms."""
    for name in ("rank", "world_size", "strategy", "push", "local_steps", "wait", "batch_size",
                 "compress"):
        a, b = getattr(first, name), getattr(other, name)
        if a != b:
            raise RejectedError(RejectCode.UNEXPECTED.value, (
                f"the coordinator shards disagree: {name} is {a!r} at {first_at} and {b!r} at "
                f"{other_at}: start every shard with the same options"))

def _on_loop(loop: asyncio.AbstractEventLoop) -> Callable[[Iterable[Any]], Iterator[Any]]:
    """iter(), called on `loop`'s thread from whichever thread asks (waiting for it there).

    Why: a DataLoader with workers forks them when iterated, and a process forked from a
    thread of an executor fails as it exits (exit status 1, which the DataLoader reports
    in tracebacks as a worker that 'exited unexpectedly'): its threading shutdown joins
    the executor's threads, the forking one included. The loop's thread is the main one."""
    def anew(shards: Iterable[Any]) -> Iterator[Any]:
        if loop.is_closed() or threading.get_ident() == loop_thread:
            return iter(shards)
        made: concurrent.futures.Future[Iterator[Any]] = concurrent.futures.Future()

        def make() -> None:
            try:
                made.set_result(iter(shards))
            except BaseException as e:  # noqa: BLE001 - handed to the thread that asked
                made.set_exception(e)

        try:
            loop.call_soon_threadsafe(make)
        except RuntimeError:  # closed meanwhile: no loop to wait for
            return iter(shards)
        while True:
            try:
                return made.result(timeout=1.0)
            except TimeoutError:
                if loop.is_closed():  # (closed before it ran make: it never will)
                    return iter(shards)

    loop_thread = threading.get_ident()  # (made on the loop's thread)
    return anew


class _Epochs:
    """Batches of this rank's shard, epoch after epoch, checked for shape.

    Each epoch is a new iter() of what data() returned (made by `anew`: see _on_loop), or,
    where that was an iterator read only once (a generator), of what data() returns when
    called again (`again`). A shard without len() learns its length when its first pass
    ends: the batch after the last is read ahead, so that the push of the last one says it.
    """

    def __init__(self, shards: Iterable[Any], described: str,
                 anew: Callable[[Iterable[Any]], Iterator[Any]] = iter,
                 again: Callable[[], Iterable[Any]] | None = None) -> None:
        self._shards = shards
        self._described = described
        self._anew = anew
        self._again = again
        self._once = isinstance(shards, Iterator)  # read once: a generator, say
        self._it = self._begin(shards)
        self._taken = False  # whether a pass has yielded a batch yet
        self.length = len(shards) if isinstance(shards, Sized) else -1  # -1: unknown yet
        self.position = 0  # batches taken since the first
        self._in_pass = 0  # batches taken of the pass under way
        self._ahead: tuple[torch.Tensor, torch.Tensor] | None = None  # read ahead, not taken

    def _begin(self, shards: Iterable[Any]) -> Iterator[Any]:
        try:
            return self._anew(shards)
        except TypeError:
            raise DataError(f"{self._described} returned {type(shards).__name__}, not an iterable "
                            "of (input, target) batches: return a list of them, or a DataLoader"
                            ) from None

    def skip(self, batches: int) -> None:
        """Move `batches` on from the start: where a restarted run left this shard. Whole
        epochs of a sized shard are skipped by starting the next one (each iter() of a
        SPEC's data may be a new epoch order) without reading their batches."""
        if self.length > 0 and not self._once:
            for _ in range(batches // self.length):
                self._it = self._anew(self._shards)
            self.position = batches - batches % self.length
        while self.position < batches:
            self.next()

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self._ahead if self._ahead is not None else self._read()
        assert batch is not None  # (only a read `or_end` gives None)
        self._ahead = None
        self.position += 1
        self._in_pass += 1
        if self.length < 0:  # read ahead: is this the last batch of its pass?
            self._ahead = self._read(or_end=True)
            if self._ahead is None:  # it is: the pass's length is known now
                self.length = self._in_pass
        return batch

    def _read(self, *, or_end: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The next batch, the next pass begun if this one is over; with `or_end`, None
        where this pass is over (the next one is begun when its first batch is read)."""
        try:
            try:
                batch = next(self._it)
            except StopIteration:
                if or_end:
                    return None
                self._new_pass()
                batch = next(self._it)
        except StopIteration:
            if self._taken:  # its first pass had batches, and the next none
                raise DataError(
                    f"{self._described} yielded no batches on its second pass: a generator "
                    "or an iterator is read only once, and each epoch reads the data again: "
                    "return something that iterates anew (a list, a DataLoader, or a class "
                    "with __iter__), or make data() a generator function") from None
            raise DataError(f"{self._described} yielded no batches: every rank needs at least "
                            "one; use fewer workers, a smaller --batch-size, or more data") from None
        except DataError:
            raise
        except Exception as e:
            raise DataError(f"iterating {self._described} raised {type(e).__name__}: {e}") from e
        self._taken = True
        if not (isinstance(batch, tuple | list) and len(batch) == 2
                and all(isinstance(t, torch.Tensor) for t in batch)):
            raise DataError(f"{self._described} must yield (input, target) tensor pairs, "
                            f"got {type(batch).__name__}")
        return batch[0], batch[1]

    def _new_pass(self) -> None:
        """Begin the next epoch: a new iter() of the shard, or of what data() returns when
        called again, where the shard was an iterator that is read once."""
        if self.length < 0:
            self.length = self._in_pass
        self._in_pass = 0
        if self._once and self._again is not None:
            self._shards = self._again()
        self._it = self._begin(self._shards)


class _NotALoss(Exception):
    """What loss() returned was no loss: its message says what it was."""

    def __init__(self, returned: Any) -> None:
        super().__init__(f"a tensor of shape {tuple(returned.shape)}"
                         if isinstance(returned, torch.Tensor) else type(returned).__name__)


class _Rewritten(Exception):
    """The coordinator's set the model computed on was written again meanwhile."""


@dataclass(frozen=True)
class _OnSet:
    """The version the model computes on where it lies, in a coordinator's set."""

    weights: Weights
    first: torch.Tensor  # its first tensor: the set's counter is read through it
    generation: int  # the set's, as published with the version


@dataclass
class _InFlight:
    """A push on the wire whose answers are taken during the next compute (pipelined)."""

    answers: asyncio.Future[list[tuple[Message, Tracker | None]]]
    computed_on: list[int]
    current: int  # the gradient set it was sent from


def seed_generators(seed: int, rank: int) -> None:
    """Seed torch's, numpy's and random's generators from (seed, rank), so that a run's
    dropout masks and shuffles are the same from run to run (each rank's its own)."""
    derived = int(numpy.random.SeedSequence([seed, rank]).generate_state(1, numpy.uint64)[0])
    torch.manual_seed(derived)
    numpy.random.seed(derived % 2**32)
    random.seed(derived)


def _probe() -> Probe | None:
    """Our bus.shared.Probe, or None where there is no shared memory to push from."""
    try:
        sweep()  # segments of killed processes: nobody else would unlink them
        return Probe()
    except OSError as e:
        log.info("pushes carry their bytes: no shared memory here (%s)", e)
        return None


def _announce(loop: asyncio.AbstractEventLoop, ready: list[asyncio.Future[None]], i: int) -> None:
    """From the backward thread: shard i's part is ready to send."""
    loop.call_soon_threadsafe(_resolve, ready[i])


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _in_thread(loop: asyncio.AbstractEventLoop, thread: ComputeThread,
               work: Callable[[], _T]) -> tuple[asyncio.Future[_T], asyncio.Future[None]]:
    """Run `work` on `thread`: its result, and a future done once `work` can no longer touch
    anything, which cancelling the first does not change (a running thread cannot be
    cancelled). Both come from the executor's own future, which is done when `work`
    returns or raises, and also when it is cancelled before it began: a future resolved
    from inside `work` would never be, had `work` never run."""
    ended = working(loop.create_future())  # (a virtual clock waits for it: bus.clock)
    job = thread.submit(work)

    def over(_: concurrent.futures.Future[_T]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            loop.call_soon_threadsafe(_resolve, ended)

    job.add_done_callback(over)
    return asyncio.wrap_future(job, loop=loop), ended


@contextlib.asynccontextmanager
async def _finishing(ended: asyncio.Future[None], leaving: Callable[[], bool]
                     ) -> AsyncIterator[None]:
    """Run the body beside the compute thread; if the body fails, wait for the thread to
    end before going on: until then it writes the model, the gradients and the outbox,
    which whatever comes next (loading the final weights, a new session) uses too. A
    worker `leaving` for good (a signal) uses none of them again, and does not wait.

    The wait has no deadline, as the step itself has none (a thread cannot be stopped,
    and a step may rightly be long); a wait past FINISHING_SAY_S says why in the log."""
    try:
        yield
    except BaseException as e:
        if leaving():
            raise
        done, _ = await asyncio.wait({ended}, timeout=FINISHING_SAY_S)
        if not done:
            log.warning("training stopped (%s); waiting for the step being computed to end "
                        "before going on: a running step cannot be interrupted",
                        str(e) or type(e).__name__)
            await asyncio.wait({ended})
        raise


@contextlib.asynccontextmanager
async def _cancelling(task: asyncio.Future[Any]) -> AsyncIterator[None]:
    """Run the body beside `task`; if the body fails, cancel the task and wait for it."""
    try:
        yield
    except BaseException:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise
