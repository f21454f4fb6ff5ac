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
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from specs import load_example

from tensorbus.bus.clock import LoopClock, run_virtual
from tensorbus.bus.codec import decode, encode
from tensorbus.bus.memory import MemoryClient, MemoryNetwork
from tensorbus.bus.messages import BUILD, Join, Message, Stop, Welcome
from tensorbus.nodes import Coordinator, CoordinatorConfig, Worker, WorkerConfig
from tensorbus.nodes.coordinator import Progress
from tensorbus.nodes.failures import SteppedDown
from tensorbus.nodes.faults import Faults
from tensorbus.nodes.replication import FollowError
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


async def _followed(primary: Coordinator, standby: Coordinator, endpoint: str) -> asyncio.Task[bool]:
    """`standby` following `primary` (at `endpoint`) once `primary` names it to its workers
    (its first replica taken): the task of its stand_by. Its failure, if it ends first."""
    following = asyncio.create_task(standby.stand_by(endpoint))
    while not primary.standby:
        if following.done():
            following.result()
            raise AssertionError("stand_by ended before the coordinator named its standby")
        await asyncio.sleep(0.05)
    return following


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
        following = await _followed(primary, standby, endpoint)  # (it follows before the workers start)
        workers = [asyncio.create_task(_worker(network, clock, endpoint).run()) for _ in range(2)]
        assert await following  # taken over
        serving = asyncio.create_task(standby.run())  # (at once, as the CLI does)
        taken_over_at = clock.monotonic()
        assert kill.at is not None
        await asyncio.gather(running, return_exceptions=True)
        # (Under async a push may be applied, and replicated, in the moment before the kill
        # lands: the last version is the one it made, whichever.)
        killed_at, last = kill.at, primary.version
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
    # The first new version: within --timeout + 1 s (2.26 s here, in every strategy).
    assert got["first_new_s"] <= TIMEOUT_S + 1.0
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
        following = await _followed(primary, standby, endpoint)

        def killed() -> None:
            network.partition(standby.endpoint)
            following.cancel()

        kill.then = killed
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
        following = await _followed(primary, standby, endpoint)

        def partitioned() -> None:  # the follower's and the replicas' links, both ways
            for client in cut:
                network.sever(client)
            standby._client = network.client  # (its call on the old one, later, gets through)

        kill.then = partitioned
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


def test_a_worker_started_after_the_takeover_joins_the_standby_it_was_given() -> None:
    """A worker pointed at the lost coordinator, and given its standby (`worker --standby`),
    joins the standby once the coordinator does not answer."""
    async def train(clock: LoopClock) -> tuple[Any, Any, dict[str, Any]]:
        network = MemoryNetwork()
        kill = Cut(clock)
        coordinators = [Coordinator(
            model=digits.model(), strategy=Async(workers=1), evaluate=digits.evaluate,
            config=CoordinatorConfig(batch_size=8, steps=STEPS, shared_memory=False,
                                     heartbeat_s=BEAT_S, timeout_s=TIMEOUT_S, max_workers=2),
            transport=network.server, client=network.client, clock=clock, lr=0.05,
            on_step=lambda p: kill() if p.version == KILL_AT else None) for _ in range(2)]
        primary, standby = coordinators
        endpoint = primary.bind()
        running = asyncio.create_task(primary.run())
        kill.then = lambda: (network.partition(endpoint), running.cancel())
        following = await _followed(primary, standby, endpoint)
        first = asyncio.create_task(_worker(network, clock, endpoint, slow_s=0.2).run())
        assert await following
        serving = asyncio.create_task(standby.run())
        late = Worker(model=digits.model(), data=digits.data, loss=digits.loss,
                      config=WorkerConfig(connect=endpoint, standby=standby.endpoint,
                                          shared_memory=False, faults=Faults(slow_s=0.2)),
                      transport=network.client, clock=clock)
        reports = await asyncio.gather(first, late.run())
        return reports[0], reports[1], await serving

    first, late, summary = run_virtual(train)
    assert summary["steps"] == STEPS and summary["standby"]["term"] == 1
    assert first.rejoins == 1 and late.rejoins == 0 and late.pushes > 0
    assert summary["per_worker"][str(late.rank)]["applied"] == late.pushes


