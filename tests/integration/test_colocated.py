"""Coordinator shards colocated with the workers (nodes.Colocated): worker r serves shard r.

In one event loop over real ZeroMQ (each node's own shard in-process, the others over tcp
loopback): sync steps as one coordinator does, to 1e-5, with 2 and 3 workers, and so does
periodic averaging; every worker ends holding the final weights; evaluate sees them; a
strategy whose workers do not wait for every version, and a wrong endpoint list, are
refused with what to do. `tensorbus local --colocate` is tested in tests/system/test_colocated_local.py.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from equivalence import BATCH, digits, initial, max_difference, sgd

from tensorbus.nodes import Colocated, Coordinator, CoordinatorConfig, Worker, WorkerConfig
from tensorbus.strategies import Async, PeriodicAveraging, StaleSync, Strategy, Sync

pytestmark = pytest.mark.timeout(90)


def _central(make: type[Strategy], workers: int, steps: int, **options: object) -> torch.nn.Module:
    """The same run with one coordinator: its final weights."""

    async def train() -> torch.nn.Module:
        coordinator = Coordinator(model=initial(), strategy=make(workers=workers, **options),
                                  optimizer=sgd, config=CoordinatorConfig(batch_size=BATCH, steps=steps))
        endpoint = coordinator.bind()
        ws = [Worker(model=digits.model(), data=digits.data, loss=digits.loss, optimizer=sgd,
                     config=WorkerConfig(connect=endpoint, rank=r)) for r in range(workers)]
        await asyncio.gather(coordinator.run(), *(w.run() for w in ws))
        return coordinator.model

    return asyncio.run(train())


def _colocated(make: type[Strategy], workers: int, steps: int, evaluate: bool = False,
               **options: object) -> tuple[list[Colocated], list[dict]]:
    async def train() -> tuple[list[Colocated], list[dict]]:
        nodes = [Colocated(index=i, count=workers, model=initial(), data=digits.data,
                           loss=digits.loss, strategy=make(workers=workers, **options),
                           config=CoordinatorConfig(batch_size=BATCH, steps=steps),
                           optimizer=sgd, evaluate=digits.evaluate if evaluate and i == 0 else None)
                 for i in range(workers)]
        endpoints = [n.bind() for n in nodes]
        results = await asyncio.gather(*(n.run(WorkerConfig(connect=endpoints)) for n in nodes))
        return nodes, [summary for summary, _ in results]

    return asyncio.run(train())


@pytest.mark.parametrize("workers", [2, 3])
def test_sync_on_colocated_shards_gives_the_weights_of_one_coordinator(workers: int) -> None:
    central = _central(Sync, workers, steps=8)
    nodes, summaries = _colocated(Sync, workers, steps=8)
    assert [s["steps"] for s in summaries] == [8] * workers
    for i, node in enumerate(nodes):  # every worker holds the final model, all of it
        assert node.worker is not None and node.worker.version == 8
        assert max_difference(central, node.worker.flat.module) <= 1e-5
        # Every version of the other shards' ranges read where they made it (bus.shared).
        assert [(link.by_reference, link.torn) for link in node.worker.links] == [
            (0, 0) if j == i else (8, 0) for j in range(workers)]
    assert max_difference(central, initial()) > 1e-3  # it did train


def test_averaging_on_colocated_shards_gives_the_weights_of_one_coordinator() -> None:
    central = _central(PeriodicAveraging, 2, steps=3, average_every=2)
    nodes, _ = _colocated(PeriodicAveraging, 2, steps=3, average_every=2)
    assert all(max_difference(central, n.worker.flat.module) <= 1e-5 for n in nodes)  # type: ignore[union-attr]


def test_the_first_node_evaluates_the_whole_final_model() -> None:
    nodes, summaries = _colocated(Sync, 2, steps=30, evaluate=True)
    assert summaries[0]["accuracy"] == pytest.approx(digits.evaluate(nodes[1].worker.flat.module)["accuracy"])  # type: ignore[union-attr]
    assert summaries[0]["accuracy"] > 0.5
    assert "accuracy" not in summaries[1]



def test_a_stop_at_a_version_trains_on_to_it_on_every_shard() -> None:
    # As `local --colocate` stops its shards on SIGTERM: each is told one version, one
    # shard as soon as it takes version 3, the other only at its version 4.
    async def train() -> list[dict]:
        told: list[int] = []

        def stop_at_six(shard: int, version: int) -> None:
            if version == 3 + shard and shard not in told:
                told.append(shard)
                nodes[shard].coordinator.request_stop("test", at_version=6)

        nodes = [Colocated(index=i, count=2, model=initial(), data=digits.data, loss=digits.loss,
                           strategy=Sync(workers=2), optimizer=sgd,
                           config=CoordinatorConfig(batch_size=BATCH, steps=1000),
                           on_step=lambda p, i=i: stop_at_six(i, p.version)) for i in range(2)]
        endpoints = [n.bind() for n in nodes]
        results = await asyncio.gather(*(n.run(WorkerConfig(connect=endpoints)) for n in nodes))
        return [summary for summary, _ in results]

    summaries = asyncio.run(train())
    assert [s["steps"] for s in summaries] == [6, 6]
    assert all(s["ended"] == "stop requested: test" for s in summaries)

@pytest.mark.parametrize("make", [StaleSync, Async])
def test_strategies_that_do_not_wait_for_every_version_are_refused(make: type[Strategy]) -> None:
    with pytest.raises(ValueError, match="wait for every version .* use a central coordinator"):
        Colocated(index=0, count=2, model=initial(), data=digits.data, loss=digits.loss,
                  strategy=make(workers=2), config=CoordinatorConfig(steps=1))


def test_one_endpoint_per_shard_is_needed() -> None:
    node = Colocated(index=0, count=2, model=initial(), data=digits.data, loss=digits.loss,
                     strategy=Sync(workers=2), config=CoordinatorConfig(steps=1))
    with pytest.raises(ValueError, match="1 endpoints for 2 colocated shards"):
        asyncio.run(node.run(WorkerConfig(connect="tcp://127.0.0.1:1")))
