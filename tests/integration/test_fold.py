"""A plain SGD step made as the pushes of a version come (nodes.fold): the same bits as
the step made at the end, whatever the order pushes come in, and a push that is not finite
is still dropped, with the fold as it was before it.

Unit: `Fold` on its own. Integration: a coordinator and two workers in one loop over real
ZeroMQ, trained with folding and without it (the coordinator's `stepper.fold_for`
answering None), the versions compared bit for bit.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from specs import load_example
from torch import nn

from tensorbus.bus.messages import Push
from tensorbus.bus.pieces import fold
from tensorbus.nodes import Coordinator, CoordinatorConfig, Worker, WorkerConfig
from tensorbus.nodes.fold import Fold, next_to_fold
from tensorbus.strategies import Sync

pytestmark = pytest.mark.timeout(60)

digits = load_example("digits")
LR = 0.05


def test_pushes_are_taken_in_rank_order_of_the_live_members() -> None:
    assert not next_to_fold([], 1, [0, 1, 2])  # worker 0 may still push: it comes first
    assert next_to_fold([], 0, [0, 1, 2])
    assert next_to_fold([0], 1, [0, 1, 2]) and not next_to_fold([0], 2, [0, 1, 2])
    assert not next_to_fold([0], 0, [0, 1, 2])  # once only
    assert next_to_fold([0], 2, [0, 2])  # worker 1 left: 2 is next


@pytest.mark.parametrize(("bucket", "where"), [(0, 50), (1, 7), (0, 0)])
def test_a_push_that_is_not_finite_leaves_the_fold_as_it_was(bucket: int, where: int) -> None:
    """Found in the middle of a bucket (blocks of 8: the blocks before it were written,
    and are made again without it), in a later bucket (the first was folded in whole), or
    at the very start."""
    torch.manual_seed(0)
    master = (torch.randn(100), torch.randn(30))
    pushes = [(torch.randn(100), torch.randn(30)) for _ in range(2)]
    poisoned = (torch.randn(100), torch.randn(30))
    poisoned[bucket][where] = math.nan
    fold_ = Fold(0, -0.1, (torch.empty(100), torch.empty(30)), block=8)
    assert fold_.add(master, 0, pushes[0])
    assert not fold_.add(master, 1, poisoned)
    assert fold_.ranks == [0]
    for b, out in enumerate(fold_.into):
        want = torch.empty_like(out)
        fold(want, master[b], [pushes[0][b]], -0.1, block=8)
        assert torch.equal(out, want)
    assert fold_.add(master, 1, pushes[1]) and fold_.ranks == [0, 1]
    # What the step then finds: the fold serves a step of that version, alpha and order.
    assert fold_.folded(0, -0.1, (0, 1)) == 2
    assert fold_.folded(0, -0.1, (0, 1, 2)) == 2
    assert fold_.folded(1, -0.1, (0, 1)) is None
    assert fold_.folded(0, -0.2, (0, 1)) is None
    assert fold_.folded(0, -0.1, (1, 2)) is None


def test_a_fold_that_a_step_took_while_it_waited_for_the_lock_is_left_alone() -> None:
    """Sync with a backup: workers 1 and 2 pushed, worker 3 was dropped as silent, so the
    step of (1, 2) is due and waits for the step lock (held by a broadcast, say); worker
    0's push comes meanwhile and its fold waits behind the step. The step takes the fold's
    set and publishes it; the fold must then not write into it (found in review: it did)."""
    async def scenario() -> None:
        torch.manual_seed(0)
        coordinator = Coordinator(
            model=nn.Linear(4, 2), strategy=Sync(workers=3, backups=1),
            config=CoordinatorConfig(batch_size=8, steps=8),
            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
        for rank in range(3):
            coordinator._members.join(bytes([rank]), rank, 0.0)
        coordinator.strategy.members = {0, 1, 2}
        n = coordinator.flat.weights[0].numel()
        pushes = {r: (torch.full((n,), float(r + 1)),) for r in range(3)}
        master = coordinator.flat.weights[0].clone()
        lock = coordinator._step_lock
        await lock.acquire()  # a broadcast holds it

        async def step() -> None:
            async with lock:
                await coordinator._update([pushes[1], pushes[2]], 1.0, loss=0.0, samples=1,
                                          ranks=(1, 2))
                coordinator.version += 1

        stepping = asyncio.ensure_future(step())
        await asyncio.sleep(0)
        push = Push(sender=0, request=1, version=0, tensors=pushes[0], clock=0, loss=1.0, samples=1)
        fold_ = coordinator.stepper.fold_for(0, push, quorum=coordinator.strategy.quorum(),
                                             members=lambda: [0, 1, 2])
        assert fold_ is not None
        folding = asyncio.ensure_future(coordinator.stepper.fold_in(fold_, 0, push))
        await asyncio.sleep(0)
        lock.release()
        await stepping
        assert await folding  # checked on its own instead: finite
        want = torch.empty(n)
        fold(want, master, [pushes[1][0], pushes[2][0]], -0.1 / 2)
        assert torch.equal(coordinator.flat.weights[0], want)
        assert fold_.ranks == []

    asyncio.run(scenario())


def _model() -> nn.Module:
    """Over the coordinator's small-step bound (1M parameters): its folds and steps run in
    a thread; a push is 5 MB, five frames, each bucket twenty blocks."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 16400), nn.ReLU(), nn.Linear(16400, 10))


