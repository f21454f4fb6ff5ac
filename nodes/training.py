"""A worker's training rhythm for one session: compute, push, and wait as the strategy asks.

One loop per rhythm the Welcome can ask for, with no branch on the strategy's name:

- `push_then_wait`: compute `local_steps` steps, push the gradient or the weights, take
  the answers (which the coordinator may hold back: the start gate, ssp's bound), then
  wait for a newer version where the strategy's Wait asks, or go on with the newest seen.
- `pipelined` (async, gradients): nobody is held back, so the next gradient is computed,
  into the other gradient set, while the last push is on the wire; its answers are taken
  meanwhile.

Both begin a step alike (`_begin`): the buffers about to be written off the wire, the
newest weights loaded, the compute started on the compute thread, and each shard's part
pushed as soon as backward has finished it, or once the compute is over.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import resource
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tensorbus.bus.buffers import Tracker, wait_sent
from tensorbus.bus.clock import Clock
from tensorbus.bus.messages import Ack, Message, Phase, Push
from tensorbus.bus.shared import Ref
from tensorbus.nodes.compute import ComputeThread, announce, cancelling, finishing, in_thread
from tensorbus.nodes.epochs import RankData
from tensorbus.nodes.in_place import InPlace
from tensorbus.nodes.link import Link
from tensorbus.nodes.local_steps import LocalSteps, Rewritten
from tensorbus.nodes.version_chain import PendingVersion
from tensorbus.strategies.base import Wait

if TYPE_CHECKING:
    from tensorbus.nodes.worker import Worker

log = logging.getLogger("tensorbus.worker")
# The compute thread's work for one step: load the newest weights, then compute (see
# Worker._compute): (latest, local_steps, current, announce, loaded) -> (loss, samples).
Compute = Callable[[list[PendingVersion | None], int, int, Callable[[int], None] | None,
                    Callable[[], object] | None], tuple[float, int]]
Answers = list[tuple[Message, Tracker | None]]


def peak_bytes() -> int:
    """This process's peak resident memory so far, in bytes (what its pushes report)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # (Linux says KiB)


@dataclass(frozen=True, kw_only=True)
class Terms:
    """A session's rhythm, from its Welcome."""

    wait: Wait
    local_steps: int
    weights_pushed: bool  # its own optimizer steps them (average); else gradients go
    early: bool  # each shard's part goes as soon as backward has finished it
    # Where pushes by reference lie in shared memory (PushMemory.gradients), if they do.
    refer: Callable[[torch.Tensor], Ref | None] | None


@dataclass(slots=True)  # (not frozen: one is made a step, and frozen ones init slower)
class _Step:
    """A step under way: its compute on the thread, and what its pushes say."""

    compute: asyncio.Future[tuple[float, int]]
    ended: asyncio.Future[None]  # done once the compute thread can touch nothing more
    computed_on: list[int]  # each shard's version it computes on
    ready: list[asyncio.Future[None]]  # each shard's part made ready to send
    clock: int  # what its push counts
    steps: int  # the local steps it computes
    began: float  # wall clock
    started: float  # monotonic
    current: int  # the gradient set it computes into


@dataclass
class _InFlight:
    """A push on the wire whose answers are taken during the next compute (pipelined)."""

    answers: asyncio.Future[Answers]
    computed_on: list[int]
    current: int  # the gradient set it was sent from