def test_a_standby_that_does_not_take_a_replica_is_dropped_once_and_refused_after() -> None:
    """The coordinator's link to its standby fails (severed): the standby is dropped after
    one timeout, its next Follow refused, and it ends saying so; the run goes on, not one
    version a timeout."""
    async def train(clock: LoopClock) -> tuple[dict[str, Any], BaseException | bool]:
        network = MemoryNetwork()
        kill = Cut(clock)
        primary = _coordinator(network, clock, "sync", at=kill)
        standby = _coordinator(network, clock, "sync")
        endpoint = primary.bind()
        running = asyncio.create_task(primary.run())
        following = await _followed(primary, standby, endpoint)
        kill.then = lambda: network.sever(primary._standbys._client)  # type: ignore[arg-type]
        workers = [asyncio.create_task(_worker(network, clock, endpoint).run()) for _ in range(2)]
        summary = await running
        await asyncio.gather(*workers)
        return summary, (await asyncio.gather(following, return_exceptions=True))[0]

    started = time.monotonic()
    summary, ended = run_virtual(train)
    assert summary["steps"] == STEPS and summary["standby"]["replicated"] == KILL_AT + 1
    # One timeout in all, not one a version (25 versions after the cut: 50 s).
    assert summary["train_s"] < TIMEOUT_S + 1.0
    assert isinstance(ended, FollowError)
    assert "refused this standby: unexpected: this coordinator dropped the standby at " in str(ended)
    assert time.monotonic() - started < 20


def test_a_second_standby_is_refused_while_the_first_follows() -> None:
    async def follow(clock: LoopClock) -> BaseException | bool:
        network = MemoryNetwork()
        primary = _coordinator(network, clock, "sync")
        endpoint = primary.bind()
        running = asyncio.create_task(primary.run())
        first = await _followed(primary, _coordinator(network, clock, "sync"), endpoint)
        second = (await asyncio.gather(_coordinator(network, clock, "sync").stand_by(endpoint),
                                       return_exceptions=True))[0]
        for task in (first, running):
            task.cancel()
        await asyncio.gather(first, running, return_exceptions=True)
        return second

    second = run_virtual(follow)
    assert isinstance(second, FollowError)
    assert "this coordinator has a standby already, at mem://2" in str(second)


def test_a_worker_cut_off_alone_goes_back_to_its_coordinator_from_the_standby() -> None:
    """Only the worker lost its coordinator: the standby, hearing the coordinator still,
    answers not_yet; after a timeout of that the worker goes back, and joins again."""
    async def train(clock: LoopClock) -> tuple[dict[str, Any], list[Any]]:
        network = MemoryNetwork()
        kill = Cut(clock)
        primary = _coordinator(network, clock, "sync", at=kill, steps=60)
        standby = _coordinator(network, clock, "sync")
        endpoint = primary.bind()
        running = asyncio.create_task(primary.run())
        following = await _followed(primary, standby, endpoint)
        # (Steps of 0.2 s: the run lasts past the cut worker's trip to the standby and back.)
        cut = _worker(network, clock, endpoint, slow_s=0.2)
        kill.then = lambda: network.sever(cut.links[0]._client)  # type: ignore[arg-type]
        workers = [asyncio.create_task(w.run())
                   for w in (cut, _worker(network, clock, endpoint, slow_s=0.2))]
        summary = await running
        reports = await asyncio.gather(*workers)
        await asyncio.gather(following, return_exceptions=True)
        return summary, reports

    summary, reports = run_virtual(train)
    assert summary["steps"] == 60 and summary["standby"]["term"] == 0
    assert [w["rank"] for w in summary["lost"]] == [0]  # removed for silence, then back
    assert reports[0].rejoins == 1 and summary["per_worker"]["0"]["joins"] == 2


def test_a_coordinator_taken_over_while_cut_off_steps_down_at_a_worker_of_the_newer_term() -> None:
    """A partition the standby never heals: the coordinator and its standby lose each other
    for good (the standby's later calls do not get through either), and one worker loses
    the coordinator too. The standby takes over (term 1) with that worker, while the
    coordinator lives on apart with the other (async: it needs no one else). Then the
    moved worker loses the new coordinator and goes back to the one it left: its join
    carries term 1, and that coordinator steps down instead of welcoming it (two
    coordinators would serve the run). Its worker, and the moved one, end on the new one."""
    async def train(clock: LoopClock) -> tuple[Any, dict[str, Any], list[Any]]:
        network = MemoryNetwork()
        cut = False

        def severed_after_the_cut(connect: str, **options: Any) -> MemoryClient:
            client = network.client(connect, **options)
            clients.append(client)
            if cut:
                network.sever(client)
            return client

        clients: list[MemoryClient] = []
        kill = Cut(clock)
        # (80 versions, steps of 0.2 s: the coordinator lives on apart long after the cut.)
        primary = _coordinator(network, clock, "async", client=severed_after_the_cut, at=kill,
                               steps=80)
        standby = _coordinator(network, clock, "async", client=severed_after_the_cut, steps=80)
        endpoint = primary.bind()
        running = asyncio.create_task(primary.run())
        following = await _followed(primary, standby, endpoint)
        moving, staying = (_worker(network, clock, endpoint, slow_s=0.2) for _ in range(2))

        def partitioned() -> None:
            nonlocal cut
            cut = True
            for client in (*clients, moving.links[0]._client):
                network.sever(client)  # type: ignore[arg-type]

        kill.then = partitioned
        workers = [asyncio.create_task(w.run()) for w in (moving, staying)]
        assert await following
        serving = asyncio.create_task(standby.run())
        while moving.links[0].endpoint != standby.endpoint or not moving.links[0].joined:
            await asyncio.sleep(0.05)
        assert primary.state.value != "stopping"  # (living on apart, with the other worker)
        network.sever(moving.links[0]._client)  # type: ignore[arg-type]
        old = (await asyncio.gather(running, return_exceptions=True))[0]
        return old, await serving, await asyncio.gather(*workers)

    old, summary, reports = run_virtual(train)
    assert isinstance(old, SteppedDown) and (old.term, old.by) == (1, "worker 0")
    assert str(old).startswith(f"stepped down at version {old.version}: worker 0 spoke for term 1")
    assert summary["steps"] == 80 and summary["standby"]["term"] == 1
    assert {r.final_version for r in reports} == {80}
    # (The moved one: to the standby; then, having lost it, back and there again in one join.)
    assert [r.rejoins for r in reports] == [2, 1]