def _worker(endpoint: str, rank: int, poison_step: int | None, **config: Any) -> Worker:
    """Worker `rank`, whose gradient is NaN at its `poison_step`-th backward (if given);
    `config`: more WorkerConfig fields (tests/integration/test_shared.py's shared_memory)."""
    model = _model()
    if poison_step is not None:
        # A NaN gradient once, with a finite loss: only the tensors say it.
        calls = {"n": 0}

        def poison(grad: torch.Tensor) -> torch.Tensor:
            calls["n"] += 1
            return grad * math.nan if calls["n"] == poison_step else grad

        list(model.parameters())[-1].register_hook(poison)
    return Worker(model=model, data=digits.data, loss=digits.loss,
                  config=WorkerConfig(connect=endpoint, rank=rank, request_timeout_s=10.0,
                                      **config))


def _train(*, folding: bool, poisoned: int | None) -> tuple[list[torch.Tensor], dict[str, Any], int]:
    """Train 2 workers of sync with plain SGD for 8 versions; the final weights, the
    summary, and how many pushes the steps found folded in already."""
    async def scenario() -> tuple[list[torch.Tensor], dict[str, Any], int]:
        coordinator = Coordinator(
            model=_model(), strategy=Sync(workers=2),
            config=CoordinatorConfig(batch_size=8, steps=8),
            optimizer=lambda ps: torch.optim.SGD(ps, lr=LR))
        if not folding:
            coordinator.stepper.fold_for = (  # type: ignore[method-assign]
                lambda rank, message, **_: None)
        endpoint = coordinator.bind()
        summary, *_ = await asyncio.gather(
            coordinator.run(),
            *(_worker(endpoint, r, 2 if r == poisoned else None).run() for r in (0, 1)))
        weights = [w.clone() for w in coordinator.flat.weights]
        return weights, summary, sum(used)

    used: list[int] = []  # what each step found folded already
    serves = Fold.folded

    def counted(self: Fold, version: int, alpha: float, ranks: Sequence[int]) -> int | None:
        count = serves(self, version, alpha, ranks)
        used.append(count or 0)
        return count

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Fold, "folded", counted)
        return asyncio.run(scenario())


@pytest.mark.parametrize("poisoned", [None, 0, 1], ids=["finite", "rank-0-nan", "rank-1-nan"])
def test_a_run_that_folds_pushes_as_they_come_makes_the_same_bits(poisoned: int | None) -> None:
    """With folding, the coordinator folds pushes in as they come (at least worker 0's, the
    first in rank order, every version), and its steps go on from there; without it, it
    makes each step at the end: the same weights, bit for bit. A NaN gradient (finite
    loss, in the last layer: past the first blocks) is dropped as not finite either way,
    and its worker computes again."""
    want, plain, none_folded = _train(folding=False, poisoned=poisoned)
    got, summary, folded = _train(folding=True, poisoned=poisoned)
    assert none_folded == 0 and folded >= 8  # pushes the steps found folded already
    assert summary["steps"] == plain["steps"] == 8
    dropped = {} if poisoned is None else {"not_finite": 1}
    assert summary["dropped"] == plain["dropped"] == dropped
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert all(bool(torch.isfinite(w).all()) for w in got)


def test_a_worker_trains_in_train_mode_whatever_mode_it_was_given() -> None:
    """Dropout on and BatchNorm's statistics moving while it computes: model.train()."""
    async def scenario() -> list[bool]:
        coordinator = Coordinator(model=_model(), strategy=Sync(workers=1),
                                  config=CoordinatorConfig(batch_size=8, steps=3),
                                  optimizer=lambda ps: torch.optim.SGD(ps, lr=LR))
        worker = _worker(coordinator.bind(), 0, None)
        worker._model.eval()
        modes: list[bool] = []
        worker._model.register_forward_pre_hook(lambda m, _: modes.append(m.training))
        await asyncio.gather(coordinator.run(), worker.run())
        return modes

    modes = asyncio.run(scenario())
    assert modes and all(modes)