class TrainingLoop:
    """One session's training: `push_then_wait` or `pipelined`, as its Terms ask."""

    def __init__(self, worker: Worker, terms: Terms, parts: list[list[tuple[torch.Tensor, ...]]], *,
                 compute: Compute, thread: ComputeThread, steps: LocalSteps, data: RankData,
                 in_place: InPlace, clock: Clock) -> None:
        """`parts`: what goes on the wire, per gradient set and shard (Outbox.parts)."""
        self._worker = worker
        self._links = worker.links
        self._terms = terms
        self._parts = parts
        self._compute = compute
        self._thread = thread
        self._steps = steps
        self._data = data
        self._in_place = in_place
        self._clock = clock
        self._sent: list[list[Tracker | None]] = [[] for _ in parts]  # each set's last sends
        # Local steps a compute: the Welcome's, or what the answer to the last push said
        # (async-average's dynamic local steps).
        self._local_steps = terms.local_steps
        # Where time goes between computes, reported with the next push (telemetry).
        self._comm_s = self._wait_s = 0.0

    async def push_then_wait(self) -> None:
        """Compute, push, take the answers, wait as the strategy asks; again."""
        while True:
            started = self._clock.monotonic()
            current = 0 if self._terms.weights_pushed else self._worker.flat.current
            await self._off_the_wire(current, started)
            step = await self._begin(current)
            async with finishing(step.ended, self._leaving):
                pushes = self._push(step, current)
                async with cancelling(pushes):
                    computed = await self._computed(step, pushes)
                    if computed is None:
                        continue
                    answers = await pushes
            await self._wait(answers, step.computed_on, current, computed)

    async def pipelined(self) -> None:
        """Compute into one gradient set while the other's push is on the wire."""
        flat = self._worker.flat
        previous: _InFlight | None = None  # the last push, not yet answered
        while True:
            started = self._clock.monotonic()
            flat.swap()
            current = flat.current
            await self._off_the_wire(current, started)
            step = await self._begin(current)
            async with finishing(step.ended, self._leaving):
                if previous is not None:
                    # The last push's answers, taken while this gradient is computed.
                    answers = await previous.answers
                    self._sent[previous.current] = [tracker for _, tracker in answers]
                    waits = self._waits([a for a, _ in answers], previous.computed_on)
                    await asyncio.gather(*(link.versions.await_version(newer_than=v) for link, v in waits))
                    previous = None
                pushes = self._push(step, current)
                async with cancelling(pushes):
                    if await self._computed(step, pushes) is None:
                        continue
                    previous = _InFlight(pushes, step.computed_on, current)
                    self._comm_s = self._wait_s = 0.0

    def _leaving(self) -> bool:
        return self._worker.stopped_by is not None

    async def _off_the_wire(self, current: int, started: float) -> None:
        """The buffers about to be written must be off the wire."""
        for tracker in self._sent[current]:
            await wait_sent(tracker, timeout=self._links[0].timeout_s, what="the last update")
        self._comm_s += self._clock.monotonic() - started

    async def _begin(self, current: int) -> _Step:
        """Load the newest weights and start computing into gradient set `current`.

        Weights broadcast by reference are computed on where they lie, or loaded here, on
        the loop, which can pull them again if the copy was torn (Link.load_shared); the
        newest weights each link has besides are loaded by the compute thread, first."""
        worker, links, terms = self._worker, self._links, self._terms
        worker.enter(Phase.COMPUTING)
        began, started = self._clock.wall(), self._clock.monotonic()
        if self._in_place.follows_sets:
            self._in_place.follow_set()
        while any(link.versions.shared_pending() for link in links):  # (a pull lets more in)
            for link in links:
                await link.versions.load_shared()
        latest = [link.versions.latest() for link in links]
        computed_on = [w.version if w is not None else link.version
                       for link, w in zip(links, latest, strict=True)]
        loop = asyncio.get_running_loop()
        ready = [loop.create_future() for _ in links]
        clock = worker.clock  # what this push counts (the clock moves on once it is sent)
        steps = self._local_steps
        if delay := worker.config.faults.delay(steps):
            # A straggler on purpose (nodes.faults): on the weights it holds now, and on
            # the coordinator's set where it computes in place.
            await asyncio.sleep(delay)
        compute, ended = in_thread(loop, self._thread, functools.partial(
            self._compute, latest, steps, current,
            functools.partial(announce, loop, ready) if terms.early else None,
            functools.partial(loop.call_soon_threadsafe, self._in_place.forget_loaded)))
        return _Step(compute, ended, computed_on, ready, clock, steps, began, started, current)

    def _push(self, step: _Step, current: int) -> asyncio.Future[Answers]:
        """Each shard's part of gradient set `current`, pushed once ready, all at once."""
        refer = self._terms.refer
        return asyncio.ensure_future(asyncio.gather(*(
            self._push_when_ready(link, i, step, self._parts[current][i], self._comm_s,
                                  self._wait_s, refer if link.shared else None)
            for i, link in enumerate(self._links))))

    async def _computed(self, step: _Step, pushes: asyncio.Future[Answers]) -> float | None:
        """The step's compute, awaited: when it ended, or None where it was computed on a
        coordinator's set written meanwhile, and is to be done again."""
        worker = self._worker
        try:
            worker.last_loss = (await step.compute)[0]
        except Rewritten:
            # Nothing was pushed (its part was not made ready): the same batch again, on
            # the newest version, copied in (InPlace.redo).
            pushes.cancel()
            await asyncio.gather(pushes, return_exceptions=True)
            self._in_place.redo(worker.rank)
            return None
        self._in_place.computed()
        computed = self._clock.monotonic()
        worker.clock += 1  # counted once sent: heartbeats from now on include it
        worker.enter(Phase.PUSHING)
        return computed

    async def _wait(self, answers: Answers, computed_on: list[int], current: int,
                    computed: float) -> None:
        """Take the answers to a push, then wait for what the strategy asks."""
        answered = self._clock.monotonic()
        self._sent[current] = [tracker for _, tracker in answers]
        acks = [ack for ack, _ in answers]
        told = [a.local_steps for a in acks if isinstance(a, Ack) and a.local_steps > 0]
        if told:
            self._local_steps = told[0]
        # Held back by the strategy (ssp's bound) for as long as the longest-holding shard.
        # (Pushes that left during backward overlapped it: only what is left counts.)
        held_s = min(max(max(a.held_s, 0.0) if isinstance(a, Ack) else 0.0 for a in acks),
                     answered - computed)
        self._comm_s, self._wait_s = answered - computed - held_s, held_s
        waits = self._waits(acks, computed_on)
        if waits:
            self._worker.enter(Phase.WAITING)
            await asyncio.gather(*(link.versions.await_version(newer_than=v) for link, v in waits))
        self._wait_s += self._clock.monotonic() - answered

    async def _push_when_ready(
        self, link: Link, i: int, step: _Step, part: tuple[torch.Tensor, ...], comm_s: float,
        wait_s: float, refer: Callable[[torch.Tensor], Ref | None] | None,
    ) -> tuple[Message, Tracker | None]:
        """Send shard i its part once backward has finished it (or the compute is over)
        and return its answer. The answer may be held back by the strategy (ssp's bound):
        it is awaited while the coordinator is alive, not against a fixed deadline."""
        compute = step.compute
        either: set[asyncio.Future[Any]] = {step.ready[i], compute}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if compute.done():
            loss, samples = compute.result()
        else:
            loss, samples = self._steps.last_forward
        scale = self._steps.scale
        push = Push(sender=self._worker.rank, version=step.computed_on[i], clock=step.clock,
                    loss=loss, samples=samples, tensors=part, began=step.began,
                    compute_s=self._clock.monotonic() - step.started, comm_s=comm_s,
                    wait_s=wait_s, batches=self._data.length,
                    overflows=scale.skipped if scale is not None else 0,
                    lrs=self._worker.lrs_of(step.current), steps=step.steps,
                    state=link.model_buffers.copy() if link.model_buffers is not None else (),
                    peak_bytes=peak_bytes(), busy_s=self._steps.busy_s,
                    span_s=self._steps.span_s, held=self._steps.held)
        return await link.request_tracked(push, patient=True, refer=refer)

    def _waits(self, acks: list[Message], computed_on: list[int]) -> list[tuple[Link, int]]:
        """What to wait for, shard by shard, once pushes are answered: the strategy's rhythm
        (see strategies.base.Wait); an update dropped as late waits for the version it
        missed, then computes again (it does not count for its version)."""
        wait = self._terms.wait
        waits: list[tuple[Link, int]] = []
        for link, ack, version in zip(self._links, acks, computed_on, strict=True):
            if isinstance(ack, Ack) and ack.dropped:
                log.info("worker %d: update on version %d dropped by the %s (%s)",
                         self._worker.rank, version, link.peer, ack.dropped)
                if ack.version > version:
                    # Late: catch up first (pulling, if the broadcast was missed), or this
                    # worker would compute on the old version again, and again.
                    waits.append((link, ack.version - 1))
            elif wait is Wait.NEWER:
                waits.append((link, version))
            elif wait is Wait.ANSWERED and ack.version > link.versions.newest():
                waits.append((link, ack.version - 1))
        return waits
