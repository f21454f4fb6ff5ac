"""Integration: async-average in one event loop over real ZeroMQ. With one worker it is
average exactly (local SGD with int8 changes, worked out by hand), and with delayed
Nesterov it is that momentum by hand; with a straggler, the fast worker does not wait for
it, and every change pushed is applied at 1/W; with dynamic local steps, the straggler's H
shrinks to its speed and both push about as often."""

from __future__ import annotations

import asyncio
import json
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch
from equivalence import digits, initial
from test_quantized_average import _by_hand, _flat, _load, _sgd

from tensorbus.bus.quantize import VALUE_DTYPE, dequantize_add, quantize, sizes
from tensorbus.nodes import Coordinator, CoordinatorConfig, Worker, WorkerConfig
from tensorbus.nodes.faults import Faults
from tensorbus.strategies import AsyncAveraging

pytestmark = pytest.mark.timeout(30)


def _train(workers: int, h: int, b: int, steps: int, *, slow_s: tuple[float, ...] = (),
           compress: str = "", **options: Any) -> tuple[Coordinator, dict]:  # type: ignore[type-arg]
    async def train() -> tuple[Coordinator, dict]:  # type: ignore[type-arg]
        coordinator = Coordinator(
            model=initial(), strategy=AsyncAveraging(workers=workers, average_every=h, **options),
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


def _delayed_nesterov_by_hand(rounds: int, h: int, b: int, *, lr: float, mu: float,
                              every: int) -> torch.nn.Module:
    """One worker's int8 changes (as test_quantized_average's), each applied at 1/N by an
    outer SGD at `lr`, whose momentum takes their sum every N changes."""
    model = initial()
    shard = iter(digits.data(0, 1, b))
    published = _flat(model).clone()
    residual, total, momentum = (torch.zeros_like(published) for _ in range(3))
    for change_count in range(1, rounds + 1):
        _load(model, published)
        optimizer = _sgd(model.parameters())
        for _ in range(h):
            inputs, targets = next(shard)
            optimizer.zero_grad()
            digits.loss(model(inputs), targets).backward()
            optimizer.step()
        change = published - _flat(model)
        change.add_(residual)
        count, blocks = sizes(change.numel(), 8)
        values, scales = torch.empty(count, dtype=VALUE_DTYPE[8]), torch.empty(blocks)
        quantize(change, 8, values, scales)
        residual = change.clone()
        dequantize_add(residual, values, scales, 8, alpha=-1.0)
        # The coordinator: the change at 1/N from its weights, as a gradient.
        mean = published.clone()
        dequantize_add(mean, values, scales, 8, alpha=-1.0 / every)
        gradient = mean.sub_(published).neg_()
        published.add_(gradient, alpha=-lr)
        total.add_(gradient)
        if change_count % every == 0:
            momentum.mul_(mu).add_(total)
            published.add_(momentum, alpha=-lr * mu)
            total.zero_()
    _load(model, published)
    return model


def test_delayed_nesterov_takes_momentum_every_n_changes_by_hand() -> None:
    rounds, h, b, lr, mu, every = 5, 3, 8, 0.7, 0.9, 2
    coordinator, _ = _train(1, h, b, rounds, outer_lr=lr, outer_momentum=mu, momentum_every=every)
    want = _delayed_nesterov_by_hand(rounds, h, b, lr=lr, mu=mu, every=every)
    for (name, g), w in zip(coordinator.model.named_parameters(), want.parameters(), strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5, msg=f"parameter {name}")
    # The delayed momentum is in it: taken at every change instead, it ends elsewhere.
    every_change = _delayed_nesterov_by_hand(rounds, h, b, lr=lr, mu=mu, every=1)
    assert max((a - c).abs().max().item()
               for a, c in zip(want.parameters(), every_change.parameters(), strict=True)) > 1e-4


def _steps_a_push(tmp_path: Path, h: int, versions: int, slow_s: tuple[float, float],
                  ) -> dict[int, list[int]]:
    """Each worker's local steps behind each of its pushes (a version each: its samples
    over the batch), from a run with dynamic local steps."""
    metrics, b = tmp_path / "metrics.jsonl", 8

    async def train() -> None:
        coordinator = Coordinator(
            model=initial(), optimizer=_sgd,
            strategy=AsyncAveraging(workers=2, average_every=h, dynamic_steps=True),
            config=CoordinatorConfig(batch_size=b, steps=versions, metrics=metrics))
        endpoint = coordinator.bind()
        team = [Worker(model=digits.model(), data=digits.data, loss=digits.loss, optimizer=_sgd,
                       config=WorkerConfig(connect=endpoint, rank=rank,
                                           faults=Faults(slow_s=slow_s[rank])))
                for rank in range(2)]
        await asyncio.gather(coordinator.run(), *(w.run() for w in team))

    asyncio.run(train())
    steps: dict[int, list[int]] = {0: [], 1: []}
    for record in map(json.loads, metrics.read_text().splitlines()):
        if record["event"] == "step":
            (worker,) = record["workers"]
            steps[worker].append(record["samples"] // b)
    return steps


def test_dynamic_steps_scale_the_straggler_s_h_to_its_speed(tmp_path: Path) -> None:
    """Worker 1 sleeps 20 ms a step, worker 0 5 ms: worker 1's speed is about a quarter of
    worker 0's, so once its speed is known (after its first push, of H steps) it takes
    about H/4 steps a push, and pushes about as often as worker 0, which takes H (without
    dynamic steps it would push a quarter as often). About: the speeds are as timed on
    this machine, so the test takes medians."""
    h = 8
    steps = _steps_a_push(tmp_path, h, 24, (0.005, 0.02))
    assert statistics.median(steps[0]) == h, steps  # the fastest: H
    first, *then = steps[1]
    assert first == h and then and statistics.median(then) <= h / 2, steps
    assert len(steps[1]) >= 0.6 * len(steps[0]), steps
