"""Sharded parameter servers: S coordinator shards, each owning a range of the flat
parameters, train the same weights as one coordinator (sync: to 1e-5), in one event loop
over real ZeroMQ on loopback; and the ranges are cut right (unit)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import zygote
from cluster import ANY_PORT, bound_in_log
from equivalence import BATCH, digits, initial, max_difference, sgd
from zygote import Forked

from tensorbus.bus.layout import Layout
from tensorbus.nodes import Coordinator, CoordinatorConfig, Worker, WorkerConfig
from tensorbus.nodes.shards import ShardModel, assemble
from tensorbus.strategies import Async, PeriodicAveraging, StaleSync, Strategy, Sync

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "examples" / "digits.py"


def _train(make: type[Strategy] | Strategy, shards: int, steps: int, workers: int = 2,
           **options: object) -> tuple[torch.nn.Module, list[dict]]:
    """Train with `shards` coordinator shards (1: one plain coordinator) and in-loop
    workers; return the assembled model and the shards' summaries."""

    async def train() -> tuple[torch.nn.Module, list[dict]]:
        models = ([initial()] if shards == 1
                  else [ShardModel(initial(), i, shards) for i in range(shards)])
        coordinators = [
            Coordinator(model=m, strategy=make(workers=workers, **options), optimizer=sgd,
                        config=CoordinatorConfig(batch_size=BATCH, steps=steps))
            for m in models]
        endpoints = [c.bind() for c in coordinators]
        worker_list = [
            Worker(model=digits.model(), data=digits.data, loss=digits.loss, optimizer=sgd,
                   config=WorkerConfig(connect=endpoints, rank=rank))
            for rank in range(workers)]
        results = await asyncio.gather(*(c.run() for c in coordinators),
                                       *(w.run() for w in worker_list))
        model = models[0] if shards == 1 else assemble(initial(), models)
        return model, list(results[:shards])

    return asyncio.run(train())


@pytest.mark.parametrize("shards", [2, 3])
def test_sync_shards_give_the_weights_of_one_coordinator(shards: int) -> None:
    one, _ = _train(Sync, 1, steps=6)
    sharded, summaries = _train(Sync, shards, steps=6)
    assert [s["steps"] for s in summaries] == [6] * shards
    assert max_difference(one, sharded) <= 1e-5
    assert max_difference(one, initial()) > 1e-3  # it did train


def test_average_shards_give_the_weights_of_one_coordinator() -> None:
    one, _ = _train(PeriodicAveraging, 1, steps=3, average_every=2)
    sharded, _ = _train(PeriodicAveraging, 2, steps=3, average_every=2)
    assert max_difference(one, sharded) <= 1e-5


@pytest.mark.parametrize("make", [StaleSync, Async])
def test_ssp_and_async_train_on_shards(make: type[Strategy]) -> None:
    model, summaries = _train(make, 2, steps=12)
    assert [s["steps"] for s in summaries] == [12, 12]
    assert max_difference(model, initial()) > 1e-3


# Units -----------------------------------------------------------------------------------


def _layout() -> Layout:
    return Layout.of([("a", torch.zeros(3, 4)), ("b", torch.zeros(5)),
                      ("c", torch.zeros(2, dtype=torch.float64))])


@pytest.mark.parametrize("count", [1, 2, 3, 5, 19])
def test_shards_cover_every_element_once(count: int) -> None:
    layout = _layout()
    covered = {b: [0] * bucket.numel for b, bucket in enumerate(layout.buckets)}
    sizes = []
    for i in range(count):
        shard = layout.shard(i, count)
        sizes.append(sum(s.numel for s in shard.spans))
        assert [b.numel for b in shard.layout.buckets] == [s.numel for s in shard.spans]
        for span in shard.spans:
            for k in range(span.start, span.stop):
                covered[span.bucket][k] += 1
    assert all(c == 1 for counts in covered.values() for c in counts)
    assert max(sizes) - min(sizes) <= 1  # nearly equal ranges


def test_shard_digests_name_the_model_and_the_shard() -> None:
    layout = _layout()
    assert layout.shard(0, 1).layout.digest == layout.digest  # one shard: the model itself
    digests = {layout.shard(i, n).layout.digest for n in (2, 3) for i in range(n)}
    assert len(digests) == 5
    other = Layout.of([("a", torch.zeros(3, 4)), ("b", torch.zeros(6))])
    assert other.shard(0, 2).layout.digest != layout.shard(0, 2).layout.digest


