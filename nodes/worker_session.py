"""A worker's sessions: its memberships of the run, from a join to their end.

The first join may wait `join_timeout_s` (the coordinator may start later). A session
trains until the run stops, or until the coordinator is lost (PeerTimeoutError) or has
removed the worker (RejectedError unknown_worker), whichever the training or a link sees
first; the worker then joins again, within `reconnect_timeout_s` of when the coordinator
was last heard (it may be restarting from a checkpoint), asking for its old rank so that
its data shard stays its own. A lost coordinator that had a standby is not waited for: the
worker joins the standby, which takes the run over (nodes.replication); so does a worker
whose coordinator moved the run there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from tensorbus.bus.clock import Clock
from tensorbus.bus.errors import PeerTimeoutError, RejectedError
from tensorbus.bus.messages import RejectCode, Welcome
from tensorbus.nodes.liveness import Moved, Stopped

if TYPE_CHECKING:
    from tensorbus.nodes.worker import Worker

log = logging.getLogger("tensorbus.worker")


class WorkerSessions:
    def __init__(self, worker: Worker, *, train: Callable[[Welcome], Coroutine[Any, Any, None]],
                 before_join: Callable[[], None], clock: Clock) -> None:
        """`train`: one session's training, from its Welcome; `before_join`: what makes
        the model's own buffers hold its weights again, as each Welcome's are loaded there."""
        self._worker = worker
        self._train = train
        self._before_join = before_join
        self._clock = clock
        self._ended: asyncio.Future[Exception] | None = None  # set: this session is over

    async def run(self) -> None:
        """Join and train; when the coordinator is lost or has removed us, join again,
        giving up with what it waited for once the reconnect timeout has passed."""
        worker = self._worker
        welcome = await self._join(worker.config.join_timeout_s, "join")
        while True:
            to, back_to = "", ""  # where to join again ("": the same coordinator)
            try:
                await self._session(welcome)
                return
            except PeerTimeoutError as e:
                why = f"lost the coordinator ({e})"
                # One coordinator with a standby: it takes the run over (nodes.replication),
                # unless it hears its coordinator still (then back there: link.join).
                if len(worker.links) == 1 and worker.links[0].liveness.standby:
                    to, back_to = worker.links[0].liveness.standby, worker.links[0].endpoint
            except Moved as e:
                why, to = str(e), e.endpoint
            except RejectedError as e:
                if e.code != RejectCode.UNKNOWN_WORKER.value:
                    raise
                why = f"removed by the coordinator ({e.detail})"
            log.warning("worker %d %s at version %d, %s; joining again%s", worker.rank, why,
                        worker.version, worker.phase.value, f" at {to}" if to else "")
            worker.rejoins += 1
            if to:
                await worker.links[0].move_to(to, back_to=back_to)
            waited = self._clock.monotonic() - min(link.seen for link in worker.links)
            welcome = await self._join(max(worker.config.reconnect_timeout_s - waited, 1.0),
                                       f"rejoin (after: {why})")

    def end(self, why: Exception) -> None:
        """End the session under way (a link lost its coordinator, was removed, or the run
        stopped): `why` is raised from it."""
        if isinstance(why, Stopped) and not all(link.stopped for link in self._worker.links):
            return  # (a shard that stopped before the others: theirs are yet to come)
        if self._ended is not None and not self._ended.done():
            self._ended.set_result(why)

    async def _session(self, welcome: Welcome) -> None:
        """One membership: train until stopped, lost or removed."""
        self._ended = asyncio.get_running_loop().create_future()
        train = asyncio.create_task(self._train(welcome))
        helpers = [asyncio.create_task(c) for link in self._worker.links for c in link.session()]
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

    async def _join(self, within_s: float, what: str) -> Welcome:
        """Join every link: the first decides our rank (on a rejoin: our old one, so that
        our data shard stays ours; any, if another worker has it now), the other shards
        are asked for that rank. Returns the first shard's Welcome."""
        worker = self._worker
        self._before_join()
        first, *others = worker.links
        # A rank asked for by the user is theirs to fix if taken; a rank we had before, not.
        welcome = await first.join(worker.rank, within_s, what,
                                   any_rank=worker.rank != worker.config.rank)
        worker.rank = welcome.rank
        if others:
            welcomes = await asyncio.gather(*(
                link.join(worker.rank, within_s, what, any_rank=False) for link in others))
            for link, other in zip(others, welcomes, strict=True):
                _check_same_run(welcome, other, first.endpoint, link.endpoint)
        log.info("worker %d joined at version %d (%s)", worker.rank, worker.version, welcome.strategy)
        # Loaded by now: kept for the session without its frames, which may be the sender's
        # own memory (an in-process shard's snapshot, which it may not reuse while held).
        return replace(welcome, tensors=(), state=())


def _check_same_run(first: Welcome, other: Welcome, first_at: str, other_at: str) -> None:
    """Shards of one parameter server must run the same strategy on the same terms."""
    for name in ("rank", "world_size", "strategy", "push", "local_steps", "wait", "batch_size",
                 "compress"):
        a, b = getattr(first, name), getattr(other, name)
        if a != b:
            raise RejectedError(RejectCode.UNEXPECTED.value, (
                f"the coordinator shards disagree: {name} is {a!r} at {first_at} and {b!r} at "
                f"{other_at}: start every shard with the same options"))