def test_a_newer_term_counts_only_in_a_join_that_names_the_run() -> None:
    """A stranger's message with any term decides nothing: the coordinator welcomes its join
    as any other. A join in a newer term that names the run's id (as a Welcome told it)
    makes it step down: with no standby known, its workers are told to stop."""
    async def ask(clock: LoopClock) -> tuple[Message, Message, bool, BaseException | None]:
        network = MemoryNetwork()
        coordinator = _coordinator(network, clock, "async")
        endpoint = coordinator.bind()
        running = asyncio.create_task(coordinator.run())
        client = network.client(endpoint)

        async def join(request: int, run: str) -> Message:
            await client.send(encode(Join(request=request, term=7, run=run,
                                          layout=coordinator.flat.layout.digest, build=BUILD)))
            return decode(await client.recv(), layout=coordinator.flat.layout)

        stranger = await join(1, "not-this-run")
        still = not coordinator.failed
        of_the_run = await join(2, coordinator._standbys.run_id)
        ended = (await asyncio.gather(running, return_exceptions=True))[0]
        return stranger, of_the_run, still, ended  # type: ignore[return-value]

    stranger, of_the_run, still, ended = run_virtual(ask)
    assert isinstance(stranger, Welcome) and stranger.term == 0 and still
    assert isinstance(of_the_run, Stop) and of_the_run.reason == "error" and of_the_run.term == 7
    assert isinstance(ended, SteppedDown) and (ended.term, ended.endpoint) == (7, "")
    assert str(ended).endswith("spoke for term 7, a coordinator that took the run over while this "
                               "one was cut off from it; the workers stop (this coordinator "
                               "knows no standby to send them to)")


def test_a_resumed_run_s_standby_goes_on_from_its_replica_not_the_checkpoint(tmp_path: Any) -> None:
    """A run resumed from a checkpoint (version 10), its standby given the same options
    (`--resume` too): killed at version KILL_AT, the run goes on from there at the standby,
    not from the checkpoint again."""
    async def first(clock: LoopClock) -> dict[str, Any]:
        network = MemoryNetwork()
        coordinator = _coordinator(network, clock, "sync", steps=10, checkpoint_dir=tmp_path)
        endpoint = coordinator.bind()
        summary, *_ = await asyncio.gather(
            coordinator.run(), *(_worker(network, clock, endpoint).run() for _ in range(2)))
        return summary

    async def resumed(clock: LoopClock) -> dict[str, Any]:
        network = MemoryNetwork()
        kill = Cut(clock)
        options: dict[str, Any] = {"checkpoint_dir": tmp_path, "resume": True}
        primary = _coordinator(network, clock, "sync", at=kill, **options)
        standby = _coordinator(network, clock, "sync", **options)
        endpoint = primary.bind()
        running = asyncio.create_task(primary.run())
        kill.then = lambda: (network.partition(endpoint), running.cancel())
        following = await _followed(primary, standby, endpoint)
        workers = [asyncio.create_task(_worker(network, clock, endpoint).run()) for _ in range(2)]
        assert await following
        summary = await standby.run()
        await asyncio.gather(running, *workers, return_exceptions=True)
        return summary

    assert run_virtual(first)["steps"] == 10
    summary = run_virtual(resumed)
    assert summary["resumed_from"] == KILL_AT and summary["steps"] == STEPS
    assert summary["standby"]["term"] == 1
