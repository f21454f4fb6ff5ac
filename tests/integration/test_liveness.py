"""Integration: liveness, membership and failure in one event loop, on a virtual clock.

The coordinator and the workers are the real nodes; only their transport (bus.memory:
queues, with partitions) and their clock (bus.clock.VirtualTimeLoop: time jumps to the
next timer when nothing is ready) are swapped. Ten seconds of silence or a five-minute
join timeout pass in milliseconds, and every timer still fires in the order real time
would give it. Each test checks both what happened and *when*, in virtual seconds.
The same behaviours with real processes and real seconds: tests/system/test_faults_local.py
and test_recovery.py (a few of each kind: kill, SIGTERM, namespaces, CURVE).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch
from specs import load_example

from tensorbus.bus.clock import LoopClock, run_virtual
from tensorbus.bus.codec import decode, encode
from tensorbus.bus.errors import PeerTimeoutError
from tensorbus.bus.memory import MemoryClient, MemoryNetwork
from tensorbus.bus.messages import (
    BUILD,
    Heartbeat,
    Join,
    Leave,
    Phase,
    Pull,
    Push,
    Ready,
    Reject,
    RejectCode,
    Stop,
    Welcome,
)
from tensorbus.nodes import Coordinator, CoordinatorConfig, Worker, WorkerConfig
from tensorbus.nodes.failures import JoinTimedOut, TooFewWorkers
from tensorbus.nodes.faults import Faults
from tensorbus.nodes.flat import FlatModel
from tensorbus.strategies import Async, PeriodicAveraging, StaleSync, Sync

pytestmark = pytest.mark.timeout(30)

digits = load_example("digits")


def _coordinator(network: MemoryNetwork, clock: LoopClock, **config: Any) -> Coordinator:
    torch.manual_seed(0)
    settings: dict[str, Any] = {"batch_size": 8, "steps": 10_000, "shared_memory": False}
    settings.update(config)
    return Coordinator(model=digits.model(), strategy=Sync(workers=2),
                       config=CoordinatorConfig(**settings), transport=network.server,
                       clock=clock, lr=0.05)


def _worker(network: MemoryNetwork, clock: LoopClock, endpoint: str, rank: int = -1,
            **config: Any) -> Worker:
    return Worker(model=digits.model(), data=digits.data, loss=digits.loss,
                  config=WorkerConfig(connect=endpoint, rank=rank, shared_memory=False, **config),
                  transport=network.client, clock=clock)


class Peer:
    """A scripted worker: joins, beats and falls silent when told, as a test says."""

    def __init__(self, network: MemoryNetwork, endpoint: str) -> None:
        self.client: MemoryClient = network.client(endpoint)
        self.layout = FlatModel(digits.model()).layout.digest
        self.rank = -1
        self._requests = 0

    async def ask(self, message: Any) -> Any:
        await self.client.send(encode(message))
        return decode(await asyncio.wait_for(self.client.recv(), 5.0))

    async def join(self, rank: int = -1) -> Any:
        self._requests += 1
        reply = await self.ask(Join(sender=self.rank, request=self._requests, rank=rank,
                                    layout=self.layout, build=BUILD))
        if isinstance(reply, Welcome):
            self.rank = reply.rank
        return reply

    async def ready(self) -> None:
        self._requests += 1
        await self.client.send(encode(Ready(sender=self.rank, request=self._requests,
                                            batches=10)))

    async def push(self) -> None:
        """One update of zeros (answered once the step is made)."""
        flat = FlatModel(digits.model())
        self._requests += 1
        zeros = tuple(torch.zeros(b.numel, dtype=b.dtype) for b in flat.layout.buckets)
        await self.client.send(encode(Push(sender=self.rank, request=self._requests, clock=0,
                                           loss=1.0, samples=8, tensors=zeros)))

    async def beat(self, seconds: float, every_s: float = 0.5) -> None:
        """Beat for `seconds` (virtual), as a live worker that has not started a step."""
        for _ in range(round(seconds / every_s)):
            await self.client.send(encode(Heartbeat(sender=self.rank, phase=Phase.WAITING.value,
                                                     clock=0, version=0)))
            await asyncio.sleep(every_s)


def test_sync_over_memory_on_a_virtual_clock_trains_as_over_sockets() -> None:
    """The seams carry training unchanged: the equivalence of tests/integration's
    test_sync_equals_single_process holds here too."""
    steps, b = 12, 8

    async def train(clock: LoopClock) -> Coordinator:
        network = MemoryNetwork()
        coordinator = _coordinator(network, clock, steps=steps, batch_size=b)
        endpoint = coordinator.bind()
        await asyncio.gather(coordinator.run(),
                             *(_worker(network, clock, endpoint).run() for _ in range(2)))
        return coordinator

    coordinator = run_virtual(train)
    torch.manual_seed(0)
    reference = digits.model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    batches = iter(digits.data(0, 1, 2 * b))
    for _ in range(steps):
        inputs, targets = next(batches)
        optimizer.zero_grad()
        digits.loss(reference(inputs), targets).backward()
        optimizer.step()
    for got, want in zip(coordinator.model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


async def _joined(network: MemoryNetwork, coordinator: Coordinator) -> tuple[Peer, Peer]:
    """Two scripted workers, welcomed."""
    a, b = Peer(network, coordinator.bind()), Peer(network, coordinator.bind())
    assert isinstance(await a.join(), Welcome) and isinstance(await b.join(), Welcome)
    return a, b


def _waited_for_nothing(started: float) -> None:
    """What the virtual clock buys: the test's seconds of silence and timeouts (10 s and
    more each) pass without being waited for. Under 5 s of wall time since `started`,
    however loaded the machine (alone, each of these tests takes well under a second:
    `pytest tests/integration/test_liveness.py --durations=0`)."""
    assert time.monotonic() - started < 5.0


async def _end(*tasks: asyncio.Task[Any]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _ranks(coordinator: Coordinator) -> list[int]:
    return [w.rank for w in coordinator.status().workers]


async def _until(check: Any, within_s: float) -> None:
    """Wait (virtual seconds, a tenth at a time) until `check()` holds."""
    for _ in range(round(within_s * 10)):
        if check():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"not within {within_s} s")


def test_a_silent_worker_is_removed_timeout_s_after_its_last_beat() -> None:
    async def scenario(clock: LoopClock) -> tuple[float, float, Coordinator]:
        network = MemoryNetwork()
        coordinator = _coordinator(network, clock, timeout_s=10.0)
        run = asyncio.create_task(coordinator.run())
        a, b = await _joined(network, coordinator)
        beating = asyncio.create_task(a.beat(60))
        await b.beat(3)  # then silence
        fell_silent = clock.monotonic()
        await _until(lambda: b.rank not in _ranks(coordinator), 20)
        removed = clock.monotonic()
        assert _ranks(coordinator) == [a.rank]  # the one that beats stays
        await _end(beating, run)
        return fell_silent, removed, coordinator

    started = time.monotonic()
    fell_silent, removed, coordinator = run_virtual(scenario)
    # Its last beat went 0.5 s before it fell silent; the coordinator looks every 0.5 s.
    assert 10.0 - 0.5 <= removed - fell_silent <= 10.0 + 0.5 + 0.1
    assert [w["rank"] for w in coordinator.metrics.lost] == [1]
    _waited_for_nothing(started)


def test_too_few_joined_within_the_join_timeout_fails_the_run_then() -> None:
    """Two of three join; one of them dies before training begins (removed for silence):
    at the join timeout the run fails, naming it. (tests/system/test_errors.py has the
    same line from `tensorbus coordinator`.)"""
    async def scenario(clock: LoopClock) -> tuple[float, JoinTimedOut]:
        network = MemoryNetwork()
        coordinator = Coordinator(
            model=digits.model(), strategy=Sync(workers=3), transport=network.server,
            clock=clock, config=CoordinatorConfig(batch_size=8, steps=10, join_timeout_s=300.0,
                                                  timeout_s=10.0, shared_memory=False))
        run = asyncio.create_task(coordinator.run())
        peer, dies = Peer(network, coordinator.bind()), Peer(network, coordinator.bind())
        assert isinstance(await peer.join(), Welcome) and isinstance(await dies.join(), Welcome)
        beating = asyncio.create_task(peer.beat(400))
        await dies.beat(2)
        network.sever(dies.client)
        with pytest.raises(JoinTimedOut) as failed:
            await run
        await _end(beating)
        return clock.monotonic(), failed.value

    started = time.monotonic()
    ended, failure = run_virtual(scenario)
    assert (failure.joined, failure.wanted, failure.waited_s) == (1, 3, 300.0)
    assert failure.lost_early == (1,)
    assert str(failure).startswith("only 1 of 3 workers joined within 300 s; 1 joined and were "
                                   "lost before training began (ranks 1): ")
    assert 300.0 <= ended <= 300.0 + 0.5 + 5.0 + 1.0  # the next tick, the stop's wait
    _waited_for_nothing(started)


def test_losing_a_worker_below_the_minimum_fails_the_run_when_it_is_removed() -> None:
    async def scenario(clock: LoopClock) -> tuple[float, float, TooFewWorkers]:
        network = MemoryNetwork()
        coordinator = _coordinator(network, clock, min_workers=2, timeout_s=10.0)
        run = asyncio.create_task(coordinator.run())
        a, b = await _joined(network, coordinator)
        await a.ready()
        await b.ready()
        await asyncio.sleep(0.1)  # (a push before the start is dropped)
        await a.push()
        await b.push()
        await _until(lambda: coordinator.state.value == "training", 5)
        beating = asyncio.create_task(a.beat(60))
        await b.beat(2)
        fell_silent = clock.monotonic()
        with pytest.raises(TooFewWorkers) as failed:
            await run
        failed_at = coordinator.metrics.lost[0]
        assert failed_at["rank"] == b.rank
        await _end(beating)
        return fell_silent, clock.monotonic(), failed.value

    started = time.monotonic()
    fell_silent, ended, failure = run_virtual(scenario)
    assert (failure.live, failure.minimum) == (1, 2)
    assert 10.0 - 0.5 <= ended - fell_silent <= 10.0 + 0.5 + 5.0  # removal, then the stop's wait
    _waited_for_nothing(started)


def test_a_removed_worker_is_refused_then_joins_again_with_its_rank() -> None:
    async def scenario(clock: LoopClock) -> tuple[Any, Any, list[int]]:
        network = MemoryNetwork()
        coordinator = _coordinator(network, clock, timeout_s=10.0)
        run = asyncio.create_task(coordinator.run())
        a, b = await _joined(network, coordinator)
        beating = asyncio.create_task(a.beat(60))
        await asyncio.sleep(15)  # b silent: removed
        refused = await b.ask(Pull(sender=b.rank, request=7, version=0))
        again = await b.join(rank=b.rank)
        ranks = _ranks(coordinator)
        await _end(beating, run)
        return refused, again, ranks

    started = time.monotonic()
    refused, again, ranks = run_virtual(scenario)
    assert isinstance(refused, Reject) and refused.code == RejectCode.UNKNOWN_WORKER.value
    assert isinstance(again, Welcome) and again.rank == 1
    assert ranks == [0, 1]
    _waited_for_nothing(started)


def test_a_worker_that_lost_its_coordinator_backs_off_then_gives_up() -> None:
    """Joined, waiting for the start, the coordinator cut off: the worker notices its
    silence after timeout_s, asks to join again at growing intervals (1, 2, 4, 8, then
    10 s), and gives up reconnect_timeout_s after it last heard from it."""

    joins: list[float] = []  # when the worker asked to join while cut off
    started = time.monotonic()

    async def scenario(clock: LoopClock) -> tuple[float, float, PeerTimeoutError]:
        network = MemoryNetwork()
        coordinator = _coordinator(network, clock, timeout_s=10.0)
        endpoint = coordinator.bind()
        run = asyncio.create_task(coordinator.run())
        worker = _worker(network, clock, endpoint, reconnect_timeout_s=60.0)
        working = asyncio.create_task(worker.run())
        await _until(lambda: _ranks(coordinator) == [0], 5)
        await asyncio.sleep(2)
        network.partition(endpoint)
        cut = clock.monotonic()
        with pytest.raises(PeerTimeoutError) as gave_up:
            await working
        ended = clock.monotonic()
        joins.extend(t for t, _, frames in network.lost if isinstance(decode(frames), Join))
        await _end(run)
        return cut, ended, gave_up.value

    cut, ended, error = run_virtual(scenario)
    assert "rejoin" in str(error)
    # Last heard at most a heartbeat before the cut; noticed 10 s later (within a beat).
    assert 10.0 <= joins[0] - cut <= 10.0 + 1.0 + 0.1
    gaps = [round(b - a, 3) for a, b in zip(joins, joins[1:], strict=False)]
    assert gaps[:4] == [1.0, 2.0, 4.0, 8.0] and set(gaps[4:-1]) <= {10.0}, gaps
    assert 60.0 - 0.5 <= ended - cut <= 60.0 + 0.1
    _waited_for_nothing(started)


def test_a_receive_loop_that_dies_fails_the_join_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug that kills a link's receive loop must not leave the join to retry for its
    whole timeout: it fails at once, with the cause."""
    import tensorbus.nodes.link as link

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("a bug in decoding")

    monkeypatch.setattr(link, "decode", broken)

    async def scenario(clock: LoopClock) -> tuple[float, BaseException]:
        network = MemoryNetwork()
        coordinator = _coordinator(network, clock)
        run = asyncio.create_task(coordinator.run())
        with pytest.raises(RuntimeError) as failed:
            await _worker(network, clock, coordinator.bind()).run()
        await _end(run)
        return clock.monotonic(), failed.value

    ended, error = run_virtual(scenario)
    assert "a bug in decoding" in str(error) and ended < 1.0


