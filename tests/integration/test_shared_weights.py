"""Versions broadcast by reference to the workers of the coordinator's host (bus.shared.SharedWeightPool).

Unit: a shared weight pool's sets, their generation counters as a reader sees them, and the pool that
bumps them before it writes a set again. In one loop, over real ZeroMQ: workers load every
version of sync from the coordinator's shared memory and end with the bits of workers that
take bytes; a copy torn by a rewrite is thrown away and the version pulled; async loads by
reference too; nothing is left in /dev/shm. (Multi-process: tests/system/test_local.py.)
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
import torch
from test_fold import LR, _model, _worker
from test_shared import _ours

from tensorbus.bus.buffers import SendBuffers
from tensorbus.bus.codec import decode, encode
from tensorbus.bus.messages import Weights
from tensorbus.bus.shared import ROOT, SegmentCache, SharedWeightPool
from tensorbus.nodes import Coordinator, CoordinatorConfig, Worker
from tensorbus.nodes.faults import Faults
from tensorbus.nodes.worker import COPY_AFTER_REDO, ComputeError, WorkerReport
from tensorbus.strategies import Async, Sync

pytestmark = pytest.mark.skipif(not ROOT.is_dir() or not SharedWeightPool.usable(),
                                reason="no /dev/shm, or not x86-64 (weights go as bytes)")


def test_a_reader_sees_a_sets_generation_go_up_when_it_is_to_be_written_again() -> None:
    shared_pool = SharedWeightPool()
    try:
        a, b = shared_pool.allocate([(1000, torch.float32), (10, torch.float64)])
        assert not a.any() and not b.any()
        ref = shared_pool.locate(a)
        assert ref is not None and ref[1] == 4096  # after the counter's page
        assert shared_pool.generation((a, b)) == shared_pool.generation((a[500:],)) == 0
        assert shared_pool.generation((torch.zeros(3),)) is None
        a.fill_(1.5)
        frames = encode(Weights(version=1, generation=0, tensors=(a, b)), refer=shared_pool.locate)
        assert len(frames) == 1  # the header alone: no bytes
        segments = SegmentCache(kept=1)
        seen = decode(frames, segments=segments)
        assert bool((seen.tensors[0] == 1.5).all())
        first = seen.tensors[0]
        assert isinstance(first, torch.Tensor) and SegmentCache.generation(first) == 0
        shared_pool.bump((a[10:20],))  # a range of the set: the whole set's counter
        assert SegmentCache.generation(first) == shared_pool.generation((b,)) == 1
        # Once the cache has let go of the mapping (another set mapped), the view still
        # reads the counter of its own: nothing reads as torn that was not.
        (other,) = shared_pool.allocate([(4, torch.float32)])
        decode(encode(Weights(version=2, tensors=(other,)), refer=shared_pool.locate), segments=segments)
        assert not segments.holds(first) and SegmentCache.generation(first) == 1
        shared_pool.release((a, b))
        assert str(ref[0]) not in _ours()
        assert bool((seen.tensors[0] == 1.5).all())  # the reader's mapping outlives the file
        assert shared_pool.generation((a, b)) is None
    finally:
        shared_pool.close()


def test_a_shared_pool_reuses_the_set_released_longest_ago_and_bumps_it_first() -> None:
    made: list[tuple[torch.Tensor, ...]] = []
    reused: list[int] = []
    dropped: list[int] = []

    def allocate() -> tuple[torch.Tensor, ...]:
        made.append((torch.full((4,), float(len(made))),))
        return made[-1]

    pool = SendBuffers(allocate, keep=2, reused=lambda s: reused.append(int(s[0][0])),
                       dropped=lambda s: dropped.append(int(s[0][0])))
    sets = [pool.take() for _ in range(5)]
    for s in sets:
        pool.release(s, [])
    again = pool.take()  # four are kept free, the fifth let go of; the oldest, 0, reused
    assert (len(made), dropped, reused, int(again[0][0])) == (5, [4], [0], 0)
    pool.release(again, [])
    assert [int(pool.take()[0][0]) for _ in range(3)] == [1, 2, 3]  # 0 came back last
    assert reused == [0, 1, 2, 3] and len(made) == 5
    assert int(pool.take()[0][0]) == 5  # one free only (keep - 1): a new set; 0 waits
    assert reused == [0, 1, 2, 3] and len(made) == 6


# In one loop, over real ZeroMQ ------------------------------------------------------------

def _train(strategy: Any, *, shared: bool, steps: int = 8, tear: bool = False,
           rewrite: bool = False, slow_s: float = 0.0,
           ) -> tuple[list[torch.Tensor], list[WorkerReport], int, list[int]]:
    """Train 2 workers; the coordinator's final weights, the workers' reports, how many
    weight sets the coordinator made in shared memory, and how many computes each worker
    made on the coordinator's set itself (in place). With `tear`, worker 0's first copy of
    a version by reference is spoilt as a rewrite of the set would spoil it: NaN, and the
    set's generation moved on; with `rewrite`, the generation of the set its first compute
    in place reads moves on during that compute. `slow_s`: worker 0 sleeps that long before
    each step."""
    made = [0]
    in_place = [0, 0]
    allocate = SharedWeightPool.allocate

    def counted(self: SharedWeightPool, buckets: Any) -> tuple[torch.Tensor, ...]:
        made[0] += 1
        return allocate(self, buckets)

    async def scenario() -> tuple[list[torch.Tensor], list[WorkerReport]]:
        coordinator = Coordinator(
            model=_model(), strategy=strategy, config=CoordinatorConfig(batch_size=8, steps=steps),
            optimizer=lambda ps: torch.optim.SGD(ps, lr=LR))
        endpoint = coordinator.bind()
        workers = [_worker(endpoint, r, None, shared_memory=shared,
                           faults=Faults(slow_s=slow_s if r == 0 else 0.0))
                   for r in (0, 1)]
        if tear:
            _tear_first_copy(workers[0], coordinator)
        if rewrite:
            _rewrite_first_set(workers[0], coordinator)
        _, *reports = await asyncio.gather(coordinator.run(), *(w.run() for w in workers))
        return [w.clone() for w in coordinator.flat.weights], reports

    compute = Worker._compute

    def checked(self: Worker, latest: list[Any], *args: Any) -> Any:
        # The compute thread never loads weights by reference (Link.load_shared does).
        for link, newer in zip(self.links, latest, strict=True):
            if newer is not None and newer.weights is not None and link._segments is not None:
                assert not link._segments.holds(newer.weights.tensors[0])
        segments = self.links[0]._segments
        if segments is not None and segments.holds(self.flat.weights[0]):
            assert self._in_place.on_set is not None and latest == [None]
            in_place[self.rank] += 1
        return compute(self, latest, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SharedWeightPool, "allocate", counted)
        patch.setattr(Worker, "_compute", checked)
        weights, reports = asyncio.run(scenario())
    return weights, reports, made[0], in_place


def _tear_first_copy(worker: Worker, coordinator: Coordinator) -> None:
    link = worker.links[0]
    load = link.versions.load  # (what load_shared calls)
    torn: list[int] = []

    def tearing(weights: Any) -> None:
        load(weights)
        first = weights.tensors[0] if isinstance(weights, Weights) and weights.tensors else None
        segments = link._segments
        if not torn and segments is not None and isinstance(first, torch.Tensor) and segments.holds(first):
            torn.append(weights.version)
            with torch.no_grad():
                for w in worker.flat.weights:
                    w.fill_(math.nan)
            assert coordinator._shared_pool is not None and coordinator.master.snapshot is not None
            coordinator._shared_pool.bump(coordinator.master.snapshot.buffers)

    link.versions.load = tearing  # type: ignore[method-assign]


def _rewrite_first_set(worker: Worker, coordinator: Coordinator) -> None:
    """Move the generation of the set worker's first compute in place reads, during it."""
    take = worker._data.next
    done: list[int] = []

    def rewriting() -> tuple[torch.Tensor, torch.Tensor]:
        on = worker._in_place.on_set
        if not done and on is not None:
            done.append(on.weights.version)
            # In sync, the set of the version computed on is the coordinator's snapshot.
            assert coordinator._shared_pool is not None and coordinator.master.snapshot is not None
            coordinator._shared_pool.bump(coordinator.master.snapshot.buffers)
            assert SegmentCache.generation(on.first) != on.generation
        return take()

    worker._data.next = rewriting  # type: ignore[method-assign]


