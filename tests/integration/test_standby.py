"""Integration: a standby coordinator in one event loop, on a virtual clock (nodes.replication).

A coordinator, its standby and two workers, all real nodes over the in-memory transport
(bus.memory) and the virtual-time loop (bus.clock): a coordinator killed mid-run (its
endpoint cut off and its task cancelled) is taken over by its standby, its workers move
there by themselves, and the run ends as an uninterrupted one does. Timings are checked in
virtual seconds. The same with real processes and SIGKILL: tests/system/test_standby_kill.py.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from specs import load_example

from tensorbus.bus.clock import LoopClock, run_virtual
from tensorbus.bus.memory import MemoryClient, MemoryNetwork
from tensorbus.nodes import Coordinator, CoordinatorConfig, Worker, WorkerConfig
from tensorbus.nodes.coordinator import Progress
from tensorbus.nodes.failures import SteppedDown
from tensorbus.nodes.faults import Faults
from tensorbus.strategies import Async, AsyncAveraging, PeriodicAveraging, StaleSync, Strategy, Sync

pytestmark = pytest.mark.timeout(30)

digits = load_example("digits")
STEPS, KILL_AT, TIMEOUT_S, BEAT_S = 40, 15, 2.0, 0.25
STRATEGIES: dict[str, Callable[[], Strategy]] = {
    "sync": lambda: Sync(workers=2),
    "average": lambda: PeriodicAveraging(workers=2, average_every=2),
    "async": lambda: Async(workers=2),
    "ssp": lambda: StaleSync(workers=2, staleness=1),
    "async-average": lambda: AsyncAveraging(workers=2, average_every=2),
    "streaming": lambda: PeriodicAveraging(workers=2, average_every=4, fragments=2),
}


def _coordinator(network: MemoryNetwork, clock: LoopClock, strategy: str,
                 client: Callable[..., MemoryClient] | None = None,
                 at: Callable[[], None] | None = None, **config: Any) -> Coordinator:
    """`at`: called as version KILL_AT is published (from the coordinator's own loop, so
    that nothing happens between: the cut comes exactly there)."""
    torch.manual_seed(0)  # (a standby builds the same model, as the same SPEC and seed do)
    settings: dict[str, Any] = {"batch_size": 8, "steps": STEPS, "shared_memory": False,
                                "heartbeat_s": BEAT_S, "timeout_s": TIMEOUT_S, **config}

    def on_step(progress: Progress) -> None:
        if progress.version == KILL_AT and at is not None:
            at()

    return Coordinator(model=digits.model(), strategy=STRATEGIES[strategy](),
                       config=CoordinatorConfig(**settings), transport=network.server,
                       client=client or network.client, clock=clock, lr=0.3, on_step=on_step,
                       evaluate=digits.evaluate)


def _worker(network: MemoryNetwork, clock: LoopClock, endpoint: str, slow_s: float = 0.0) -> Worker:
    """`slow_s`: virtual seconds a step takes (nodes.faults), so that a run lasts that long."""
    return Worker(model=digits.model(), data=digits.data, loss=digits.loss,
                  config=WorkerConfig(connect=endpoint, shared_memory=False,
                                      faults=Faults(slow_s=slow_s)),
                  transport=network.client, clock=clock)


async def _version(coordinator: Coordinator, version: int) -> None:
    while coordinator.version < version:
        await asyncio.sleep(0.01)


class Cut:
    """What a test does at version KILL_AT, and when it did it (virtual seconds)."""

    def __init__(self, clock: LoopClock) -> None:
        self._clock = clock
        self.at: float | None = None
        self.then: Callable[[], None] = lambda: None

    def __call__(self) -> None:
        self.at = self._clock.monotonic()
        self.then()


def _calm(strategy: str) -> tuple[dict[str, Any], torch.Tensor]:
    """The summary and final weights of the same run, uninterrupted."""
    async def train(clock: LoopClock) -> tuple[dict[str, Any], torch.Tensor]:
        network = MemoryNetwork()
        primary = _coordinator(network, clock, strategy)
        endpoint = primary.bind()
        summary, *_ = await asyncio.gather(
            primary.run(), *(_worker(network, clock, endpoint).run() for _ in range(2)))
        return summary, torch.cat([w.clone() for w in primary.flat.weights])
    result: tuple[dict[str, Any], torch.Tensor] = run_virtual(train)
    return result


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_killed_coordinator_is_taken_over_with_no_version_lost(strategy: str) -> None:
    async def train(clock: LoopClock) -> dict[str, Any]:
        network = MemoryNetwork()
        kill = Cut(clock)
        primary = _coordinator(network, clock, strategy, at=kill)
        standby = _coordinator(network, clock, strategy)
        endpoint = primary.bind()
        running = asyncio.create_task(primary.run())

        def killed() -> None:  # nothing comes from it, nothing reaches it, it runs no more
            network.partition(endpoint)
            running.cancel()

        kill.then = killed
        following = asyncio.create_task(standby.stand_by(endpoint))
        while not primary._standbys.endpoint:  # (it follows before the workers start)
            await asyncio.sleep(0.05)
        workers = [asyncio.create_task(_worker(network, clock, endpoint).run()) for _ in range(2)]
        assert await following  # taken over
        assert kill.at is not None
        await asyncio.gather(running, return_exceptions=True)
        # (Under async a push may be applied, and replicated, in the moment before the kill
        # lands: the last version is the one it made, whichever.)
        killed_at, last = kill.at, primary.version
        taken_over_at = clock.monotonic()
        serving = asyncio.create_task(standby.run())
        await _version(standby, last + 1)
        first_new_s = clock.monotonic() - killed_at
        summary = await serving
        reports = await asyncio.gather(*workers)
        return {"summary": summary, "last": last, "taken_over_s": taken_over_at - killed_at,
                "first_new_s": first_new_s, "reports": reports,
                "weights": torch.cat([w.clone() for w in standby.flat.weights])}

    got = run_virtual(train)
    summary = got["summary"]
    # Every version the killed one made is the standby's: it goes on from the last.
    assert summary["resumed_from"] == got["last"] and summary["standby"]["term"] == 1
    assert summary["steps"] == STEPS
    assert TIMEOUT_S <= got["taken_over_s"] <= TIMEOUT_S + 2 * BEAT_S
    # (Streaming's first version after a rejoin waits for a fragment's push from each
    # worker, whose first cycle after the join may take a request's timeout more.)
    assert got["first_new_s"] <= TIMEOUT_S + (2.0 if strategy == "streaming" else 1.0)
    # The workers moved by themselves and ended on the standby's final version.
    assert [r.rejoins for r in got["reports"]] == [1, 1]
    assert {r.final_version for r in got["reports"]} == {STEPS}
    calm, weights = _calm(strategy)
    assert summary["samples"] == calm["samples"]  # (a version's samples: none twice, none lost)
    if strategy in ("sync", "average"):  # the same batches, in the same order: the same run
        assert torch.allclose(got["weights"], weights, atol=1e-5)
        assert summary["final_loss"] == pytest.approx(calm["final_loss"], abs=1e-5)
        assert summary["accuracy"] == pytest.approx(calm["accuracy"], abs=0.005)
    else:  # (async: the order pushes come in is the run's own, and two calm runs differ too;
        # streaming: a rejoining worker starts from the version, its local steps on the
        # fragments not yet averaged given up)
        assert summary["final_loss"] < math.log(10)  # below chance: it learned, through the takeover


def test_a_killed_standby_leaves_the_coordinator_training_without_one() -> None:
    async def train(clock: LoopClock) -> tuple[dict[str, Any], float]:
        network = MemoryNetwork()
        kill = Cut(clock)
        primary = _coordinator(network, clock, "sync", at=kill)
        standby = _coordinator(network, clock, "sync")
        endpoint = primary.bind()
        running = asyncio.create_task(primary.run())
        following = asyncio.create_task(standby.stand_by(endpoint))

        def killed() -> None:
            network.partition(standby.endpoint)
            following.cancel()

        kill.then = killed
        while not primary._standbys.endpoint:
            await asyncio.sleep(0.05)
        workers = [asyncio.create_task(_worker(network, clock, endpoint).run()) for _ in range(2)]
        while kill.at is None or primary._standbys.endpoint:  # dropped: a replica unanswered
            await asyncio.sleep(0.05)
        dropped_s = clock.monotonic() - kill.at
        summary = await running
        await asyncio.gather(*workers)
        return summary, dropped_s

    summary, dropped_s = run_virtual(train)
    assert summary["steps"] == STEPS and summary["lost"] == []
    assert dropped_s <= TIMEOUT_S + 1.0
    # Every version up to the cut went to the standby (version 0 as it followed), none after.
    assert summary["standby"]["term"] == 0 and summary["standby"]["standby"] is None
    assert KILL_AT + 1 <= summary["standby"]["replicated"] < STEPS


def test_a_coordinator_cut_off_from_its_standby_steps_down_once_they_meet_again() -> None:
    """The coordinator and its standby lose each other (their links cut, both ways) while
    the workers still reach the coordinator: the standby takes over, and its first call on
    the old one (another connection: the cut is healed for it) makes that one step down;
    its workers move to the new one, and the run ends there."""
    async def train(clock: LoopClock) -> tuple[Any, dict[str, Any], list[Any]]:
        network = MemoryNetwork()
        cut: list[MemoryClient] = []

        def severed_later(connect: str, **options: Any) -> MemoryClient:
            client = network.client(connect, **options)
            cut.append(client)
            return client

        kill = Cut(clock)
        primary = _coordinator(network, clock, "sync", client=severed_later, at=kill)
        standby = _coordinator(network, clock, "sync", client=severed_later)
        endpoint = primary.bind()
        running = asyncio.create_task(primary.run())
        following = asyncio.create_task(standby.stand_by(endpoint))

        def partitioned() -> None:  # the follower's and the replicas' links, both ways
            for client in cut:
                network.sever(client)
            standby._client = network.client  # (its call on the old one, later, gets through)

        kill.then = partitioned
        while not primary._standbys.endpoint:
            await asyncio.sleep(0.05)
        # (Steps of 0.2 s: the old one trains on past the takeover, 2 s after the cut.)
        workers = [asyncio.create_task(_worker(network, clock, endpoint, slow_s=0.2).run())
                   for _ in range(2)]
        assert await following
        summary = await standby.run()
        old = (await asyncio.gather(running, return_exceptions=True))[0]
        return old, summary, await asyncio.gather(*workers)

    old, summary, reports = run_virtual(train)
    assert isinstance(old, SteppedDown) and old.term == 1
    assert str(old).startswith(f"stepped down at version {old.version}: the standby at ")
    assert summary["steps"] == STEPS and summary["standby"]["term"] == 1
    assert {r.final_version for r in reports} == {STEPS} and all(r.rejoins == 1 for r in reports)
