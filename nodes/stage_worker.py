"""A worker of one pipeline stage: its stage's parameters, and the stages beside it.

Under `--pipeline P` the model is cut into P stages (nodes.stages), and each stage has a
coordinator of its own, which serves that stage's parameters under the run's strategy to
the same stage of every pipeline: to the coordinator of stage s, the workers of stage s
are its ranks, one a pipeline. A `StageWorker` is a `Worker` (nodes.worker) of one stage:
it joins its stage's coordinator as the rank of its pipeline, follows its versions, pushes
its stage's gradient (or weights, under average) and keeps its rhythm, as any worker does.
What differs:

- its model is its stage alone (nodes.stages.build_stage), and its step is its stage's
  part of a batch's pass through the pipeline (nodes.stage_steps);
- it binds an inbox and names it, and its stage, in its Join; before it says it is ready,
  it asks its coordinator where the stages beside it listen (Peers, until both have
  joined) and links to them (nodes.neighbours);
- a session that ends (a stop, a removal, a lost coordinator) interrupts a wait on a
  neighbour at once.

A neighbour that goes silent ends this worker's run with `NeighbourLost`: its pipeline
cannot go on, and its launcher (run.pipelines) stops the whole pipeline.
"""

from __future__ import annotations

import asyncio
from typing import Any

from tensorbus.bus.clock import SYSTEM_CLOCK, Clock
from tensorbus.bus.errors import PeerTimeoutError, RejectedError
from tensorbus.bus.messages import Peers, RejectCode, Welcome
from tensorbus.bus.transport import Hub
from tensorbus.nodes.local_steps import LocalSteps
from tensorbus.nodes.neighbours import NEXT, PREVIOUS, Neighbours
from tensorbus.nodes.stage_steps import StageSteps
from tensorbus.nodes.worker import Worker

_ASK_AGAIN_S = (0.05, 0.5)  # the first and the longest pause between Peers requests


class StageWorker(Worker):
    # It computes its stage's part of a batch with its neighbours, on its own weights: not
    # on a coordinator's set in place (nodes.in_place), whose redo would be the pipeline's.
    _COMPUTES_ON_SETS = False

    def __init__(self, *, stage: int, stages: int, host: str = "127.0.0.1",
                 clock: Clock = SYSTEM_CLOCK, **worker: Any) -> None:
        """Stage `stage` (from 0) of `stages`, whose module is `model`; `host`: where its
        inbox listens (the neighbours must reach it there); the rest as for a Worker."""
        # One ZeroMQ context for its links, to its coordinator and to its neighbours: one
        # I/O thread, not one a socket.
        given = worker.pop("hub", None)
        self._own_hub = given is None  # (closed here once its sockets are; a given one is not)
        self._hub: Hub = given if given is not None else Hub()
        self._neighbours = Neighbours(stage=stage, stages=stages, host=host, clock=clock,
                                      micro_batches=lambda: self._steps.micro_batches,
                                      hub=self._hub)
        super().__init__(clock=clock, hub=self._hub, **worker)
        if len(self.links) != 1:
            raise ValueError("a pipeline stage's worker has one coordinator, its stage's: give "
                             "one endpoint")
        self.links[0].stage, self.links[0].stages = stage, stages
        self._neighbours.pipeline = self.config.rank

    @property
    def _steps(self) -> StageSteps:
        steps = self._local_steps
        assert isinstance(steps, StageSteps)
        return steps

    @property
    def stage(self) -> int:
        return self._neighbours.stage

    @property
    def name(self) -> str:
        return (f"stage {self.stage} of pipeline {self.rank}" if self.rank >= 0
                else f"a worker of stage {self.stage} with no pipeline yet")

    def _new_steps(self, **parts: Any) -> LocalSteps:
        return StageSteps(neighbours=self._neighbours, clock=self._clock,
                          version=lambda: self.version, **parts)

    async def run(self) -> Any:
        self.links[0].inbox = self._neighbours.bind()
        tasks = [asyncio.create_task(self._neighbours.receive()),
                 asyncio.create_task(self._neighbours.heartbeats())]
        try:
            return await super().run()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._neighbours.close()
            if self._own_hub:  # (after every socket on it: the links closed in Worker.run)
                self._hub.close()

    async def _train(self, welcome: Welcome) -> None:
        self._neighbours.pipeline = self.rank
        self._neighbours.mailbox.resume()
        self._steps.micro_batches = welcome.micro_batches  # (what neighbours' messages are checked by)
        await super()._train(welcome)

    async def _before_ready(self, welcome: Welcome) -> None:
        endpoints = await self._find_neighbours()
        self._neighbours.connect(endpoints, heartbeat_s=welcome.heartbeat_s,
                                 timeout_s=welcome.timeout_s)

    async def _find_neighbours(self) -> dict[int, str]:
        """The inboxes of the stages beside this one in its pipeline, asked of the
        coordinator until each has joined, for at most the join timeout."""
        link = self.links[0]
        waited_until = self._clock.monotonic() + self.config.join_timeout_s
        pause = _ASK_AGAIN_S[0]
        while True:
            answer = await link.request(Peers(sender=self.rank, version=link.version))
            if not isinstance(answer, Peers):
                raise RejectedError(RejectCode.UNEXPECTED.value,
                                    f"Peers answered by {answer.KIND.name}")
            found = {PREVIOUS: answer.previous, NEXT: answer.next}
            wanted = {offset: found[offset] for offset in self._neighbours.offsets}
            if all(wanted.values()):
                return wanted
            if self._clock.monotonic() > waited_until:
                missing = " and ".join(f"stage {self.stage + o}" for o, e in wanted.items() if not e)
                raise PeerTimeoutError(link.peer, f"where {missing} of pipeline {self.rank} "
                                       "listen (have they joined?)", self.config.join_timeout_s)
            await asyncio.sleep(pause)
            pause = min(2 * pause, _ASK_AGAIN_S[1])

    def end_session(self, why: Exception) -> None:
        self._neighbours.mailbox.interrupt(why)  # (a wait on a neighbour ends with the session)
        super().end_session(why)

    def request_stop(self, why: str) -> None:
        self._neighbours.mailbox.interrupt(asyncio.CancelledError(why))
        super().request_stop(why)
