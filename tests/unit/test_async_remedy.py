"""Unit: momentum correction on a small case, without processes or timing: four workers
pushing in turn, each gradient computed on the weights of three versions before (the
staleness async has with four equal workers), applied with the SPEC's SGD(momentum=0.9)
as the coordinator applies them (the strategy's scale, its corrected momentum). Without
the correction the weights go nowhere; with it, they learn. (The whole system, where
staleness comes from real timing: benchmarks/async_remedy.py.)"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch._dynamo  # noqa: F401 (a first optimizer imports it: seconds, paid here, not timed)
from specs import load_example

from tensorbus.strategies import Async, Sync
from tensorbus.strategies.base import Apply, Arrived, Joined

pytestmark = pytest.mark.timeout(30)  # (about 1 s alone)

digits = load_example("digits")
WORKERS, LR, MOMENTUM, BATCH = 4, 0.1, 0.9, 16


def _epochs(shard: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    while True:  # each iter() of a Shards is the next epoch
        yield from shard


def _train_stale(correct: bool, versions: int = 240) -> float:
    """The loss on the training set after `versions` stale updates (inf once not finite)."""
    torch.manual_seed(0)
    model = digits.model()
    strategy = Async(workers=WORKERS, momentum_correction=correct)
    for rank in range(WORKERS):
        strategy.handle(Joined(rank, 0.0))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR,
                                momentum=strategy.corrected_momentum(MOMENTUM))
    shards = [_epochs(digits.data(rank, WORKERS, BATCH)) for rank in range(WORKERS)]
    seen: deque[list[torch.Tensor]] = deque(maxlen=WORKERS)  # the last versions' weights
    stale = digits.model()  # holds the weights `rank` computed on: WORKERS - 1 versions back
    for version in range(versions):
        seen.append([p.detach().clone() for p in model.parameters()])
        rank = version % WORKERS
        inputs, targets = next(shards[rank])
        with torch.no_grad():
            for p, w in zip(stale.parameters(), seen[0], strict=True):
                p.copy_(w)
                p.grad = None
        digits.loss(stale(inputs), targets).backward()
        (apply,) = [d for d in strategy.handle(Arrived(rank, version - len(seen) + 1, 1.0))
                    if isinstance(d, Apply)]
        with torch.no_grad():
            for p, g in zip(model.parameters(), stale.parameters(), strict=True):
                p.grad = g.grad * apply.scale
        optimizer.step()
    shard = digits.data(0, 1, BATCH)
    x, y = shard.x, shard.y
    with torch.no_grad():
        loss = float(digits.loss(model(x), y))
    return loss if math.isfinite(loss) else math.inf


def _initial_loss() -> float:
    torch.manual_seed(0)
    model = digits.model()
    shard = digits.data(0, 1, BATCH)
    with torch.no_grad():
        return float(digits.loss(model(shard.x), shard.y))


def test_stale_updates_make_no_progress_without_the_correction_and_learn_with_it() -> None:
    assert Sync(workers=WORKERS).corrected_momentum(MOMENTUM) == MOMENTUM  # (sync: as asked)
    start = _initial_loss()  # about 2.3: chance on 10 classes
    plain = _train_stale(correct=False, versions=480)
    corrected = _train_stale(correct=True, versions=480)
    assert plain > 0.9 * start, (plain, start)  # momentum 0.9 on stale gradients: stuck
    assert corrected < 0.5 * start, (corrected, start)
