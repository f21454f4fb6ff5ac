"""Relays (hierarchical aggregation): two relays, each with two workers, under one root,
train the weights of the flat run with the same four workers (sync: to 1e-5), in one
event loop over real ZeroMQ on loopback."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import zygote
from cluster import ANY_PORT, bound_in_log
from equivalence import BATCH, digits, initial, max_difference, sgd
from zygote import Forked

from tensorbus.bus.errors import RejectedError
from tensorbus.nodes import (
    Coordinator,
    CoordinatorConfig,
    RunFailedError,
    TrainingError,
    Worker,
    WorkerConfig,
)
from tensorbus.nodes.relay import Relay
from tensorbus.strategies import Async, PeriodicAveraging, Strategy, Sync

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "examples" / "digits.py"


def _bn_model() -> torch.nn.Module:
    """The digits model with BatchNorm, whose running statistics travel (seed 0)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.BatchNorm1d(32),
                               torch.nn.ReLU(), torch.nn.Linear(32, 10))


def _worker(endpoint: str, model: Callable[[], torch.nn.Module] = digits.model) -> Worker:
    return Worker(model=model(), data=digits.data, loss=digits.loss, optimizer=sgd,
                  config=WorkerConfig(connect=endpoint))


def _flat(strategy: Strategy, steps: int,
          model: Callable[[], torch.nn.Module] = initial) -> torch.nn.Module:
    async def train() -> torch.nn.Module:
        root = Coordinator(model=model(), strategy=strategy, optimizer=sgd,
                           config=CoordinatorConfig(batch_size=BATCH, steps=steps))
        endpoint = root.bind()
        await asyncio.gather(root.run(), *(_worker(endpoint, model).run()
                                           for _ in range(strategy.workers)))
        return root.model

    return asyncio.run(train())


def _tree(root_strategy: Strategy, local: type[Strategy], steps: int, relays: int = 2,
          per_relay: int = 2, model: Callable[[], torch.nn.Module] = initial,
          **options: object) -> tuple[torch.nn.Module, list[dict]]:
    async def train() -> tuple[torch.nn.Module, list[dict]]:
        root = Coordinator(model=model(), strategy=root_strategy, optimizer=sgd,
                           config=CoordinatorConfig(batch_size=BATCH, steps=steps))
        upstream = root.bind()
        tree = [Relay(model=model(), strategy=local(workers=per_relay, **options),
                      config=CoordinatorConfig(steps=1), upstream=upstream)
                for _ in range(relays)]
        local_endpoints = [relay.bind() for relay in tree]
        workers = [_worker(e, model) for e in local_endpoints for _ in range(per_relay)]
        results = await asyncio.gather(root.run(), *(r.run() for r in tree),
                                       *(w.run() for w in workers))
        ranks = sorted(w.rank for w in workers)
        assert ranks == list(range(relays * per_relay))  # each worker its own data shard
        return root.model, list(results[1:1 + relays])

    return asyncio.run(train())


def test_a_sync_tree_gives_the_weights_of_the_flat_sync_run() -> None:
    flat = _flat(Sync(workers=4), steps=6)
    tree, summaries = _tree(Sync(workers=2), Sync, steps=6)
    assert max_difference(flat, tree) <= 1e-5
    assert max_difference(flat, initial()) > 1e-3  # it did train
    assert [s["ended"] for s in summaries] == ["the root stopped"] * 2


def test_a_sync_tree_carries_the_running_statistics_of_the_flat_run() -> None:
    # Each relay publishes the root's statistics and sends the mean of its own workers':
    # the root's mean of two relays' means of two is the flat run's mean of four.
    flat = _flat(Sync(workers=4), steps=6, model=_bn_model)
    tree, _ = _tree(Sync(workers=2), Sync, steps=6, model=_bn_model)
    assert max_difference(flat, tree) <= 1e-5
    flat_buffers, tree_buffers = dict(flat.named_buffers()), dict(tree.named_buffers())
    assert int(tree_buffers["1.num_batches_tracked"]) == 6
    for name, value in flat_buffers.items():
        torch.testing.assert_close(tree_buffers[name], value, rtol=0, atol=1e-5, msg=name)


def test_an_averaging_tree_gives_the_weights_of_the_flat_averaging_run() -> None:
    flat = _flat(PeriodicAveraging(workers=4, average_every=2), steps=3)
    tree, _ = _tree(PeriodicAveraging(workers=2, average_every=2), PeriodicAveraging, steps=3,
                    average_every=2)
    assert max_difference(flat, tree) <= 1e-5


def test_relays_under_an_async_root_train() -> None:
    tree, summaries = _tree(Async(workers=2), Sync, steps=10)
    assert max_difference(tree, initial()) > 1e-3
    assert all(s["steps"] >= 1 for s in summaries)


