"""A worker: joins, trains on its shard with compute off the event loop, pushes, follows versions.

The Worker is the node: it builds its parts, runs its sessions, and ends holding the final
model, whichever way the run ends. Its parts, one job each:

- nodes.worker_session: joining, and joining again after losing the coordinator or being
  removed by it.
- nodes.training: the rhythm the strategy asks for, handed over in the Welcome (push and
  wait, or pipelined), with no branch on the strategy's name; nodes.streaming, the rhythm
  of streaming averaging (one fragment of the model on the wire while computing on).
- nodes.local_steps: the steps themselves (forward, loss, backward, fp16's loss scale, a
  local optimizer where the worker pushes weights), on the compute thread (nodes.compute),
  so that heartbeats go on while it runs.
- nodes.epochs: the rank's shard of data(), epoch after epoch.
- nodes.in_place: which buffers the model computes on: its own, a coordinator's set on
  this host (by reference, not copied in), or a colocated shard's (nodes.colocated_sets).
- nodes.push_memory: the shared memory a coordinator on this host reads pushes from.

The worker talks to its coordinator through a `Link` (nodes.link): requests, answers,
broadcasts, heartbeats and versions. With a sharded parameter server it holds one link per
shard, each owning a range of the flat parameters; a push sends each shard its range, all
at once, and the worker goes on when every shard has answered (and, where the strategy
waits, published a newer version). Weights are only loaded between computes, from the
newest version each link has seen.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from tensorbus.bus.clock import SYSTEM_CLOCK, Clock, working
from tensorbus.bus.layout import Compression
from tensorbus.bus.messages import Phase, Ready, Welcome
from tensorbus.bus.shared import Ref
from tensorbus.bus.transport import ClientFactory, Hub, ZmqClient
from tensorbus.nodes.colocated_sets import ColocatedSets
from tensorbus.nodes.compute import FINISHING_SAY_S, ComputeThread, ScriptEnded
from tensorbus.nodes.config import WorkerConfig
from tensorbus.nodes.epochs import Data, DataError, RankData, seed_generators
from tensorbus.nodes.flat import FlatModel
from tensorbus.nodes.fragments import Fragments
from tensorbus.nodes.in_place import COPY_AFTER_REDO, InPlace
from tensorbus.nodes.link import Link, RunFailedError
from tensorbus.nodes.liveness import Stopped
from tensorbus.nodes.local_steps import ComputeError, LocalSteps, Loss
from tensorbus.nodes.optimizers import OptimizerFactory
from tensorbus.nodes.push_memory import PushMemory
from tensorbus.nodes.schedules import SchedulerFactory
from tensorbus.nodes.streaming import StreamingLoop
from tensorbus.nodes.training import Terms, TrainingLoop
from tensorbus.nodes.version_chain import PendingVersion
from tensorbus.nodes.worker_session import WorkerSessions
from tensorbus.strategies.base import PushKind, Wait

__all__ = [  # (what moved out is imported from here too)
    "COPY_AFTER_REDO", "FINISHING_SAY_S", "ComputeError", "Data", "DataError", "Loss",
    "Worker", "WorkerReport", "seed_generators",
]

log = logging.getLogger("tensorbus.worker")
_T = TypeVar("_T")


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
    # It may compute on a coordinator's weight set where it lies (nodes.in_place): the
    # compute is its own, which checks the set's counter once the gradient is made. (A
    # script's own loop computes in the script's thread, unchecked: nodes.own_loop.)
    _COMPUTES_ON_SETS = True

    def __init__(
        self,
        *,
        model: nn.Module,
        data: Data,
        loss: Loss,
        config: WorkerConfig,
        optimizer: OptimizerFactory | None = None,
        hub: Hub | None = None,
        colocated_sets: ColocatedSets | None = None,
        transport: ClientFactory = ZmqClient,
        clock: Clock = SYSTEM_CLOCK,
        scheduler: SchedulerFactory | None = None,
    ) -> None:
        """`hub`: this process's shared ZeroMQ context, needed for an inproc:// endpoint
        (the coordinator shard this worker hosts: see nodes.colocated). `colocated_sets`: the
        weight sets that shard makes its versions in, for the model to compute on without
        copying its range (nodes.colocated_sets); used on the CPU, when the worker pushes
        gradients. `transport` makes the links' sockets (bus.memory's for one-loop tests);
        `clock` is read for every deadline and record (bus.clock). `scheduler`: the SPEC's,
        stepped here on the worker's own optimizer (average's; nodes.schedules)."""
        self.config = config
        self._clock = clock
        self.device = torch.device(config.device)
        self.flat = FlatModel(model, self.device)  # moves the model to the device
        self._model = model
        self.rank = config.rank
        self.phase = Phase.JOINING
        self.clock = 0  # pushes made
        self.rejoins = 0
        self.last_loss: float | None = None
        self._push_memory = PushMemory(enabled=config.shared_memory)
        # One link a coordinator shard, each owning its range of the flat parameters (the
        # whole model when there is one coordinator).
        count = len(config.endpoints)
        self._shards = [self.flat.layout.shard(i, count) for i in range(count)]
        self.links = [
            Link(endpoint, shard, shard.take(self.flat.weights), self,
                 request_timeout_s=config.request_timeout_s, keys=config.keys, hub=hub,
                 host_token=self._push_memory.offer, transport=transport, clock=clock,
                 # (The buffers travel to and from the first shard only.)
                 model_buffers=self.flat.model_buffers if i == 0 and self.flat.model_buffers else None)
            for i, (endpoint, shard) in enumerate(zip(config.endpoints, self._shards, strict=True))
        ]
        if config.standby:  # (until the coordinator's heartbeats say where its standby is)
            self.links[0].liveness.standby = config.standby
        self._data = RankData(data, self.device)  # the shard's batches, kept across rejoins
        self._in_place = InPlace(self.flat, self.links, self._shards,
                                 colocated_sets if self.device.type == "cpu" else None)
        self._local_steps = self._new_steps(model=model, loss=loss, flat=self.flat, shards=count,
                                            data=self._data, faults=config.faults,
                                            optimizer=optimizer, scheduler=scheduler)
        self.flat.watch([shard.spans for shard in self._shards], self._local_steps.range_done)
        self._sessions = WorkerSessions(self, train=self._train, before_join=self._before_join,
                                        clock=clock)
        self._running: asyncio.Task[Any] | None = None  # the task in run(), for request_stop
        # Steps are computed on one thread of their own, a run's (torch keeps per-thread
        # state, such as grad mode, and one step runs at a time): nodes.compute.
        self._compute_thread = self._new_compute_thread("tensorbus-compute")
        self.stopped_by: str | None = None  # why request_stop ended the run, once it did

    def _new_compute_thread(self, name: str) -> ComputeThread:
        return ComputeThread(name)

    def _new_steps(self, **parts: Any) -> LocalSteps:
        """What computes its steps (a pipeline stage's worker computes its stage's part of
        each batch: nodes.stage_steps)."""
        return LocalSteps(**parts)

    async def _before_ready(self, welcome: Welcome) -> None:
        """What a session does once it has its data and its terms, before it says it is
        ready (a pipeline stage's worker finds the stages beside it: nodes.stage_worker)."""

    @property
    def name(self) -> str:
        """How logs and messages name this worker: by its rank, once it has one."""
        return f"worker {self.rank}" if self.rank >= 0 else "a worker with no rank yet"

    @property
    def version(self) -> int:
        """The version of the weights in the model now (the oldest shard's, when sharded)."""
        return min(link.version for link in self.links)

    @property
    def steps(self) -> int:
        """Local steps computed."""
        return self._local_steps.count

    def request_stop(self, why: str) -> None:
        """Leave the run now (a signal: see run.signals): `run()` tells every coordinator
        shard why, lets go of its shared memory and raises CancelledError. The coordinator
        goes on without this worker, as for any worker that leaves."""
        if self._running is not None and not self._running.done() and self.stopped_by is None:
            self.stopped_by = why
            self._running.cancel()

    async def run(self) -> WorkerReport:
        self._running = asyncio.current_task()
        self._compute_thread = self._new_compute_thread(f"tensorbus-compute-{self.rank}")
        for link in self.links:
            link.open()
        try:
            await self._sessions.run()
        except Stopped:
            # Every worker ends holding the final model (as every rank of DDP does).
            changed = self._local_steps.optimizer is not None  # local steps since the last load
            self._in_place.leave_set(keep=True)  # off the coordinator's set: copied in below
            self._in_place.bind(self._in_place.own)  # loaded below in place: off the shard's sets first
            await asyncio.gather(*(link.versions.load_final(changed=changed) for link in self.links))
            await self._leave("stopped", "")
            for link in self.links:
                if link.failure is not None:
                    raise RunFailedError(f"the {link.peer} ended the run with an error: "
                                         f"{link.failure}") from None
        except asyncio.CancelledError:
            await self._leave("interrupted", self.stopped_by or "")
            raise
        except ScriptEnded:
            await self._leave("done", "")  # (a script's own loop ended: nodes.own_loop)
        except Exception as e:
            await self._leave("error", str(e))
            raise
        finally:
            self._compute_thread.shutdown()
            self._in_place.off_set()
            for link in self.links:
                await link.close()
            self._push_memory.close()
        return WorkerReport(self.rank, self.clock, self.last_loss, self.version, self.rejoins,
                            by_reference=sum(link.by_reference for link in self.links),
                            torn=sum(link.torn for link in self.links),
                            redone=self._in_place.redone)

    def end_session(self, why: Exception) -> None:
        """End the session under way (called by a link: see nodes.link.Owner)."""
        self._sessions.end(why)

    def enter(self, phase: Phase) -> None:
        """Move to `phase`, which heartbeats and logs report."""
        log.debug("worker %d: %s -> %s", self.rank, self.phase.value, phase.value)
        self.phase = phase

    def _off_loop(self, work: Callable[..., _T], *args: Any) -> asyncio.Future[_T]:
        """`work(*args)` on the compute thread, so that heartbeats go on meanwhile. (Not the
        loop's default executor: closing the loop waits for its threads, with no deadline.)"""
        return working(asyncio.wrap_future(self._compute_thread.submit(work, *args)))

    def lrs_of(self, current: int) -> str:  # noqa: ARG002 - a script's worker's (nodes.own_loop)
        """What the push of gradient set `current` says of the learning rates: nothing
        (the coordinator's own); a script's, those its step ran with."""
        return ""

    def _before_join(self) -> None:
        """The Welcome's weights are loaded in place, into the model's own buffers (see
        nodes.colocated_sets); what it computed on stays the model's if no Welcome comes."""
        self._in_place.sharing = False
        self._in_place.off_set()
        self._in_place.bind(self._in_place.own)

    async def _train(self, welcome: Welcome) -> None:
        """One session's training: its terms from the Welcome, then its rhythm's loop."""
        self._model.train()  # dropout on, BatchNorm's statistics moving: whatever it was given
        if not self._data.current(self.rank, welcome):
            # Go on where the coordinator's records say this rank's data had got to: a
            # fresh process, a rejoin on another shard, or a coordinator restarted from a
            # checkpoint (whose records are behind us: the data rewinds with the weights).
            self.enter(Phase.LOADING)
            self._local_steps.again = None
            await self._data.load(self.rank, welcome, self._off_loop)
        weights_pushed = PushKind(welcome.push) is PushKind.WEIGHTS
        # A worker that steps its own weights may not compute on the shard's sets.
        self._in_place.sharing = self._in_place.colocated_sets is not None and not weights_pushed
        await self._local_steps.configure(welcome, self.rank, weights_pushed=weights_pushed,
                                          off_loop=self._off_loop)
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
            self._push_memory.gradients, self.flat, self.rank, dense=compression.dtype is None))
                 if not weights_pushed and compression.topk is None
                 and any(link.shared for link in self.links) else None)
        await self._before_ready(welcome)
        # Answered when the coordinators' start gates open: everyone starts together.
        await asyncio.gather(*(
            link.request(Ready(sender=self.rank, version=link.version,
                               batches=self._data.length, unused=self._data.unused), patient=True)
            for link in self.links))
        await self._loop(welcome, compression, weights_pushed, refer)

    async def _loop(self, welcome: Welcome, compression: Compression, weights_pushed: bool,
                    refer: Callable[[torch.Tensor], Ref | None] | None) -> None:
        """The session's training loop, in the rhythm its Welcome asks for."""
        if Wait(welcome.wait) is Wait.OVERLAPPED:  # streaming averaging: its own pushes
            if len(self.links) > 1:
                raise ComputeError(f"worker {self.rank}: streaming averaging (--fragments) "
                                   "needs one coordinator, not shards")
            fragments = Fragments(self.flat, self.links[0].versions.fragments,
                                  bits=compression.bits, mix=welcome.mix)
            self._local_steps.outbox = None
            await StreamingLoop(self, local_steps=welcome.local_steps, fragments=fragments,
                                thread=self._compute_thread, steps=self._local_steps,
                                data=self._data, clock=self._clock).run()
            return
        # Async holds nobody back: the next gradient is computed, into the other set of
        # buffers, while this one is on the wire (its answers are taken meanwhile).
        pipelined = Wait(welcome.wait) is Wait.NOTHING and not weights_pushed
        if pipelined:
            self.flat.use_grad_sets(2)
        # Each shard's part is pushed as soon as backward has finished it, overlapping the
        # rest of backward, where what is pushed is one backward's gradient.
        early = not weights_pushed and welcome.local_steps == 1
        # One coordinator on this host, whose versions come by reference: the model
        # computes on each where the coordinator made it, not on a copy (InPlace.follow_set).
        self._in_place.follows_sets = (
            self._COMPUTES_ON_SETS and early and len(self.links) == 1 and self.links[0].shared
            and self._in_place.colocated_sets is None and self.device.type == "cpu"
            and compression.topk is None)
        # What goes on the wire, per gradient set and shard, filled as backward finishes
        # each range: gradients as they are, narrowed or top-k (--compress), or weights.
        outbox = self._push_memory.outbox(self.flat, self._shards, compression, self.rank,
                                          weights=weights_pushed, shared=refer is not None)
        self._local_steps.outbox = outbox
        terms = Terms(wait=Wait(welcome.wait), local_steps=welcome.local_steps,
                      weights_pushed=weights_pushed, early=early, refer=refer)
        loop = TrainingLoop(self, terms, outbox.parts, compute=self._compute,
                            thread=self._compute_thread, steps=self._local_steps,
                            data=self._data, in_place=self._in_place, clock=self._clock)
        await (loop.pipelined() if pipelined else loop.push_then_wait())

    def _compute(
        self, latest: list[PendingVersion | None], local_steps: int, current: int,
        announce: Callable[[int], None] | None, loaded: Callable[[], object] | None = None,
    ) -> tuple[float, int]:
        """On the compute thread: load the newest weights each link has, then compute
        `local_steps` steps into gradient set `current` (LocalSteps.compute). Touches only
        the model. Returns the mean loss and the samples seen."""
        if self._in_place.sharing:
            self._in_place.follow_colocated_sets(latest)
        for i, link in enumerate(self.links):
            weights, latest[i] = latest[i], None  # hold no frames once loaded (see below)
            if weights is not None:
                link.versions.load(weights)
            del weights
        if loaded is not None:
            loaded()  # the links let go of the frames too: their senders may reuse them
        return self._local_steps.compute(local_steps, current, announce, self._in_place.on_set)

    async def _leave(self, reason: str, detail: str) -> None:
        """Say goodbye to every coordinator shard, briefly: they may already be gone."""
        self.enter(Phase.LEAVING)
        await asyncio.gather(*(link.leave(reason, detail) for link in self.links))
