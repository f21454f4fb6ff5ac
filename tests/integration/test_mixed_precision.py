"""Integration: --precision in one event loop over the in-memory transport.

bf16-mixed trains as two replicas under autocast would, by hand. fp16-mixed's loss scaling
runs here on the CPU's fp16 autocast (the product allows fp16 on CUDA only; the check is
lifted for this test): an update that overflows is skipped and counted, not pushed.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Callable

import pytest
import torch
from specs import load_example
from torch import Tensor

from tensorbus.bus.clock import LoopClock, run_virtual
from tensorbus.bus.memory import MemoryNetwork
from tensorbus.nodes import Coordinator, CoordinatorConfig, Worker, WorkerConfig
from tensorbus.nodes.precision import Precision
from tensorbus.strategies import Sync

pytestmark = pytest.mark.timeout(30)

digits = load_example("digits")


def _run(precision: str, steps: int, b: int, lr: float,
         loss: Callable[[Tensor, Tensor], Tensor] = digits.loss) -> Coordinator:
    async def train(clock: LoopClock) -> Coordinator:
        network = MemoryNetwork()
        torch.manual_seed(0)
        coordinator = Coordinator(
            model=digits.model(), strategy=Sync(workers=2), lr=lr, transport=network.server,
            clock=clock, config=CoordinatorConfig(batch_size=b, steps=steps, shared_memory=False,
                                                  precision=precision))
        endpoint = coordinator.bind()
        workers = [Worker(model=digits.model(), data=digits.data, loss=loss,
                          config=WorkerConfig(connect=endpoint, shared_memory=False),
                          transport=network.client, clock=clock) for _ in range(2)]
        await asyncio.gather(coordinator.run(), *(w.run() for w in workers))
        return coordinator

    return run_virtual(train)


def test_bf16_mixed_trains_as_replicas_under_autocast() -> None:
    steps, b, lr = 8, 8, 0.05
    coordinator = _run("bf16-mixed", steps, b, lr)
    torch.manual_seed(0)
    reference = digits.model()
    replica = digits.model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=lr)
    shards = [iter(digits.data(rank, 2, b)) for rank in range(2)]
    for _ in range(steps):
        grads = []
        for shard in shards:
            replica.load_state_dict(reference.state_dict())
            inputs, targets = next(shard)
            replica.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = digits.loss(replica(inputs), targets)
            loss.backward()
            grads.append([p.grad.clone() for p in replica.parameters()])
        for param, *each in zip(reference.parameters(), *grads, strict=True):
            param.grad = sum(each) / 2
        optimizer.step()
    for got, want in zip(coordinator.model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # (Not the same as full precision: autocast did run.)
    full = _run("", steps, b, lr)
    assert any((a - c).abs().max() > 1e-4 for a, c in zip(
        coordinator.model.parameters(), full.model.parameters(), strict=True))


def test_fp16_mixed_skips_and_counts_an_update_that_overflows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Precision, "check", lambda self, device: None)
    calls: Counter[int] = Counter()  # a worker's losses, by its compute thread

    def loss(output: Tensor, target: Tensor) -> Tensor:
        calls[threading.get_ident()] += 1
        # Each worker's 3rd loss blows up the gradient: times fp16's scale of 2**16 it no
        # longer fits in fp16 (the loss itself is finite). Not the run's 5th and 6th: a worker
        # that skips its step computes again at once, and may take the other's turn.
        return digits.loss(output, target) * (1e4 if calls[threading.get_ident()] == 3 else 1.0)

    coordinator = _run("fp16-mixed", steps=6, b=8, lr=0.05, loss=loss)
    overflows = sum(w.get("overflows", 0) for w in coordinator.metrics.per_worker.values())
    assert overflows == 2
    assert coordinator.version == 6 and coordinator.metrics.dropped["not_finite"] == 0
    assert all(torch.isfinite(p).all() for p in coordinator.model.parameters())
