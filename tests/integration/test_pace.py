"""Integration: the strategies' pace against a straggler, in one loop on a virtual clock.

Every worker is slowed by BASE_S a step and one of them by STRAGGLER_S more, waited out on
the event loop (nodes.faults), so the virtual clock (bus.clock) counts exactly that and
nothing else: the computes themselves take no virtual time. What took the machine to itself
with real processes (a pace is a measurement) is exact here, and runs beside other tests.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch
from specs import load_example

from tensorbus.bus.clock import LoopClock, run_virtual
from tensorbus.bus.memory import MemoryNetwork
from tensorbus.nodes import Coordinator, CoordinatorConfig, Worker, WorkerConfig
from tensorbus.nodes.faults import Faults
from tensorbus.strategies import Async, StaleSync, Strategy, Sync

pytestmark = pytest.mark.timeout(30)

digits = load_example("digits")

BASE_S, STRAGGLER_S = 0.03, 0.15  # every worker's step; the straggler's extra


def _run(tmp_path: Path, strategy: Strategy, steps: int, *, straggler: int | None = None,
         ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    metrics = tmp_path / f"metrics-{len(list(tmp_path.glob('metrics-*')))}.jsonl"

    async def train(clock: LoopClock) -> dict[str, Any]:
        network = MemoryNetwork()
        torch.manual_seed(0)
        coordinator = Coordinator(
            model=digits.model(), strategy=strategy, lr=0.05, transport=network.server,
            clock=clock, config=CoordinatorConfig(
                batch_size=8, steps=steps, heartbeat_s=0.2, timeout_s=5.0, shared_memory=False,
                metrics=metrics))
        endpoint = coordinator.bind()
        workers = [Worker(model=digits.model(), data=digits.data, loss=digits.loss,
                          config=WorkerConfig(connect=endpoint, shared_memory=False, rank=rank,
                                              faults=Faults(slow_s=BASE_S + (
                                                  STRAGGLER_S if rank == straggler else 0.0))),
                          transport=network.client, clock=clock)
                   for rank in range(strategy.workers)]
        summary, *_ = await asyncio.gather(coordinator.run(), *(w.run() for w in workers))
        return summary

    summary = run_virtual(train)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return summary, records


def _step_s(records: list[dict[str, Any]], skip: int = 5) -> float:
    """Median (virtual) seconds between versions, past the first few."""
    times = [r["train_s"] for r in records if r["event"] == "step"][skip:]
    return statistics.median(b - a for a, b in itertools.pairwise(times))


def _pushes(summary: dict[str, Any]) -> dict[int, int]:
    return {int(r): c["pushes"] for r, c in summary["per_worker"].items()}


def test_ssp_bounds_the_clock_gap_against_a_straggler(tmp_path: Path) -> None:
    s = 2
    summary, _ = _run(tmp_path, StaleSync(workers=3, staleness=s), 60, straggler=1)
    # The fast workers ran into the bound (they were held) and the bound held.
    assert summary["max_clock_gap"] == s + 1
    held = {int(r): c["held_s"] for r, c in summary["per_worker"].items()}
    assert held[0] > 0.5 and held[2] > 0.5 and held[1] == 0
    pushes = _pushes(summary)
    assert max(pushes.values()) - min(pushes.values()) <= s + 1
    assert min(pushes, key=pushes.get) == 1  # the straggler is the one behind
    assert summary["max_staleness"] >= 1


def test_ssp_with_staleness_zero_moves_in_lockstep(tmp_path: Path) -> None:
    summary, _ = _run(tmp_path, StaleSync(workers=3, staleness=0), 45, straggler=1)
    assert summary["max_clock_gap"] <= 1
    pushes = _pushes(summary)
    assert max(pushes.values()) - min(pushes.values()) <= 1


def test_backups_outrun_a_straggler_that_plain_sync_waits_for(tmp_path: Path) -> None:
    _, calm_records = _run(tmp_path, Sync(workers=4, backups=1), 40)
    backed, backed_records = _run(tmp_path, Sync(workers=4, backups=1), 40, straggler=1)
    plain, plain_records = _run(tmp_path, Sync(workers=4), 40, straggler=1)

    # With a backup, the straggler's gradients come late and are dropped; the pace holds.
    straggler = backed["per_worker"]["1"]
    assert straggler["dropped"] > 0 and straggler["applied"] < straggler["pushes"] / 2
    assert backed["dropped"].get("late", 0) >= straggler["dropped"] - backed["dropped"].get("stale", 0)
    calm_step, backed_step = _step_s(calm_records), _step_s(backed_records)
    assert calm_step == pytest.approx(BASE_S, abs=0.005)
    assert backed_step <= 1.25 * calm_step, (backed_step, calm_step)
    # Plain sync waits for the straggler on every version.
    assert plain["dropped"] == {}
    plain_step = _step_s(plain_records)
    assert plain_step == pytest.approx(BASE_S + STRAGGLER_S, abs=0.01), plain_step
    assert plain_step >= 2 * backed_step, (plain_step, backed_step)


def test_async_never_holds_a_worker_back(tmp_path: Path) -> None:
    summary, _ = _run(tmp_path, Async(workers=3), 80, straggler=1)
    assert all(c["held_s"] == 0 for c in summary["per_worker"].values())
    pushes = _pushes(summary)
    # The fast workers are not slowed by the straggler (30 ms against 180 ms a step).
    assert pushes[0] >= 3 * pushes[1] and pushes[2] >= 3 * pushes[1], pushes
    assert summary["max_clock_gap"] > 3  # nothing bounds it
    assert summary["max_staleness"] >= 1
    # Versions overtaken before the last broadcast left are not sent: never more than made.
    assert 1 <= summary["broadcasts"] <= summary["steps"] + 1