def test_sync_loads_every_version_by_reference_with_the_bits_of_bytes() -> None:
    before = _ours()
    want, plain, _, none = _train(Sync(workers=2), shared=False)
    got, reports, made, in_place = _train(Sync(workers=2), shared=True, steps=8)
    assert all((r.final_version, r.by_reference, r.torn) == (8, 0, 0) for r in plain)
    # Each version, the last one included (loaded once stopped), from the shared set.
    assert all((r.final_version, r.by_reference, r.torn) == (8, 8, 0) for r in reports)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert made <= 6  # a few sets, reused: none a version
    assert _ours() == before  # the coordinator's sets are unlinked
    # Every compute but the first (on the Welcome's weights) on the coordinator's set; and
    # one more where a worker began a compute on the last version before the stop came.
    assert none == [0, 0]
    assert all(n in (r.pushes - 1, r.pushes) for n, r in zip(in_place, reports, strict=True))


def test_a_torn_copy_is_thrown_away_and_the_version_pulled_as_bytes() -> None:
    before = _ours()
    want, _, _, _ = _train(Sync(workers=2), shared=False)
    got, reports, _, _ = _train(Sync(workers=2), shared=True, tear=True)
    # Worker 1 reads the same set: torn too if it checks the counter after the bump.
    assert (reports[0].by_reference, reports[0].torn) == (7, 1)
    assert reports[1].by_reference + reports[1].torn == 8
    assert all(r.final_version == 8 for r in reports)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))  # no NaN got in
    assert _ours() == before


