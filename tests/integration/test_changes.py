"""Versions broadcast as what changed (nodes.changes, bus.messages.Changes), under top-k.

Unit: the coordinator's `Differ` lists exactly the elements that differ bit for bit (a
sign of zero included), and applying what it lists to the old weights gives the new ones
bit for bit; past its limit it answers None (the whole version goes out). With plain SGD
the coordinator steps on a top-k update at its k elements only (`plain_sgd_lr` says when),
which gives the weights the full step gives, and `Touched` lists what those steps wrote:
the next Changes, with no comparison. A worker's
`Link` chains Changes that follow on, loads them in order, keeps aside those that do not
(and asks for the whole version), chains those on once it has it, ignores old ones and
refuses indices out of range.

Integration (one loop, real ZeroMQ): async with top-k pushes broadcasts Changes, and
every worker ends holding the coordinator's final weights, bit for bit, also when a
broadcast is lost on the way (the worker pulls the whole version and goes on).

Multi-process: `tensorbus local --strategy async --compress topk:R` trains digits.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
import zygote
from specs import load_example

from tensorbus.bus.layout import Layout
from tensorbus.bus.messages import Changes, Kind, Phase, Weights
from tensorbus.bus.transport import TOPIC_ALL, TOPIC_SHARED
from tensorbus.nodes import Coordinator, CoordinatorConfig, Worker, WorkerConfig
from tensorbus.nodes.changes import GIVE_UP, Differ, Touched, apply, out_of_range, plain_sgd_lr
from tensorbus.nodes.link import Link
from tensorbus.strategies import Async, Sync

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
digits = load_example("digits")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(bits), b.view(bits))


# Unit: finding and applying --------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_the_differ_lists_exactly_what_changed_and_applying_it_gives_the_new_weights(
        dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    old = (torch.randn(5000, generator=generator).to(dtype), torch.randn(300, generator=generator).to(dtype))
    new = tuple(t.clone() for t in old)
    new[0][[3, 700, 4999]] += 1.0
    old[0][11], new[0][11] = 0.0, -0.0  # equal as numbers, not as bits: a change
    differ = Differ([Layout.of([("a", old[0])]).buckets[0], Layout.of([("b", old[1])]).buckets[0]])
    found = differ(new, old)
    assert found is not None
    assert found[0].tolist() == [3, 11, 700, 4999] and found[2].tolist() == []
    assert found[1].dtype == dtype and _same_bits(found[1], new[0][found[0]])
    rebuilt = tuple(t.clone() for t in old)
    apply(rebuilt, found)
    assert all(_same_bits(a, b) for a, b in zip(rebuilt, new, strict=True))


def test_past_its_limit_the_differ_answers_none() -> None:
    layout = Layout.of([("w", torch.zeros(1000))])
    old = (torch.zeros(1000),)
    differ = Differ(layout.buckets, most=0.25)
    assert differ((torch.ones(1000),), old) is None  # everything changed: send it whole
    some = torch.zeros(1000)
    some[:250] = 1.0
    found = differ((some,), old)
    assert found is not None and found[0].numel() == 250


def test_the_differ_gives_up_after_versions_in_a_row_that_change_too_much() -> None:
    layout = Layout.of([("w", torch.zeros(100))])
    differ = Differ(layout.buckets)
    old, few, every = (torch.zeros(100),), (torch.zeros(100),), (torch.ones(100),)
    few[0][7] = 1.0
    for _ in range(GIVE_UP - 1):
        assert differ(every, old) is None
    assert differ(few, old) is not None  # not in a row: counted anew
    for _ in range(GIVE_UP):
        assert differ(every, old) is None
    assert differ(few, old) is None  # given up: it no longer compares


def test_indices_out_of_range_are_named() -> None:
    layout = Layout.of([("w", torch.zeros(10))])
    assert out_of_range(layout, (torch.tensor([0, 9]), torch.zeros(2))) is None
    assert out_of_range(layout, (torch.tensor([0, 10]), torch.zeros(2))) == (
        "bucket 0: indices from 0 to 10, the bucket has 10 elements")
    assert "from -1" in str(out_of_range(layout, (torch.tensor([-1]), torch.zeros(1))))


# Unit: a worker's link -----------------------------------------------------------------


@dataclass
class _Owner:
    rank: int = 0
    phase: Phase = Phase.COMPUTING
    clock: int = 0

    def end_session(self, why: Exception) -> None:
        raise AssertionError(f"no session to end: {why}")


def _link() -> tuple[Link, torch.Tensor]:
    weights = torch.zeros(8)
    layout = Layout.of([("w", weights)])
    return Link("tcp://127.0.0.1:1", layout.shard(0, 1), (weights,), _Owner(),
                request_timeout_s=1.0), weights


def _change(base: int, version: int, at: list[int], value: float) -> Changes:
    return Changes(version=version, base=base,
                   tensors=(torch.tensor(at), torch.full((len(at),), value)))


def test_a_link_chains_changes_and_loads_them_in_order() -> None:
    link, weights = _link()
    link.versions.take_changes(_change(0, 1, [0, 1], 1.0))
    link.versions.take_changes(_change(1, 2, [1, 2], 2.0))
    assert link.versions.newest() == 2 and link.version == 0
    newer = link.versions.latest()
    assert newer is not None and newer.version == 2 and newer.weights is None
    link.versions.load(newer)
    link.versions.forget_loaded()
    assert weights.tolist() == [1, 2, 2, 0, 0, 0, 0, 0] and link.version == 2
    assert link.versions.latest() is None and link.versions._changes == []
    link.versions.take_changes(_change(1, 2, [5], 9.0))  # old: ignored
    assert link.versions.latest() is None and weights[5] == 0


def test_a_missed_change_is_made_up_for_by_the_whole_version() -> None:
    link, weights = _link()
    link.versions.take_changes(_change(0, 1, [0], 1.0))
    link.versions.take_changes(_change(2, 3, [3], 3.0))  # 1 -> 2 was missed
    link.versions.take_changes(_change(3, 4, [4], 4.0))
    # Kept aside; the whole one is asked for.
    assert link.versions._missed.is_set() and link.versions.newest() == 1
    link.versions.keep_newest(Weights(version=2, tensors=(torch.arange(8, dtype=torch.float32),)))
    assert link.versions.newest() == 4 and link.versions._aside == {}  # the two kept aside follow on now
    link.versions.load_latest()
    assert weights.tolist() == [0, 1, 2, 3, 4, 5, 6, 7] and link.version == 4


def test_a_whole_version_past_what_was_kept_aside_lets_it_go() -> None:
    link, weights = _link()
    link.versions.take_changes(_change(2, 3, [3], 3.0))
    link.versions.keep_newest(Weights(version=5, tensors=(torch.ones(8),)))
    assert link.versions._aside == {} and link.versions.newest() == 5
    link.versions.load_latest()
    assert weights.tolist() == [1.0] * 8


def test_changes_out_of_range_are_refused(caplog: pytest.LogCaptureFixture) -> None:
    link, _ = _link()
    link.versions.take_changes(_change(0, 1, [8], 1.0))
    versions = link.versions
    assert versions.newest() == 0 and not versions._missed.is_set() and versions.latest() is None
    assert "out of range" in caplog.text


# Unit: sparse steps and what they wrote ------------------------------------------------


def test_only_plain_sgd_over_the_model_steps_sparsely() -> None:
    model = torch.nn.Linear(4, 2)
    params = list(model.parameters())
    assert plain_sgd_lr(torch.optim.SGD(params, lr=0.3), params) == 0.3
    for other in (torch.optim.SGD(params, lr=0.3, momentum=0.9),
                  torch.optim.SGD(params, lr=0.3, weight_decay=1e-4),
                  torch.optim.SGD(params, lr=0.3, maximize=True),
                  torch.optim.SGD([{"params": params[:1]}, {"params": params[1:]}], lr=0.3),
                  torch.optim.SGD(params[:1], lr=0.3),  # not every parameter
                  torch.optim.Adam(params, lr=0.3),
                  None):
        assert plain_sgd_lr(other, params) is None
    hooked = torch.optim.SGD(params, lr=0.3)
    hooked.register_step_post_hook(lambda *_: None)  # it must see every step
    assert plain_sgd_lr(hooked, params) is None


def test_touched_lists_what_the_counted_versions_wrote() -> None:
    layout = Layout.of([("a", torch.zeros(10)), ("b", torch.zeros(3, dtype=torch.float64))])
    touched = Touched(layout.buckets, most=0.5)  # at most 6 elements listed
    now = (torch.arange(10.0), torch.arange(3.0, dtype=torch.float64))
    assert touched.changes(now, 0, 0) is None  # not counting yet
    touched.start(3)
    touched.add(0, torch.tensor([5, 1]))
    touched.made(4)
    touched.add(0, torch.tensor([1, 7]))
    touched.add(1, torch.tensor([2]))
    touched.made(5)
    found = touched.changes(now, 3, 5)
    assert found is not None
    assert found[0].tolist() == [1, 5, 7] and found[1].tolist() == [1.0, 5.0, 7.0]
    assert found[2].tolist() == [2] and found[3].dtype == torch.float64
    assert touched.changes(now, 4, 5) is None  # not from the version asked
    touched.made(7)  # version 6 was made some other way: what follows is not known
    assert touched.changes(now, 3, 7) is None
    touched.start(7)
    touched.add(0, torch.arange(7))  # more than worth listing
    touched.made(8)
    assert touched.changes(now, 7, 8) is None


def test_a_sparse_step_gives_the_weights_of_the_full_step() -> None:
    torch.manual_seed(0)

    def coordinator(momentum: float) -> Coordinator:
        torch.manual_seed(0)
        return Coordinator(
            model=torch.nn.Linear(50, 40), strategy=Sync(workers=2), lr=0.1,
            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=momentum),
            config=CoordinatorConfig(batch_size=4, steps=1, compress="topk:0.1"))

    sparse, full = coordinator(0.0), coordinator(1e-30)  # (a momentum steps over everything)
    assert all(torch.equal(a, b) for a, b in zip(sparse.flat.weights, full.flat.weights, strict=True))
    n = sparse.flat.weights[0].numel()
    updates = [(torch.randperm(n)[:204], torch.randn(204)) for _ in range(2)]
    sparse.master.touched.start(0)  # type: ignore[union-attr]
    grads_before = sparse.flat.grads[0].clone()
    sparse.master.step(updates, 0.5, version=1)
    full.master.step(updates, 0.5, version=1)
    assert torch.allclose(sparse.flat.weights[0], full.flat.weights[0], rtol=0, atol=1e-7)
    assert torch.equal(sparse.flat.grads[0], grads_before)  # no pass over a dense gradient
    changes = sparse.master.touched.changes(sparse.flat.weights, 0, 1)  # type: ignore[union-attr]
    assert changes is not None
    written = torch.cat([u[0] for u in updates]).unique()
    assert torch.equal(changes[0], written)
    assert torch.equal(changes[1], sparse.flat.weights[0][written])


def test_a_plain_sgd_step_on_dense_updates_is_the_optimizers_without_its_buffers() -> None:
    """Plain SGD folds the updates into the weights one after the other (nodes.fold): the
    optimizer's step up to the rounding of each addition; the gradient buffers untouched."""
    def coordinator(hooked: bool) -> Coordinator:
        torch.manual_seed(0)

        def sgd(ps: Any) -> torch.optim.Optimizer:
            optimizer = torch.optim.SGD(ps, lr=0.1)
            if hooked:  # a step hook: the optimizer's own step must run
                optimizer.register_step_post_hook(lambda *_: None)
            return optimizer

        return Coordinator(model=torch.nn.Linear(50, 40), strategy=Sync(workers=2), lr=0.1,
                           optimizer=sgd, config=CoordinatorConfig(batch_size=4, steps=1))

    plain, full = coordinator(False), coordinator(True)
    n = plain.flat.weights[0].numel()
    updates = [(torch.randn(n),), (torch.randn(n).to(torch.bfloat16),)]
    grads_before = plain.flat.grads[0].clone()
    plain.master.step(updates, 0.5, version=1)  # type: ignore[arg-type]
    full.master.step(updates, 0.5, version=1)  # type: ignore[arg-type]
    torch.testing.assert_close(plain.flat.weights[0], full.flat.weights[0], rtol=0, atol=1e-6)
    assert not torch.equal(plain.flat.weights[0], coordinator(False).flat.weights[0])  # it stepped
    want = coordinator(False).flat.weights[0].clone()
    for update in updates:
        want.add_(update[0], alpha=-0.1 * 0.5 / 2)
    assert torch.equal(plain.flat.weights[0], want)
    assert torch.equal(plain.flat.grads[0], grads_before)  # through a block, not the buffers


