"""A worker's rhythm under streaming averaging: one fragment of the model on the wire at a
time, while the next local steps are computed (Douillard et al. 2025, "Streaming DiLoCo").

The Welcome asks for it with Wait.OVERLAPPED, `local_steps` H/P and `fragments` P. Each
cycle:

1. compute H/P local steps on the compute thread, while the last push travels and the
   coordinator makes the version it averages (one fragment of the model: a Fragment);
2. take the answer to that push, then that version (waiting for it only if it has not
   come yet: the only wait on the other workers), loaded into the newest version's
   weights (nodes.fragments), and mix its fragment into the model;
3. push the fragment of the newest version, v mod P (strategies.base.Rhythm.fragment):
   its change, or its weights (nodes.fragments.Fragments.fill), and go back to 1 without
   waiting for the answer.

So a fragment's average is mixed in H/P local steps after it was pushed, whenever it
came: the same point every time, which keeps a run's result independent of timing (the
paper's overlap, tau, at its largest). A push the coordinator did not take (its version
was made without it, or it was not finite) is followed by a restart from the newest
version, as a worker that joins does.

The loop owns its links' version chain for the session: versions are loaded into the
newest version's weights, not into the model, and the chain is given back to the model as
the session ends (for the final weights, or the next Welcome).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from tensorbus.bus.buffers import Tracker, wait_sent
from tensorbus.bus.clock import Clock
from tensorbus.bus.messages import Ack, Message, Phase, Push
from tensorbus.nodes.compute import ComputeThread, finishing, in_thread
from tensorbus.nodes.epochs import RankData
from tensorbus.nodes.fragments import Fragments, changed_between
from tensorbus.nodes.link import Link
from tensorbus.nodes.local_steps import LocalSteps

if TYPE_CHECKING:
    from tensorbus.nodes.worker import Worker

log = logging.getLogger("tensorbus.worker")
_T = TypeVar("_T")


@dataclass
class _InFlight:
    """A push on the wire, answered during the next compute."""

    answer: asyncio.Future[tuple[Message, Tracker | None]]
    version: int  # the version its change was measured from
    fragment: int


class StreamingLoop:
    def __init__(self, worker: Worker, *, local_steps: int, fragments: Fragments,
                 thread: ComputeThread, steps: LocalSteps, data: RankData, clock: Clock) -> None:
        self._worker = worker
        self._local_steps = local_steps
        self._fragments = fragments
        self._thread = thread
        self._steps = steps
        self._data = data
        self._clock = clock
        self._sent: list[Tracker | None] = [None] * len(fragments.fragments)  # each part's last send
        self._comm_s = self._wait_s = 0.0  # since the last compute ended, for the next push

    async def run(self) -> None:
        """Train until the session ends; the version chain holds the model again after."""
        worker = self._worker
        (link,) = worker.links
        link.versions.rebind(self._fragments.newest)
        try:
            await self._cycles(link)
        finally:
            link.versions.rebind(worker.flat.weights)

    async def _cycles(self, link: Link) -> None:
        worker = self._worker
        in_flight: _InFlight | None = None
        try:
            while True:
                worker.enter(Phase.COMPUTING)
                began, started = self._clock.wall(), self._clock.monotonic()
                clock = worker.clock  # what the push counts
                if delay := worker.config.faults.delay(self._local_steps):
                    await asyncio.sleep(delay)  # a straggler on purpose (nodes.faults)
                loss, samples = await self._on_thread(functools.partial(
                    self._steps.compute, self._local_steps, 0, None, None))
                worker.last_loss = loss
                computed = self._clock.monotonic()
                worker.enter(Phase.PUSHING)
                if in_flight is not None:
                    await self._take(link, in_flight)
                    in_flight = None
                version = link.versions.version
                fragment = version % len(self._fragments.fragments)  # (Rhythm.fragment)
                await wait_sent(self._sent[fragment], timeout=link.timeout_s,
                                what="the last push of the fragment")
                await self._on_thread(functools.partial(self._fragments.fill, fragment))
                push = Push(sender=worker.rank, version=version, clock=clock, loss=loss,
                            samples=samples, tensors=self._fragments.parts[fragment],
                            fragment=fragment, steps=self._local_steps, began=began,
                            compute_s=computed - started,
                            comm_s=self._comm_s, wait_s=self._wait_s, batches=self._data.length,
                            overflows=self._steps.scale.skipped if self._steps.scale else 0,
                            state=link.model_buffers.copy() if link.model_buffers is not None else ())
                worker.clock += 1
                in_flight = _InFlight(asyncio.ensure_future(
                    link.request_tracked(push, patient=True)), version, fragment)
                self._comm_s = self._wait_s = 0.0
        finally:
            if in_flight is not None:
                in_flight.answer.cancel()
                await asyncio.gather(in_flight.answer, return_exceptions=True)

    async def _take(self, link: Link, pushed: _InFlight) -> None:
        """The answer to the last push, then the version it made (or, where the push was
        not taken, the newest), loaded and mixed into the model."""
        versions = link.versions
        answering = self._clock.monotonic()
        answer, self._sent[pushed.fragment] = await pushed.answer
        waiting = self._clock.monotonic()
        self._comm_s = waiting - answering
        if isinstance(answer, Ack) and answer.dropped:
            log.info("worker %d: fragment %d's push on version %d dropped by the %s (%s): "
                     "going on from the newest version", self._worker.rank, pushed.fragment,
                     pushed.version, link.peer, answer.dropped)
            if answer.version > pushed.version:  # made without it: catch up first
                await versions.await_version(newer_than=answer.version - 1)
            await self._load(link, restart=True)
        else:
            if versions.newest() <= pushed.version:
                self._worker.enter(Phase.WAITING)
                await versions.await_version(newer_than=pushed.version)
            await self._load(link, restart=False)
        self._wait_s = self._clock.monotonic() - waiting

    async def _load(self, link: Link, *, restart: bool) -> None:
        """Load the newest version the link has into the newest weights, on the compute
        thread, then mix the fragments it changed into the model (or, with `restart`,
        take it whole)."""
        versions = link.versions
        before = versions.version
        await versions.load_shared()  # (whole weights by reference, if any: on the loop)
        pending, fragments = versions.latest(), self._fragments

        def load() -> None:
            if pending is not None:
                versions.load(pending)
            if restart:
                fragments.restart()
            else:
                fragments.mix_in(changed_between(before, versions.version,
                                                 len(fragments.fragments)))

        await self._on_thread(load)
        versions.forget_loaded()

    async def _on_thread(self, work: Callable[[], _T]) -> _T:
        """`work` on the compute thread; if this is cancelled, the thread is waited for
        before anything else touches the model (nodes.compute.finishing)."""
        job, ended = in_thread(asyncio.get_running_loop(), self._thread, work)
        async with finishing(ended, lambda: self._worker.stopped_by is not None):
            return await job