def test_async_loads_versions_by_reference_and_makes_no_set_a_version() -> None:
    before = _ours()
    weights, reports, made, _ = _train(Async(workers=2), shared=True, steps=40)
    assert all(r.by_reference >= 1 for r in reports)
    assert sum(r.by_reference for r in reports) >= 10
    assert all(bool(torch.isfinite(w).all()) for w in weights)
    assert made <= 8
    assert _ours() == before


def test_a_compute_on_a_set_written_meanwhile_is_done_again_on_a_copy_with_the_same_batch() -> None:
    before = _ours()
    want, _, _, _ = _train(Sync(workers=2), shared=False)
    got, reports, _, in_place = _train(Sync(workers=2), shared=True, rewrite=True)
    # Worker 1 computes on the same set: done again too if it read the counter after.
    assert reports[0].redone == 1 and reports[1].redone <= 1
    # Every compute in place (the one done again too) but the first, on the Welcome's
    # weights, and the 2 after the redo (COPY_AFTER_REDO), the first of which pulled the
    # version it was computed on; and one more where the worker began a compute on the
    # last version before the stop came.
    first, _ = COPY_AFTER_REDO
    assert in_place[0] - (reports[0].pushes + 1 - 1 - first) in (0, 1)
    assert reports[0].torn >= 1  # (the version given back, its copy found torn: pulled)
    assert all(r.final_version == 8 for r in reports)
    # The same bits as with bytes: nothing computed on the set was pushed, and the batch
    # was computed again on the version's own weights.
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert _ours() == before


@pytest.mark.exclusive  # its figures need the machine to itself
def test_async_with_a_worker_slower_than_the_sets_are_reused_redoes_few_computes() -> None:
    before = _ours()
    weights, reports, _, in_place = _train(Async(workers=2), shared=True, steps=60, slow_s=0.03)
    slow, fast = reports
    assert slow.redone >= 1  # its sets were written again while it slept on them
    # After each, twice as many computes as after the last copy their weights in, from
    # COPY_AFTER_REDO's first: few thrown away.
    first, _ = COPY_AFTER_REDO
    assert slow.redone <= 1 + math.log2(1 + slow.pushes / first)
    assert fast.redone == 0 and in_place[1] >= 10
    assert all(bool(torch.isfinite(w).all()) for w in weights)
    assert _ours() == before


def test_a_worker_that_fails_while_computing_in_place_gets_its_own_weights_back() -> None:
    """Its model, bound to the coordinator's set (mapped read-only), holds its own buffers
    again once run() has raised, with the weights it computed on: writable from Python."""
    async def scenario() -> tuple[Worker, BaseException | None, list[torch.Tensor]]:
        coordinator = Coordinator(
            model=_model(), strategy=Sync(workers=1), config=CoordinatorConfig(batch_size=8, steps=50),
            optimizer=lambda ps: torch.optim.SGD(ps, lr=LR))
        worker = _worker(coordinator.bind(), 0, None, shared_memory=True)
        loss, calls = worker._local_steps.loss, [0]

        def failing(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            calls[0] += 1
            if calls[0] == 4:  # on version 3, in place (1: the Welcome's, copied)
                raise RuntimeError("boom")
            return loss(out, target)

        worker._local_steps.loss = failing
        running = asyncio.create_task(coordinator.run())
        try:
            await worker.run()
            failure = None
        except Exception as e:  # noqa: BLE001 - what it raised is checked below
            failure = e
        last = [w.clone() for w in coordinator.flat.weights]
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        return worker, failure, last

    before = _ours()
    worker, failure, last = asyncio.run(scenario())
    assert isinstance(failure, ComputeError) and "boom" in str(failure)
    assert worker._in_place.on_set is None and worker.flat.weights is worker._in_place.own
    segments = worker.links[0]._segments
    assert segments is not None and not segments.holds(worker.flat.weights[0])
    assert all(torch.equal(a, b) for a, b in zip(worker.flat.weights, last, strict=True))
    for param in worker._model.parameters():
        param.data.add_(1.0)  # (in the read-only mapping, this would be a SIGSEGV)
    assert _ours() == before