def test_a_relay_that_pushes_gradients_under_an_averaging_root_is_refused() -> None:
    with pytest.raises(RejectedError, match="give the relay sync under a sync"):
        _tree(PeriodicAveraging(workers=1, average_every=2), Sync, steps=2, relays=1)


def test_a_relay_steps_nothing_whatever_optimizer_it_is_given() -> None:
    """The root steps; a relay only takes means (a relay with an optimizer would make plain
    SGD steps of its own, by nodes.master's reading of it)."""
    relay = Relay(model=digits.model(), strategy=Sync(workers=1), optimizer=sgd,
                  config=CoordinatorConfig(steps=1), upstream="tcp://127.0.0.1:1")
    coordinator = relay.coordinator
    assert coordinator.optimizer is None and coordinator.master.optimizer is None
    assert coordinator.master.plain_lr() is None and not coordinator.master.into_spare(None)
    assert not coordinator.master.alias  # (its root's weights load into the master: copies go out)


def test_a_root_that_fails_fails_its_relays_and_their_workers() -> None:
    """The root's failure reaches the whole tree: each relay fails with it and tells its
    workers, which fail too (no node of a failed run ends as if it had ended well)."""
    async def train() -> list[object]:
        root = Coordinator(model=initial(), strategy=Sync(workers=2), optimizer=sgd,
                           config=CoordinatorConfig(batch_size=BATCH, steps=100_000))
        upstream = root.bind()
        tree = [Relay(model=digits.model(), strategy=Sync(workers=1),
                      config=CoordinatorConfig(steps=1), upstream=upstream) for _ in range(2)]
        workers = [_worker(relay.bind()) for relay in tree]
        running = [asyncio.create_task(node.run()) for node in (root, *tree, *workers)]
        while root.version < 3:
            await asyncio.sleep(0.02)
        await root.fail("a failure made by the test")
        return await asyncio.gather(*running, return_exceptions=True)

    root, *rest = asyncio.run(train())
    relays, workers = rest[:2], rest[2:]
    assert isinstance(root, TrainingError) and str(root) == "a failure made by the test"
    for relay in relays:
        assert isinstance(relay, TrainingError), relay
        assert str(relay) == "the root ended the run with an error: a failure made by the test"
    for worker in workers:
        assert isinstance(worker, RunFailedError), worker
        assert str(worker).endswith(" ended the run with an error: the root ended the run with "
                                    "an error: a failure made by the test")


# Processes -------------------------------------------------------------------------------


def _summary(stdout: str) -> dict:
    return json.loads(stdout[stdout.index("{"):])


@pytest.mark.timeout(150)
def test_a_tree_of_processes_trains_to_the_flat_runs_accuracy(tmp_path: Path) -> None:
    """`tensorbus coordinator` as the root, two `tensorbus relay` processes, two `tensorbus
    worker`s under each: the root's evaluation equals `tensorbus local --workers 4`'s."""
    quiet = ["--threads", "1", "--log-level", "info"]
    flat = zygote.shared().run(["local", str(DIGITS), "--workers", "4", "--steps", "12",
                           "--no-progress", "--json", *quiet], cwd=ROOT, capture_output=True, text=True,
                          timeout=100, check=False)
    assert flat.returncode == 0, flat.stderr
    processes: list[Forked] = []

    def start(*args: str, log: Path) -> Forked:
        with log.open("w") as logged:
            process = zygote.shared().popen([*args, *quiet], cwd=ROOT, text=True,
                                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                            stderr=logged)
        processes.append(process)
        return process

    try:
        logs = {name: tmp_path / f"{name}.log" for name in ("root", "relay-0", "relay-1")}
        root = start("coordinator", str(DIGITS), "--bind", ANY_PORT, "--workers", "2",
                     "--steps", "12", "--no-progress", "--json", log=logs["root"])
        root_at, _ = bound_in_log(root, logs["root"])
        for i in range(2):
            relay = start("relay", str(DIGITS), "--connect", root_at, "--bind", ANY_PORT,
                          "--workers", "2", log=logs[f"relay-{i}"])
            at, _ = bound_in_log(relay, logs[f"relay-{i}"])
            for j in range(2):
                start("worker", str(DIGITS), "--connect", at, log=tmp_path / f"worker-{i}-{j}.log")
        out, _ = root.communicate(timeout=120)
        assert root.returncode == 0, logs["root"].read_text()
        for process in processes[1:]:
            process.communicate(timeout=30)
            assert process.returncode == 0, "\n".join(p.read_text() for p in tmp_path.glob("*.log"))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.communicate()
    tree, flat_summary = _summary(out), _summary(flat.stdout)
    assert tree["steps"] == 12
    assert tree["accuracy"] == flat_summary["accuracy"]
    assert tree["test_loss"] == pytest.approx(flat_summary["test_loss"], abs=1e-5)
