"""The coordinator publishes its master weights' own buffers, and no step writes them after.

A snapshot (what a broadcast, a Welcome or a Pull sends, zero-copy) is the master's buffer
set itself, not a copy. From then on the master is not written in place while a send may
read it: a dense plain-SGD step, or a plain average of pushed weights, writes the next
version into a free set, which becomes the master; any other step (momentum, top-k) first
moves the master to a copy (nodes.master). Here the steps are the coordinator's own
(`_update`), on a model of several MB; a send that is still reading is a tracker not done.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from tensorbus.nodes import Coordinator, CoordinatorConfig
from tensorbus.strategies import PeriodicAveraging, Sync

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
            snapshot = coordinator.master.take_snapshot(coordinator.version)
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
    # With momentum, torch's SGD steps; plain SGD is folded push by push (nodes.fold), the
    # same arithmetic up to the rounding of each addition.
    for param, want in zip(coordinator.model.parameters(), reference.parameters(), strict=True):
        if momentum:
            assert torch.equal(param.detach(), want.detach())
        else:
            torch.testing.assert_close(param.detach(), want.detach(), rtol=0, atol=1e-6)


def test_sets_whose_sends_are_done_are_reused_not_allocated_again() -> None:
    # (A pool in shared memory keeps more sets, on purpose: tests/integration/test_shared_weights.py.)
    coordinator = Coordinator(
        model=_model(), strategy=Sync(workers=1),
        config=CoordinatorConfig(batch_size=8, steps=50, shared_memory=False),
        optimizer=lambda ps: torch.optim.SGD(ps, lr=LR))
    layout = coordinator.flat.layout
    seen: set[int] = set()

    async def steps() -> None:
        for _ in range(20):
            update = tuple(torch.ones(b.numel) for b in layout.buckets)
            await coordinator._update([update], 1.0, loss=1.0, samples=8)
            coordinator.version += 1
            seen.add(coordinator.master.take_snapshot(coordinator.version).buffers[0].data_ptr())

    asyncio.run(steps())
    assert len(seen) <= 3  # the master, the snapshot before it, and one more at most


def test_a_snapshot_taken_again_without_a_step_keeps_the_sends_that_read_it() -> None:
    coordinator = Coordinator(
        model=_model(), strategy=Sync(workers=1), config=CoordinatorConfig(batch_size=8, steps=10),
        optimizer=lambda ps: torch.optim.SGD(ps, lr=LR))
    first = coordinator.master.take_snapshot(coordinator.version)
    sending = _Sending()
    first.trackers.append(sending)
    coordinator.version += 1  # a version made without a step (the weights did not change)
    again = coordinator.master.take_snapshot(coordinator.version)
    assert again is first and again.version == 1 and sending in again.trackers
    layout = coordinator.flat.layout
    published = tuple(b.clone() for b in first.buffers)

    async def step() -> None:
        await coordinator._update([tuple(torch.ones(b.numel) for b in layout.buckets)], 1.0,
                                  loss=1.0, samples=8)
        coordinator.version += 1
        # The old one goes to the pool, its send still on.
        coordinator.master.take_snapshot(coordinator.version)
        await coordinator._update([tuple(torch.ones(b.numel) for b in layout.buckets)], 1.0,
                                  loss=1.0, samples=8)

    asyncio.run(step())
    assert all(torch.equal(a, b) for a, b in zip(first.buffers, published, strict=True))


def test_a_send_under_way_keeps_its_snapshot_busy_until_it_returns_and_is_done() -> None:
    from tensorbus.nodes.master import Snapshot, tracked

    async def scenario() -> None:
        snapshot = Snapshot(0, ())
        returned: asyncio.Future[_Sending] = asyncio.get_running_loop().create_future()
        send = asyncio.ensure_future(tracked(snapshot, returned))
        await asyncio.sleep(0)
        assert not snapshot.free  # begun, not returned: the pool must not take it back
        tracker = _Sending()
        returned.set_result(tracker)
        await send
        assert not snapshot.free  # returned, ZeroMQ still reads the frames
        tracker.done = True
        assert snapshot.free

    asyncio.run(scenario())


def test_averaged_weights_go_into_a_spare_set_and_leave_the_published_one() -> None:
    coordinator = Coordinator(
        model=_model(), strategy=PeriodicAveraging(workers=2, average_every=1),
        config=CoordinatorConfig(batch_size=8, steps=10))
    layout = coordinator.flat.layout
    generator = torch.Generator().manual_seed(2)

    async def steps() -> None:
        for _ in range(3):
            published = coordinator.master.take_snapshot(coordinator.version).buffers
            kept = tuple(b.clone() for b in published)
            pushed = [tuple(torch.randn(b.numel, generator=generator) for b in layout.buckets)
                      for _ in range(2)]
            await coordinator._update(pushed, 1.0, loss=1.0, samples=16)
            coordinator.version += 1
            assert coordinator.flat.weights is not published
            # Summed straight into the spare set: not into the gradient buffers, then copied.
            assert not any(g.any() for g in coordinator.flat.grads)
            assert all(torch.equal(a, b) for a, b in zip(published, kept, strict=True))
            for got, a, b in zip(coordinator.flat.weights, *pushed, strict=True):
                assert torch.equal(got, (a + b) * 0.5)

    asyncio.run(steps())