def test_too_many_shards_or_a_bad_index_is_refused() -> None:
    with pytest.raises(ValueError, match="20 shards for a model of 19 parameters"):
        _layout().shard(0, 20)
    with pytest.raises(ValueError, match="index must be in 0..2"):
        _layout().shard(3, 3)


def test_a_shard_model_puts_its_range_back() -> None:
    model = initial()
    shards = [ShardModel(model, i, 3) for i in range(3)]
    with torch.no_grad():
        for shard in shards:
            for p in shard.parameters():
                p.add_(1.0)
    rebuilt = assemble(initial(), shards)
    for a, b in zip(rebuilt.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b + 1.0)


def test_a_shard_refuses_evaluation_points() -> None:
    with pytest.raises(ValueError, match="a shard holds a range of it"):
        Coordinator(model=ShardModel(initial(), 0, 2), strategy=Sync(workers=1),
                    config=CoordinatorConfig(steps=1, eval_every_s=1.0))
    with pytest.raises(TypeError, match="computes nothing"):
        ShardModel(initial(), 0, 2)(torch.zeros(1, 64))


# Processes -------------------------------------------------------------------------------


def _summary(stdout: str) -> dict:
    return json.loads(stdout[stdout.index("{"):])


RUN = [sys.executable, "-m", "tensorbus"]
QUIET = ["--threads", "1", "--no-progress", "--json"]


@pytest.mark.timeout(120)
def test_local_with_shards_trains_the_weights_of_one_coordinator() -> None:
    """`tensorbus local --shards 3`: 3 coordinator shards in the launcher, 2 worker
    processes; sync is deterministic, so the evaluation of the assembled model is the
    unsharded run's, to the last digit."""
    figures = []
    for extra in ([], ["--shards", "3"]):
        done = zygote.shared().run(
            ["local", str(DIGITS), "--workers", "2", "--steps", "15", *QUIET, *extra],
            cwd=ROOT, capture_output=True, text=True, timeout=100, check=False)
        assert done.returncode == 0, done.stderr
        figures.append(_summary(done.stdout))
    one, sharded = figures
    assert sharded["shards"] == 3 and sharded["steps"] == 15
    assert sharded["accuracy"] == one["accuracy"]
    assert sharded["test_loss"] == pytest.approx(one["test_loss"], abs=1e-5)


@pytest.mark.timeout(120)
def test_shards_started_by_hand(tmp_path: Path) -> None:
    """`tensorbus coordinator --shard I/2` twice and workers with both addresses; a worker
    that gives them in the wrong order is refused with what to do."""
    processes: list[Forked] = []

    def start(*args: str, log: Path | None = None) -> Forked:
        with log.open("w") if log else open(os.devnull) as logged:
            process = zygote.shared().popen(
                [*args, *QUIET[:2]], cwd=ROOT, text=True, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=logged if log else subprocess.PIPE)
        processes.append(process)
        return process

    try:
        logs = [tmp_path / f"shard-{i}.log" for i in range(2)]
        shards = [start("coordinator", str(DIGITS), "--bind", ANY_PORT, "--workers", "2",
                        "--steps", "10", "--shard", f"{i}/2", "--no-progress", "--json",
                        "--join-timeout", "60", "--log-level", "info", log=logs[i])
                  for i in range(2)]
        endpoints = [bound_in_log(shard, log)[0] for shard, log in zip(shards, logs, strict=True)]
        wrong = start("worker", str(DIGITS), "--connect", f"{endpoints[1]},{endpoints[0]}",
                      "--join-timeout", "20")
        _, err = wrong.communicate(timeout=60)
        assert wrong.returncode == 1
        line = err.splitlines()[-1]  # the README's Errors row; the digests vary
        assert line.startswith("error: rejected (layout): this coordinator is shard 1 of 2 (layout ")
        assert line.endswith(": give the worker every shard's address in shard order (--connect "
                             "ADDR0,ADDR1,...), and the same SPEC everywhere")
        workers = [start("worker", str(DIGITS), "--connect", ",".join(endpoints), "--rank", str(r))
                   for r in range(2)]
        for w in workers:
            _, err = w.communicate(timeout=60)
            assert w.returncode == 0, err
        summaries = []
        for shard, log in zip(shards, logs, strict=True):
            out, _ = shard.communicate(timeout=60)
            assert shard.returncode == 0, log.read_text()
            summaries.append(_summary(out))
        assert [s["steps"] for s in summaries] == [10, 10]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.communicate()  # reaps it and closes its pipes
