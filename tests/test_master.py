"""The coordinator publishes its master weights' own buffers, and no step writes them after.

A snapshot (what a broadcast, a Welcome or a Pull sends, zero-copy) is the master's buffer
set itself, not a copy. From then on the master is not written in place while a send may
read it: a dense plain-SGD step writes the next version into a free set, which becomes the
master; any other step (momentum, top-k, averaging) first moves the master to a copy. Here
the steps are the coordinator's own (`_update`), on a model of several MB; a send that is
still reading is a tracker not done.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from nodes import Coordinator, CoordinatorConfig
from strategies import Sync

pytestmark = pytest.mark.timeout(60)
LR = 0.01


@dataclass
class _Sending:
    done: bool = False  # a zero-copy send that still reads the buffers until set


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512))


@pytest.mark.parametrize("momentum", [0.0, 0.9], ids=["plain", "momentum"])
def test_a_published_version_is_the_master_and_no_later_step_writes_it(momentum: float) -> None:
    coordinator = Coordinator(
        model=_model(), strategy=Sync(workers=2), config=CoordinatorConfig(batch_size=8, steps=10),
        optimizer=lambda ps: torch.optim.SGD(ps, lr=LR, momentum=momentum))
    reference = _model()  # the same steps, taken in place by torch's SGD
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR, momentum=momentum)
    layout = coordinator.flat.layout
    published: list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], _Sending]] = []
    generator = torch.Generator().manual_seed(1)

    async def steps() -> None:
        for _ in range(5):
            updates = [tuple(torch.randn(b.numel, generator=generator) for b in layout.buckets)
                       for _ in range(2)]
            await coordinator._update(updates, 1.0, loss=1.0, samples=16)
            coordinator.version += 1
            snapshot = coordinator._take_snapshot()
            assert snapshot.buffers is coordinator.flat.weights  # published without a copy
            sending = _Sending()
            snapshot.trackers.append(sending)
            published.append((snapshot.buffers, tuple(b.clone() for b in snapshot.buffers),
                              sending))
            mean = [(a + b) / 2 for a, b in zip(*updates, strict=True)]
            for param, grad in zip(reference.parameters(), layout.views(mean), strict=True):
                param.grad = grad.clone()
            optimizer.step()

    asyncio.run(steps())
    # Every version still being sent holds what was published: no later step wrote it.
    for buffers, values, _ in published:
        assert all(torch.equal(a, b) for a, b in zip(buffers, values, strict=True))
    # The parameters are views of the master, and the master is what SGD in place makes.
    master = coordinator.flat.weights
    for param, view in zip(coordinator.model.parameters(), layout.views(master), strict=True):
        assert param.data_ptr() == view.data_ptr()
    for param, want in zip(coordinator.model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(param.detach(), want.detach())


def test_sets_whose_sends_are_done_are_reused_not_allocated_again() -> None:
    coordinator = Coordinator(
        model=_model(), strategy=Sync(workers=1), config=CoordinatorConfig(batch_size=8, steps=50),
        optimizer=lambda ps: torch.optim.SGD(ps, lr=LR))
    layout = coordinator.flat.layout
    seen: set[int] = set()

    async def steps() -> None:
        for _ in range(20):
            update = tuple(torch.ones(b.numel) for b in layout.buckets)
            await coordinator._update([update], 1.0, loss=1.0, samples=8)
            coordinator.version += 1
            seen.add(coordinator._take_snapshot().buffers[0].data_ptr())

    asyncio.run(steps())
    assert len(seen) <= 3  # the master, the snapshot before it, and one more at most