# Integration: one loop, real sockets ----------------------------------------------------


def _published_kinds(coordinator: Coordinator, *, lose: int | None = None) -> list[str]:
    """Watch the coordinator's broadcasts (their kinds, in order); with `lose`, do not
    send the Changes of that version: as if the PUB had dropped it."""
    assert coordinator._serving.server is not None
    server = coordinator._serving.server
    publish = server.publish
    kinds: list[str] = []

    async def watched(frames: Any, topic: bytes = TOPIC_ALL) -> Any:
        header = msgpack.unpackb(frames[0])
        kind = Kind(header["k"]).name
        if kind == "CHANGES" and header["v"] == lose:
            kinds.append("LOST")
            return None
        if topic != TOPIC_SHARED:  # (whole weights go twice: by reference too)
            kinds.append(kind)
        return await publish(frames, topic)

    server.publish = watched  # type: ignore[method-assign]
    return kinds


@pytest.mark.parametrize("lose", [None, 6], ids=["all-arrive", "one-lost"])
def test_async_topk_broadcasts_changes_and_every_worker_ends_with_the_final_weights(
        lose: int | None, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="tensorbus.worker")

    async def scenario() -> None:
        torch.manual_seed(0)
        coordinator = Coordinator(
            model=digits.model(), strategy=Async(workers=2), lr=0.1,
            config=CoordinatorConfig(batch_size=16, steps=40, compress="topk:0.05",
                                     heartbeat_s=0.2, timeout_s=5.0))
        endpoint = coordinator.bind()
        kinds = _published_kinds(coordinator, lose=lose)
        workers = [Worker(model=digits.model(), data=digits.data, loss=digits.loss,
                          config=WorkerConfig(connect=endpoint)) for _ in range(2)]
        summary, *reports = await asyncio.gather(coordinator.run(), *(w.run() for w in workers))
        assert summary["steps"] == 40
        assert kinds.count("CHANGES") >= 10  # versions went out as their changes
        pulled = caplog.text.count("missed a version after")
        if lose is None:
            assert pulled == 0
        else:
            assert "LOST" in kinds and pulled == 2  # each worker made up for it once
        for worker, report in zip(workers, reports, strict=True):
            assert report.final_version == 40
            assert all(_same_bits(a, b) for a, b in
                       zip(worker.flat.weights, coordinator.flat.weights, strict=True))

    asyncio.run(scenario())


# Multi-process ---------------------------------------------------------------------------


@pytest.mark.system  # it starts processes
def test_local_async_with_topk_trains(tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    command = ["local", str(ROOT / "examples" / "digits.py"),
               "--workers", "2", "--strategy", "async", "--compress", "topk:0.05",
               "--steps", "300", "--batch-size", "16", "--lr", "0.1", "--metrics", str(metrics),
               "--threads", "1", "--no-progress", "--heartbeat", "0.2", "--timeout", "5"]
    result = zygote.tensorbus(*command, timeout=100)
    assert result.returncode == 0, result.stderr
    summary = json.loads(metrics.read_text().splitlines()[-1])
    assert (summary["strategy"], summary["steps"], summary["dropped"]) == ("async", 300, {})
    assert summary["accuracy"] > 0.8
