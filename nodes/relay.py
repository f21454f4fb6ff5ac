"""A relay: a coordinator to its local workers and a worker to an upstream coordinator.

Hierarchical aggregation (as BytePS and PyTorch's HierarchicalModelAverager do): workers on
one machine (or rack) push to a relay next to them; the relay reduces their updates with
its own strategy (sync, or periodic averaging) and sends one mean across the slow link to
the root, as one worker of it; the root's new weights come back and the relay publishes
them to its workers as its next version. The root sees one worker per relay, so the bytes
crossing the slow link per step are one model per relay, whatever its number of workers.

With every relay serving the same number of workers, a sync tree steps on the mean of
every worker's gradient, as a flat sync run does (up to float summation order); periodic
averaging likewise averages every worker's weights.

Ranks: the root gives the relay rank r of its W; a relay of L workers gives them ranks
r*L .. r*L+L-1 and tells them there are W*L data shards, so that each worker of the tree
reads its own shard, as in the flat run. The root's batch size is the workers' batch size.
The run ends when the root stops: the relay then stops its workers and returns its summary.
A relay needs the root to count --steps (a relay does not know its workers' data sizes when
it says Ready upstream, so the root cannot turn --epochs into samples).

A relay holds a Coordinator for its workers and gives it its next versions (nodes.next_version:
`_send_up`), using only the coordinator's public calls; to its root it is a worker, the owner
of an upstream Link.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from torch import nn

from tensorbus.bus.buffers import Tracker, wait_sent
from tensorbus.bus.clock import SYSTEM_CLOCK, Clock
from tensorbus.bus.errors import RejectedError
from tensorbus.bus.messages import Ack, Phase, Push, Ready, RejectCode
from tensorbus.bus.pieces import Received
from tensorbus.bus.security import ClientKeys
from tensorbus.nodes.config import CoordinatorConfig
from tensorbus.nodes.coordinator import Coordinator, Progress
from tensorbus.nodes.link import Link, Stopped
from tensorbus.nodes.liveness import Moved
from tensorbus.nodes.next_version import NoNextVersion
from tensorbus.nodes.optimizers import OptimizerFactory
from tensorbus.strategies.base import PushKind, Strategy, Wait

log = logging.getLogger("tensorbus.relay")


class Relay:
    """Serve local workers with `strategy` and forward each of its updates to `upstream`.

    `config` is the local side's (bind, heartbeats, timeouts, ...); its steps, epochs and
    batch size are set by the root. The model only lays out the tensors: the root's
    weights replace its initial ones when the relay joins.
    """

    def __init__(
        self,
        *,
        model: nn.Module,
        strategy: Strategy,
        config: CoordinatorConfig,
        upstream: str,
        keys: ClientKeys | None = None,
        request_timeout_s: float = 10.0,
        optimizer: OptimizerFactory | None = None,
        on_step: Callable[[Progress], None] | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if config.checkpoint_dir is not None or config.eval_every_s is not None:
            raise ValueError("a relay holds no state of its own to checkpoint or evaluate: the "
                             "root does; give those options to the root")
        # Until the root stops: the root counts versions (see the module's docstring).
        config = replace(config, steps=sys.maxsize, epochs=None)
        self.coordinator = Coordinator(model=model, strategy=strategy, config=config,
                                       optimizer=optimizer, on_step=on_step, clock=clock,
                                       next_version=self._send_up)
        self._clock = clock
        self.rank = -1  # upstream
        self.phase = Phase.JOINING  # upstream, as a worker of the root
        self.clock = 0
        # The root's buffers are loaded into our model's, and published to our workers as
        # they are; our workers' combination goes to the root with our updates.
        flat = self.coordinator.flat
        self._upstream = Link(upstream, flat.layout.shard(0, 1), flat.weights, self,
                              request_timeout_s=request_timeout_s, keys=keys,
                              model_buffers=flat.model_buffers or None)
        self._upstream_wait = Wait.NEWER
        self._ready: asyncio.Task[Any] | None = None
        self._sent: Tracker | None = None
        self._lost: asyncio.Future[Exception] | None = None

    def bind(self) -> str:
        """Bind the local sockets now (so that the endpoint is known); `run` binds if not done."""
        return self.coordinator.bind()

    def request_stop(self, why: str) -> None:
        """Stop gracefully (for SIGTERM or Ctrl-C): the local run stops; the root goes on."""
        self.coordinator.request_stop(why)

    async def run(self, *, before_evaluate: Any = None) -> dict[str, Any]:
        """Join the root, then serve the local workers until the root stops."""
        coordinator, link = self.coordinator, self._upstream
        link.open()
        self._lost = asyncio.get_running_loop().create_future()
        helpers: list[asyncio.Task[Any]] = []
        served = False
        try:
            welcome = await link.join(self.rank, coordinator.config.join_timeout_s, "join",
                                      any_rank=False)
            self.rank = welcome.rank
            if PushKind(welcome.push) is not coordinator.strategy.rhythm.push:
                raise RejectedError(RejectCode.UNEXPECTED.value, (
                    f"the root's workers push {welcome.push} and this relay's strategy "
                    f"({coordinator.strategy.name}) pushes "
                    f"{coordinator.strategy.rhythm.push.value}: give the relay sync under a "
                    "sync, ssp or async root, average under an average root"))
            if welcome.fragments:
                raise RejectedError(RejectCode.UNEXPECTED.value, (
                    "the root streams its averages in fragments (--fragments), and a relay "
                    "pushes the whole model: start the root without --fragments"))
            size = coordinator.config.max_workers or coordinator.strategy.workers
            coordinator.place(first_rank=self.rank * size, world_size=welcome.world_size * size,
                              batch_size=welcome.batch_size)
            self._upstream_wait = Wait(welcome.wait)
            log.info("relay joined the root as worker %d of %d at version %d; serving ranks "
                     "%d..%d", self.rank, welcome.world_size, link.version,
                     self.rank * size, self.rank * size + size - 1)
            helpers = [asyncio.create_task(c) for c in link.session()]
            helpers.append(asyncio.create_task(self._follow()))
            # Counted in at the root's start gate at once; the first forward waits for it.
            self._ready = asyncio.create_task(link.request(
                Ready(sender=self.rank, version=link.version, batches=-2), patient=True))
            self.phase = Phase.COMPUTING
            served = True  # run() closes the local sockets
            return await coordinator.run(before_evaluate=before_evaluate)
        finally:
            if not served:
                coordinator.close()
            for task in (*helpers, *([self._ready] if self._ready else [])):
                task.cancel()
            await asyncio.gather(*helpers, *([self._ready] if self._ready else []),
                                 return_exceptions=True)
            self.phase = Phase.LEAVING
            await link.leave("stopped", "")
            await link.close()

    def end_session(self, why: Exception) -> None:
        """The root is lost or has removed us (called by the upstream link). A root that
        stopped is seen by _follow, through the link's `stopped`."""
        if isinstance(why, Stopped):
            return
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(why)

    async def _follow(self) -> None:
        """Stop when the root stops or is lost, whether or not an update is on its way."""
        assert self._lost is not None
        while True:
            if self._lost.done():
                await self.coordinator.fail(f"relay {self.rank}: {self._lost.result()}")
                return
            if self._upstream.stopped:
                failure = self._root_failure()
                if failure is not None and not self.coordinator.stopping:
                    # The root's failure is the tree's: said to our workers, and raised.
                    await self.coordinator.fail(failure)
                else:
                    # (Its normal end, said as the end of an update in flight says it.)
                    self.coordinator.request_stop("the root stopped", quiet=True)
                return
            await asyncio.sleep(self._upstream.heartbeat_s)

    async def _send_up(
        self, updates: list[tuple[Received, ...]], scale: float, *, loss: float, samples: int,
        ranks: Sequence[int],
    ) -> None:
        """The coordinator's next version (nodes.next_version): the mean of the local
        updates goes to the root as one update; the root's next version (the one with it,
        where the root's strategy waits for it) comes back into the master's weights."""
        link, coordinator = self._upstream, self.coordinator
        try:
            if self._ready is not None:
                await self._ready
            await wait_sent(self._sent, timeout=link.timeout_s, what="the last update")
            link.versions.load_latest()
            await asyncio.to_thread(coordinator.master.mean, updates, scale)
            computed_on = link.version
            self.phase = Phase.PUSHING
            push = Push(sender=self.rank, version=computed_on, clock=self.clock, loss=loss,
                        samples=samples, tensors=coordinator.flat.grads, began=self._clock.wall(),
                        state=coordinator.combined_buffers())
            self.clock += 1
            ack, self._sent = await link.request_tracked(push, patient=True)
            self.phase = Phase.WAITING
            if isinstance(ack, Ack) and ack.dropped:
                log.info("relay %d: update on version %d dropped by the root (%s)",
                         self.rank, computed_on, ack.dropped)
                if ack.version > computed_on:
                    await link.versions.await_version(newer_than=ack.version - 1)
            elif self._upstream_wait is Wait.NEWER:
                await link.versions.await_version(newer_than=computed_on)
            elif ack.version > link.version:
                await link.versions.await_version(newer_than=ack.version - 1)
            link.versions.load_latest()  # into the master's weights: what the next publish sends
            self.phase = Phase.COMPUTING
        except Stopped:
            raise NoNextVersion("the root stopped", self._root_failure()) from None
        except Moved as e:  # (a root that stepped down: a relay does not follow its standby)
            raise NoNextVersion("the root moved", f"the root stepped down: {e}") from None

    def _root_failure(self) -> str | None:
        """Why the root's run failed, if it said so as it stopped."""
        failure = self._upstream.failure
        return f"the root ended the run with an error: {failure}" if failure is not None else None