def test_a_scenario_that_nothing_can_end_is_said_to_be_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """No timer, no thread, nothing ready: the virtual-time loop says so, not hang."""
    import tensorbus.bus.clock as clock_module

    monkeypatch.setattr(clock_module, "IDLE_LIMIT_S", 0.2)

    async def stuck(clock: LoopClock) -> None:
        await asyncio.get_running_loop().create_future()  # nothing will end it

    with pytest.raises(RuntimeError, match="nothing to run for 0.2 s"):
        run_virtual(stuck)


# Each with versions enough to go on after the loss is noticed (ssp and async make a
# version of every gradient, average of every two steps).
KILLED = {
    "sync": (Sync(workers=3), 60),
    "backups": (Sync(workers=3, backups=1), 60),
    "ssp": (StaleSync(workers=3, staleness=2), 150),
    "async": (Async(workers=3), 150),
    "average": (PeriodicAveraging(workers=3, average_every=2), 30),
}


@pytest.mark.parametrize("name", list(KILLED))
def test_a_worker_killed_mid_run_is_removed_for_silence_and_the_run_finishes(name: str) -> None:
    """One of three workers dies at version 5, with not a word more (its traffic severed,
    its task ended): the coordinator notices from the missing heartbeats alone, timeout_s
    after it last heard from it, names it as lost, and finishes with the other two, which
    end normally. The real-process version: tests/system/test_faults_local.py (sync, async)."""
    strategy, steps = KILLED[name]

    async def scenario(clock: LoopClock) -> tuple[float, Coordinator, list[Worker]]:
        network = MemoryNetwork()
        killed: list[float] = []
        removed: list[float] = []
        tasks: list[asyncio.Task[Any]] = []

        def kill(progress: Any) -> None:
            # At the step itself: the workers compute in real time, which virtual time
            # does not count, so a test that polled would see the run over first.
            if progress.version >= 5 and not killed:
                victim = next(i for i, w in enumerate(workers) if w.rank == 1)
                network.sever(workers[victim].links[0]._client)
                tasks[victim].cancel()
                killed.append(clock.monotonic())

        torch.manual_seed(0)
        coordinator = Coordinator(
            model=digits.model(), strategy=strategy, lr=0.05, transport=network.server,
            clock=clock, on_step=kill,
            config=CoordinatorConfig(batch_size=8, steps=steps, timeout_s=2.0, heartbeat_s=0.25,
                                     shared_memory=False))
        write = coordinator.metrics.write

        def noting(event: str, **fields: Any) -> None:  # when each record is written
            removed.extend([clock.monotonic()] if event == "lost" else [])
            write(event, **fields)

        coordinator.metrics.write = noting  # type: ignore[method-assign]
        endpoint = coordinator.bind()
        workers = [Worker(model=digits.model(), data=digits.data, loss=digits.loss,
                          config=WorkerConfig(connect=endpoint, shared_memory=False,
                                              faults=Faults(slow_s=0.01)),
                          transport=network.client, clock=clock) for _ in range(3)]
        tasks.extend(asyncio.create_task(w.run()) for w in workers)
        await coordinator.run()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert sum(isinstance(r, asyncio.CancelledError) for r in results) == 1
        assert not any(isinstance(r, Exception) for r in results), results
        return removed[0] - killed[0], coordinator, workers

    started = time.monotonic()
    noticed, coordinator, workers = run_virtual(scenario)
    assert coordinator.version == steps
    lost = coordinator.metrics.lost
    assert [w["rank"] for w in lost] == [1]
    assert all(coordinator.metrics.worker(r)["joins"] == 1 for r in range(3))  # no churn
    # Noticed timeout_s after its last beat (a beat before the kill, at most), at a tick.
    assert 2.0 - 0.25 <= noticed <= 2.0 + 0.25 + 0.1, noticed
    assert time.monotonic() - started < 10.0


