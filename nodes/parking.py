"""Requests whose answers a coordinator's strategy holds back: a Ready at the start gate,
a Push under ssp's staleness bound, or one past its epochs while the run's length is not
known yet. Each is parked here, by rank, and answered when released (an Ack, saying how
long it was held), when the run stops (the Stop), or when its worker is removed (a
Reject, so that a worker still alive never waits on an answer that will not come).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, replace

from tensorbus.bus.buffers import Tracker
from tensorbus.bus.clock import Clock
from tensorbus.bus.messages import Ack, Message, Phase, Reject, RejectCode, Stop
from tensorbus.nodes.membership import Member
from tensorbus.nodes.metrics import Metrics
from tensorbus.nodes.watch import Watch
from tensorbus.strategies.base import Decision, Hold, Wait

Reply = Callable[[bytes, Message], Awaitable[Tracker | None]]


@dataclass
class Parked:
    peer: bytes
    request: int
    since: float
    push: bool  # a held Push counts as time the worker waited for others


class Parking:
    def __init__(self, reply: Reply, *, metrics: Metrics, watch: Watch, clock: Clock,
                 wait: Wait, local_steps: Callable[[int], int | None] = lambda _: None) -> None:
        """`wait`: what the strategy's workers wait for once a push is answered;
        `local_steps`: the strategy's word on a worker's next local steps, said in the
        answer to its push (Strategy.local_steps)."""
        self._reply = reply
        self._wait = wait
        self._local_steps = local_steps
        self._metrics = metrics
        self._watch = watch
        self._clock = clock
        self._parked: dict[int, Parked] = {}  # rank -> its request held back

    async def answer(self, peer: bytes, member: Member, request: int, decisions: list[Decision],
                     now: float, *, push: bool, version: int) -> None:
        """Acknowledge a request now, with `version`, or park it if the strategy holds its
        sender back."""
        if Hold(member.rank) in decisions:
            self.park(member.rank, peer, request, now, push=push)
            return
        await self._reply(peer, Ack(request=request, version=version,
                                    local_steps=(self._local_steps(member.rank) or 0) if push else 0))
        if push:
            self._watch.answered(member.rank)
            # What it does now, for the status (beats may come only every few steps):
            # sync and average wait for the next version; the others compute on.
            waits = self._wait is Wait.NEWER
            member.phase = Phase.WAITING.value if waits else Phase.COMPUTING.value

    def park(self, rank: int, peer: bytes, request: int, now: float, *, push: bool) -> None:
        self._parked[rank] = Parked(peer, request, now, push)

    def get(self, rank: int) -> Parked | None:
        return self._parked.get(rank)

    def __contains__(self, rank: int) -> bool:
        return rank in self._parked

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._parked))

    def pushes(self, *, but: Callable[[int], bool]) -> list[int]:
        """The ranks whose parked request is a Push, but those for which `but` holds (the
        ones the strategy holds back still)."""
        return [rank for rank, parked in self._parked.items() if parked.push and not but(rank)]

    async def release(self, ranks: Iterable[int], *, version: int, stop: Stop | None = None) -> None:
        """Answer the requests of `ranks` held back: with an Ack of `version`, or `stop`."""
        now = self._clock.monotonic()
        for rank in ranks:
            parked = self._parked.pop(rank, None)
            if parked is None:
                continue  # it left meanwhile
            held_s = now - parked.since
            if parked.push:
                self._metrics.worker(rank)["held_s"] += held_s
                self._watch.answered(rank, held_since=self._clock.wall() - held_s)
            steps = (self._local_steps(rank) or 0) if parked.push else 0
            answer: Message = (replace(stop, request=parked.request) if stop is not None
                               else Ack(request=parked.request, version=version, held_s=held_s,
                                        local_steps=steps))
            await self._reply(parked.peer, answer)

    async def removed(self, rank: int, why: str) -> None:
        """`rank` is no longer a member: its parked request, if any, is refused. It may
        still be alive and waiting (removed for silence, say), and our heartbeats would
        keep it patient."""
        parked = self._parked.pop(rank, None)
        if parked is not None:
            await self._reply(parked.peer, Reject(request=parked.request,
                                                  code=RejectCode.UNKNOWN_WORKER.value,
                                                  detail=f"removed: {why}"))
