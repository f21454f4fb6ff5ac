"""Integration: a model's buffers (BatchNorm's running statistics) travel with its weights.

In one event loop, over the in-memory transport, as tests/integration/test_liveness.py runs
its nodes: the real coordinator and workers train a model with BatchNorm, and what the
coordinator ends with is checked against the same training done by hand, two replicas
computing on their halves of each global batch from the published weights and buffers.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from specs import load_example
from torch import nn

from tensorbus.bus.clock import LoopClock, run_virtual
from tensorbus.bus.memory import MemoryNetwork
from tensorbus.nodes import Coordinator, CoordinatorConfig, Worker, WorkerConfig
from tensorbus.strategies import PeriodicAveraging, Sync

pytestmark = pytest.mark.timeout(30)

digits = load_example("digits")


def bn_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))


def _run(strategy: Sync | PeriodicAveraging, steps: int, batch: int,
         lr: float) -> tuple[Coordinator, list[Worker]]:
    async def train(clock: LoopClock) -> tuple[Coordinator, list[Worker]]:
        network = MemoryNetwork()
        torch.manual_seed(0)
        coordinator = Coordinator(
            model=bn_model(), strategy=strategy, lr=lr, transport=network.server, clock=clock,
            config=CoordinatorConfig(batch_size=batch, steps=steps, shared_memory=False))
        endpoint = coordinator.bind()
        workers = [Worker(model=bn_model(), data=digits.data, loss=digits.loss,
                          config=WorkerConfig(connect=endpoint, shared_memory=False),
                          transport=network.client, clock=clock) for _ in range(2)]
        await asyncio.gather(coordinator.run(), *(w.run() for w in workers))
        return coordinator, workers

    return run_virtual(train)


def _combine(replicas: list[nn.Module]) -> dict[str, torch.Tensor]:
    """The coordinator's rule: float buffers averaged, the others their largest."""
    combined = {}
    for name, first in replicas[0].named_buffers():
        stacked = torch.stack([dict(r.named_buffers())[name] for r in replicas])
        combined[name] = (stacked.double().mean(0).to(first.dtype) if first.is_floating_point()
                          else stacked.amax(0))
    return combined


def test_sync_publishes_the_mean_of_its_workers_running_statistics() -> None:
    steps, b, lr = 10, 8, 0.05
    coordinator, workers = _run(Sync(workers=2), steps, b, lr)

    torch.manual_seed(0)
    reference = bn_model()
    replicas = [bn_model() for _ in range(2)]
    optimizer = torch.optim.SGD(reference.parameters(), lr=lr)
    shards = [iter(digits.data(rank, 2, b)) for rank in range(2)]
    for _ in range(steps):
        grads = []
        for replica, shard in zip(replicas, shards, strict=True):
            replica.load_state_dict(reference.state_dict())
            replica.train()
            inputs, targets = next(shard)
            replica.zero_grad()
            digits.loss(replica(inputs), targets).backward()
            grads.append([p.grad for p in replica.parameters()])
        for param, *each in zip(reference.parameters(), *grads, strict=True):
            param.grad = sum(each) / 2
        optimizer.step()
        for name, value in _combine(replicas).items():
            dict(reference.named_buffers())[name].copy_(value)

    got = dict(coordinator.model.named_buffers())
    assert int(got["1.num_batches_tracked"]) == steps
    for name, want in reference.named_buffers():
        torch.testing.assert_close(got[name], want, rtol=0, atol=1e-5, msg=name)
    for got_p, want_p in zip(coordinator.model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got_p, want_p, rtol=0, atol=1e-5)
    # The workers end with what was published last, as they began each step with it.
    for worker in workers:
        for name, buffer in worker.flat.module.named_buffers():
            torch.testing.assert_close(buffer, got[name], rtol=0, atol=0, msg=name)


def test_average_carries_the_statistics_of_its_local_steps() -> None:
    coordinator, _ = _run(PeriodicAveraging(workers=2, average_every=3), steps=4, batch=8, lr=0.05)
    running_mean = dict(coordinator.model.named_buffers())["1.running_mean"]
    # 4 rounds of 3 local steps: every worker's statistics moved away from their start.
    assert int(dict(coordinator.model.named_buffers())["1.num_batches_tracked"]) == 12
    assert running_mean.abs().sum() > 0.1