def test_a_worker_that_subscribes_after_the_stop_still_hears_it_and_the_run_ends() -> None:
    """Stopping, the coordinator sends the Stop again each beat: a worker welcomed just
    before the stop, whose subscription came after the first Stop went out (a slow
    joiner: a PUB drops what comes before), hears it within a beat and leaves, and the
    run ends then, not at the stop timeout. (Found: `local` stopped by Ctrl-C while a
    worker loaded its data took 15 s to end, for the stop timeout and a SIGTERM.)"""
    async def scenario(clock: LoopClock) -> tuple[float, float, Any]:
        network = MemoryNetwork()
        coordinator = _coordinator(network, clock, timeout_s=10.0, stop_timeout_s=60.0)
        run = asyncio.create_task(coordinator.run())
        peer = Peer(network, coordinator.bind())
        assert isinstance(await peer.join(), Welcome)
        beating = asyncio.create_task(peer.beat(120))
        await asyncio.sleep(1.0)
        coordinator.request_stop("test", quiet=True)
        await asyncio.sleep(2.0)  # the first Stop is out, and nobody heard it
        subscribed = clock.monotonic()
        peer.client.subscribe(0)
        while not isinstance(heard := decode(await peer.client.recv_broadcast()), Stop):
            pass
        heard_after = clock.monotonic() - subscribed
        await _end(beating)
        await peer.client.send(encode(Leave(sender=peer.rank, request=9, reason="stopped")))
        await asyncio.wait_for(run, 5.0)
        return heard_after, clock.monotonic() - subscribed, heard

    heard_after, ended_after, stop = run_virtual(scenario)
    assert heard_after <= 0.5 + 1e-6  # within a heartbeat
    assert ended_after <= 1.0  # the tick after the Leave, not the stop timeout's 60 s
    assert stop.reason != "error"
