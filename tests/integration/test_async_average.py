"""Integration: async-average in one event loop over real ZeroMQ. With one worker it is
average exactly (local SGD with int8 changes, worked out by hand); with a straggler, the
fast worker does not wait for it, and every change pushed is applied at 1/W."""

from __future__ import annotations

import asyncio

import pytest
import torch
from equivalence import digits, initial
from test_quantized_average import _by_hand, _sgd

from tensorbus.nodes import Coordinator, CoordinatorConfig, Worker, WorkerConfig
from tensorbus.nodes.faults import Faults
from tensorbus.strategies import AsyncAveraging

pytestmark = pytest.mark.timeout(30)


def _train(workers: int, h: int, b: int, steps: int, *, slow_s: tuple[float, ...] = (),
           compress: str = "") -> tuple[Coordinator, dict]:  # type: ignore[type-arg]
    async def train() -> tuple[Coordinator, dict]:  # type: ignore[type-arg]
        coordinator = Coordinator(
            model=initial(), strategy=AsyncAveraging(workers=workers, average_every=h),
            optimizer=_sgd, evaluate=digits.evaluate,
            config=CoordinatorConfig(batch_size=b, steps=steps, compress=compress))
        endpoint = coordinator.bind()
        team = [Worker(model=digits.model(), data=digits.data, loss=digits.loss, optimizer=_sgd,
                       config=WorkerConfig(connect=endpoint, rank=rank,
                                           faults=Faults(slow_s=slow_s[rank] if slow_s else 0.0)))
                for rank in range(workers)]
        results = await asyncio.gather(coordinator.run(), *(w.run() for w in team))
        return coordinator, results[0]

    return asyncio.run(train())


def test_with_one_worker_it_is_average_with_int8_changes_by_hand() -> None:
    rounds, h, b = 4, 3, 8
    coordinator, summary = _train(1, h, b, rounds)
    assert coordinator.config.compress == "int8"  # (the default: pushes are changes)
    assert summary["steps"] == rounds
    want = _by_hand(8, 1, rounds, h, b)
    for (name, g), w in zip(coordinator.model.named_parameters(), want.parameters(), strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5, msg=f"parameter {name}")


def test_the_fast_worker_does_not_wait_for_the_straggler() -> None:
    """Worker 1 takes 50 ms more a local step: worker 0 pushes several times as often, each
    push is a version of its own, and the run learns (the initial model's test loss is 2.3,
    ln 10, and its accuracy 10 %: guesses among the 10 digits; this run gets about 50 %)."""
    coordinator, summary = _train(2, 4, 16, 40, slow_s=(0.0, 0.05), compress="int4")
    pushes = {rank: w["pushes"] for rank, w in summary["per_worker"].items()}
    assert summary["steps"] == 40
    assert sum(pushes.values()) >= 40  # each push applied is a version
    assert pushes["0"] >= 2 * pushes["1"], pushes  # (about 4 times, unloaded)
    assert summary["test_loss"] < 2.2 and summary["accuracy"] > 0.3, summary
