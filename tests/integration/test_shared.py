"""Tensors by reference (bus.shared): segments, the codec's references, and training with them.

Unit: a shared allocator's buffers and where they lie, a segment cache reading them (and refusing what is not
ours to read), the host token, a killed creator's segment unlinked by the resource tracker, the
codec. In one loop: sync over real ZeroMQ pushes by reference and makes the same bits as
with bytes (a NaN push dropped alike), and so do bf16/fp16 pushes (their narrow copies,
kept across joins); async and ssp push by reference (ssp's worker past the bound still
held); a push by reference whose worker needs no newer version is answered only once the
coordinator has let go of it; a worker with no room in /dev/shm pushes bytes. The multi-process runs are in
tests/system/test_colocated_local.py.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
import zmq.asyncio
import zygote
from test_fold import LR, _model, _worker
from torch import nn

from tensorbus.bus.codec import decode, encode
from tensorbus.bus.errors import WireError
from tensorbus.bus.messages import BUILD, Ack, Join, Push, Ready, RejectCode, Weights, Welcome
from tensorbus.bus.shared import (
    ROOT,
    HostToken,
    SegmentCache,
    SharedAllocator,
    SharedTensorError,
    creator_alive,
    sweep,
)
from tensorbus.nodes import Coordinator, CoordinatorConfig
from tensorbus.nodes.faults import Faults
from tensorbus.nodes.flat import FlatModel
from tensorbus.nodes.outbox import ReusingAllocator
from tensorbus.strategies import Async, StaleSync, Sync
from tensorbus.strategies.base import PushKind, Rhythm, Wait

pytestmark = pytest.mark.skipif(not ROOT.is_dir(), reason="no /dev/shm on this machine")


def _ours() -> set[str]:
    return {p.name for p in ROOT.glob(f"tensorbus-{os.getpid()}-*")}


def test_a_shared_allocator_allocates_zeroed_buffers_and_knows_where_they_lie() -> None:
    shm = SharedAllocator()
    try:
        a, b = shm.allocate([(1000, torch.float32), (3, torch.int64)])
        assert (a.dtype, a.numel(), b.dtype, b.numel()) == (torch.float32, 1000, torch.int64, 3)
        assert not a.any() and not b.any()
        name, at_a = shm.locate(a)  # type: ignore[misc]
        assert shm.locate(b) == [name, 4096]  # each buffer starts on a page
        assert at_a == 0 and shm.locate(a[10:20]) == [name, 40]
        assert shm.locate(torch.zeros(4)) is None
        assert (ROOT / str(name)).stat().st_mode & 0o777 == 0o600
    finally:
        shm.close()


def test_a_segment_cache_reads_the_senders_memory_itself() -> None:
    shm, segments = SharedAllocator(), SegmentCache()
    try:
        (grads,) = shm.allocate([(256, torch.float32)])
        grads.copy_(torch.arange(256.0))
        ref = shm.locate(grads[128:])
        view = segments.view(ref, 128 * 4, torch.float32)
        assert torch.equal(view, torch.arange(128.0, 256.0))
        assert segments.holds(view) and not segments.holds(grads) and not segments.holds(torch.zeros(1))
        grads[200] = -1.0  # no copy between: the receiver sees the sender's write
        assert view[72] == -1.0
    finally:
        shm.close()


@pytest.mark.system  # it starts processes
def test_the_receivers_mapping_is_read_only() -> None:
    """A receiver that wrote into a pushed gradient would write the sender's buffer: the
    mapping forbids it (the process dies of SIGSEGV, loudly, rather than corrupt it)."""
    program = (
        "import torch\nfrom tensorbus.bus.shared import SharedAllocator, SegmentCache\n"
        "shm = SharedAllocator(); (g,) = shm.allocate([(16, torch.float32)])\n"
        "view = SegmentCache().view(shm.locate(g), 64, torch.float32)\n"
        "print('mapped', flush=True)\nview.add_(1.0)\nprint('wrote', flush=True)\n")
    done = zygote.shared().run([], code=program, capture_output=True, text=True, timeout=60,
                               cwd=Path(__file__).resolve().parents[2])
    assert "mapped" in done.stdout and "wrote" not in done.stdout
    assert done.returncode == -signal.SIGSEGV


@pytest.mark.parametrize(("ref", "why"), [
    (["../../etc/passwd", 0], "not a tensorbus segment name"),
    (["tensorbus-1-zzzzzzzzzzzzzzzz", 0], "not a tensorbus segment name"),
    (["tensorbus-1-5-0123456789abcdef", 0], "another host"),
    ("tensorbus-1-5-0123456789abcdef", "needs [segment, offset]"),
    ([1, 2], "needs [segment, offset]"),
])
def test_a_segment_cache_refuses_what_is_not_a_segment_of_ours(ref: Any, why: str) -> None:
    with pytest.raises(SharedTensorError, match=why.replace("[", r"\[").replace("]", r"\]")):
        SegmentCache().view(ref, 4, torch.float32)


@pytest.mark.parametrize(("offset", "nbytes"), [(4096, 4), (-4, 4), (2, 4), (0, 4100)])
def test_a_segment_cache_refuses_bytes_outside_the_segment(offset: int, nbytes: int) -> None:
    shm = SharedAllocator()
    try:
        (grads,) = shm.allocate([(1024, torch.float32)])
        name, _ = shm.locate(grads)  # type: ignore[misc]
        with pytest.raises(SharedTensorError, match="bytes at offset"):
            SegmentCache().view([name, offset], nbytes, torch.float32)
    finally:
        shm.close()


def test_closing_a_shared_allocator_unlinks_its_files_and_keeps_its_buffers() -> None:
    before = _ours()
    shm = SharedAllocator()
    (grads,) = shm.allocate([(64, torch.float32)])
    assert len(_ours() - before) == 1
    shm.close()
    assert _ours() == before
    grads.fill_(2.0)  # still mapped
    assert float(grads.sum()) == 128.0


@pytest.mark.system  # it starts processes
def test_a_killed_creators_segment_is_unlinked_by_the_next_sweep() -> None:
    program = (
        "import os, signal, sys, torch\nfrom tensorbus.bus.shared import SharedAllocator\n"
        "shm = SharedAllocator(); (g,) = shm.allocate([(1 << 20, torch.float32)])\n"
        "print(shm.locate(g)[0], flush=True)\nos.kill(os.getpid(), signal.SIGKILL)\n")
    done = zygote.shared().run([], code=program, capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGKILL
    path = ROOT / done.stdout.strip()
    assert not creator_alive(path.name)
    # (Another test's node, starting meanwhile, may have swept it first: the same code.)
    there = path.exists()
    gone = sweep()
    assert not path.exists() and (path.name in gone or not there)


@pytest.mark.system  # it starts a process
def test_a_creator_that_ended_but_is_not_reaped_is_gone() -> None:
    """A killed worker whose launcher died too waits for PID 1 to reap it, which in a
    container may never come: its /proc entry stays (a zombie), and its segments must go."""
    child = subprocess.Popen(["sleep", "60"])
    try:
        stat = Path(f"/proc/{child.pid}/stat").read_bytes()
        start = int(stat[stat.rindex(b")") + 2:].split()[19])
        name = f"tensorbus-{child.pid}-{start}-{'0' * 16}"
        assert creator_alive(name)
        child.kill()
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child.pid}/stat").read_bytes().split(b") ")[1][:1] != b"Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert not creator_alive(name)  # (not reaped yet: the entry is still there)
    finally:
        child.kill()
        child.wait()


def test_a_sweep_spares_live_creators_and_knows_a_reused_pid() -> None:
    """A live process's segment stays; one named with a live pid but another start time
    (its creator is gone, and the pid was taken since) goes."""
    shm = SharedAllocator()
    try:
        (mine,) = shm.allocate([(16, torch.float32)])
        name = str(shm.locate(mine)[0])
        pid, start, random = name.removeprefix("tensorbus-").split("-")
        reused = ROOT / f"tensorbus-{pid}-{int(start) + 1}-{random}"
        reused.write_bytes(b"x")
        try:
            assert creator_alive(name) and not creator_alive(reused.name)
            gone = sweep()
            # (Another test's process may sweep it first: that it is gone is the point.)
            assert name not in gone
            assert (ROOT / name).exists() and not reused.exists()
        finally:
            reused.unlink(missing_ok=True)
    finally:
        shm.close()


def test_a_host_token_is_seen_only_with_its_token_and_while_it_lives() -> None:
    host_token = HostToken()
    name, token = host_token.offer.split(" ")
    try:
        assert HostToken.seen(host_token.offer)
        wrong = format(int(token, 16) ^ 1, "032x")
        assert not HostToken.seen(f"{name} {wrong}")
        assert not HostToken.seen(f"../{name} {token}")
        assert not HostToken.seen("") and not HostToken.seen(name)
    finally:
        host_token.close()
    assert not HostToken.seen(host_token.offer)


def test_the_codec_sends_placed_tensors_as_references_and_the_rest_as_bytes() -> None:
    shm = SharedAllocator()
    try:
        (grads,) = shm.allocate([(300_000, torch.float32)])
        grads.normal_()
        private = torch.arange(10, dtype=torch.int64)
        push = Push(sender=1, version=3, clock=3, loss=0.5, samples=8, tensors=(grads, private))
        frames = encode(push, refer=shm.locate)
        assert len(frames) == 2  # the header, and the private tensor's one frame
        message = decode(frames, segments=SegmentCache())
        got, also = message.tensors
        assert isinstance(got, torch.Tensor) and torch.equal(got, grads)
        assert torch.equal(also, private)
        grads[0] = 7.0
        assert got[0] == 7.0  # read where the sender wrote it
        with pytest.raises(SharedTensorError, match="does not take") as info:
            decode(frames)  # a node with no segment cache
        assert isinstance(info.value, WireError) and info.value.code is RejectCode.MALFORMED
        assert len(encode(push)) == 1 + 2 + 1  # without refer: 2 frames of 1 MiB, and 1
    finally:
        shm.close()


def test_a_flat_model_moves_its_gradients_into_shared_memory_or_stays_as_it_was() -> None:
    torch.manual_seed(0)
    flat = FlatModel(nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2)))
    kept = flat.grads

    def no_room(_: object) -> tuple[torch.Tensor, ...]:
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        flat.share_grads(no_room)
    assert flat.grads is kept
    shm = SharedAllocator()
    try:
        flat.share_grads(shm.allocate)
        assert all(shm.locate(g) is not None for g in flat.grads)
        flat.begin_backward()
        flat.module(torch.ones(3, 8)).sum().backward()
        flat.gather_grads()
        assert all(shm.locate(p.grad) is not None for p in flat.module.parameters())
        assert float(flat.grads[0].abs().sum()) > 0
    finally:
        shm.close()


# In one loop, over real ZeroMQ --------------------------------------------------------------

def _train(strategy: Any, *, shared: bool, poisoned: int | None = None, compress: str = ""
           ) -> tuple[list[torch.Tensor], dict[str, Any]]:
    async def scenario() -> tuple[list[torch.Tensor], dict[str, Any]]:
        coordinator = Coordinator(
            model=_model(), strategy=strategy,
            config=CoordinatorConfig(batch_size=8, steps=8, compress=compress),
            optimizer=lambda ps: torch.optim.SGD(ps, lr=LR))
        endpoint = coordinator.bind()
        summary, *_ = await asyncio.gather(coordinator.run(), *(
            _worker(endpoint, r, 2 if r == poisoned else None, shared_memory=shared).run()
            for r in (0, 1)))
        return [w.clone() for w in coordinator.flat.weights], summary

    return asyncio.run(scenario())


@pytest.mark.parametrize("poisoned", [None, 1], ids=["finite", "rank-1-nan"])
def test_sync_pushes_by_reference_and_makes_the_same_bits_as_with_bytes(poisoned: int | None) -> None:
    before = _ours()
    want, plain = _train(Sync(workers=2), shared=False, poisoned=poisoned)
    got, summary = _train(Sync(workers=2), shared=True, poisoned=poisoned)
    for stats, by_reference in ((plain, False), (summary, True)):
        for worker in stats["per_worker"].values():
            assert worker["by_reference"] == (worker["pushes"] if by_reference else 0)
            assert worker["pushes"] >= 8
    assert summary["steps"] == plain["steps"] == 8
    assert summary["dropped"] == plain["dropped"] == ({} if poisoned is None else {"not_finite": 1})
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert _ours() == before  # the workers' and the coordinator's segments are unlinked


def test_async_pushes_both_gradient_sets_by_reference() -> None:
    """A pipelined worker computes into one set while the other is out; both lie in shared
    memory, and it writes one again once its push is answered (after the step)."""
    before = _ours()
    weights, summary = _train(Async(workers=2), shared=True)
    assert summary["steps"] == 8 and summary["dropped"] == {}
    assert sum(w["pushes"] for w in summary["per_worker"].values()) >= 8
    for worker in summary["per_worker"].values():
        assert worker["pushes"] >= 1 and worker["by_reference"] == worker["pushes"]
    assert all(bool(torch.isfinite(w).all()) for w in weights)
    assert _ours() == before


def test_a_rejoining_workers_narrow_buffers_are_the_same_segments_again() -> None:
    """Each join makes a new Outbox; its shared buffers must not pile up in /dev/shm."""
    shm = SharedAllocator()
    try:
        reusing = ReusingAllocator(shm.allocate)
        buckets = [(1000, torch.bfloat16)]
        first = reusing.round()
        a, b = first(buckets), first(buckets)  # two gradient sets: two segments
        again = reusing.round()
        assert again(buckets) is a and again(buckets) is b
        assert again([(10, torch.float16)]) is not a  # other buckets: a new one
        assert len(_ours()) >= 3 and shm.locate(a[0]) is not None
        made = _ours()
        round_three = reusing.round()
        round_three(buckets), round_three(buckets)
        assert _ours() == made
    finally:
        shm.close()


@pytest.mark.parametrize("compress", ["bf16", "fp16"])
def test_narrow_pushes_go_by_reference_with_the_bits_of_bytes(compress: str) -> None:
    """--compress bf16|fp16 pushes its narrow copies from shared memory: the same bits as
    with bytes under sync; async pushes both sets' copies by reference. Top-k's integer
    indices go as bytes."""
    before = _ours()
    want, plain = _train(Sync(workers=2), shared=False, compress=compress)
    got, summary = _train(Sync(workers=2), shared=True, compress=compress)
    for stats, by_reference in ((plain, False), (summary, True)):
        for worker in stats["per_worker"].values():
            assert worker["pushes"] >= 8
            assert worker["by_reference"] == (worker["pushes"] if by_reference else 0)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    _, summary = _train(Async(workers=2), shared=True, compress=compress)
    assert summary["steps"] == 8 and summary["dropped"] == {}
    for worker in summary["per_worker"].values():
        assert worker["pushes"] >= 1 and worker["by_reference"] == worker["pushes"]
    _, summary = _train(Sync(workers=2), shared=True, compress="topk:0.1")
    assert all(w["by_reference"] == 0 for w in summary["per_worker"].values())
    assert _ours() == before


def test_narrow_copies_with_no_room_in_shared_memory_go_as_bytes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No room for the bf16 copies in /dev/shm (ENOSPC, made to happen): the run goes on,
    its pushes carrying their bytes, and the fp32 gradient sets were never moved there."""
    real = SharedAllocator.allocate

    def allocate(self: SharedAllocator, buckets: Any) -> tuple[torch.Tensor, ...]:
        if any(dtype == torch.bfloat16 for _, dtype in buckets):
            raise OSError(28, "No space left on device (made to happen)")
        return real(self, buckets)

    monkeypatch.setattr(SharedAllocator, "allocate", allocate)
    _, summary = _train(Sync(workers=2), shared=True, compress="bf16")
    assert summary["steps"] == 8
    for worker in summary["per_worker"].values():
        assert worker["pushes"] >= 8 and worker["by_reference"] == 0


def test_ssp_a_worker_released_while_its_push_by_reference_is_stepped_is_answered() -> None:
    """Worker 0's push takes it past the bound, and its step (before the answer, by
    reference) waits a while; meanwhile worker 1 is removed, which releases worker 0 before
    it was parked. Worker 0 must be answered, not parked for a Release that already went;
    worker 1, alive, pushes by reference as a non-member, is told to join again (not
    refused as malformed) and does."""
    async def scenario() -> dict[str, Any]:
        coordinator = Coordinator(
            model=_model(), strategy=StaleSync(workers=2, staleness=0),
            config=CoordinatorConfig(batch_size=8, steps=12),
            optimizer=lambda ps: torch.optim.SGD(ps, lr=LR))
        endpoint = coordinator.bind()
        update, fired = coordinator._update, []

        async def slow_update(updates: Any, scale: float, **options: Any) -> None:
            if (not fired and tuple(options.get("ranks", ())) == (0,)
                    and coordinator.strategy.holds_back(0) and coordinator.version >= 3):
                fired.append(True)
                asyncio.ensure_future(coordinator.remove(1, "test: removed"))
                await asyncio.sleep(0.05)
            await update(updates, scale, **options)

        coordinator._update = slow_update  # type: ignore[method-assign]
        summary, *_ = await asyncio.wait_for(asyncio.gather(
            coordinator.run(), _worker(endpoint, 0, None, shared_memory=True).run(),
            _worker(endpoint, 1, None, shared_memory=True, faults=Faults(slow_s=0.05)).run()),
            timeout=40)
        assert fired
        return summary

    summary = asyncio.run(scenario())
    assert summary["steps"] == 12
    assert summary["per_worker"]["1"]["joins"] == 2
    assert "malformed" not in summary["rejected"]


@pytest.mark.parametrize("staleness", [0, 1])
def test_ssp_pushes_by_reference_and_holds_a_worker_too_far_ahead(staleness: int) -> None:
    """The push that takes a worker past the bound is stepped before its answer (its
    buffers are written again once answered), and the answer is still held until the
    slowest catches up: never answered at once, or the worker would push again while held
    (dropped as a duplicate) and clocks would part by more than staleness + 1. Worker 1
    sleeps before each step, so worker 0 is held at nearly every push."""
    before = _ours()

    async def scenario() -> dict[str, Any]:
        coordinator = Coordinator(
            model=_model(), strategy=StaleSync(workers=2, staleness=staleness),
            config=CoordinatorConfig(batch_size=8, steps=12),
            optimizer=lambda ps: torch.optim.SGD(ps, lr=LR))
        endpoint = coordinator.bind()
        summary, *_ = await asyncio.gather(
            coordinator.run(), _worker(endpoint, 0, None, shared_memory=True).run(),
            _worker(endpoint, 1, None, shared_memory=True,
                    faults=Faults(slow_s=0.05)).run())
        return summary

    summary = asyncio.run(scenario())
    assert summary["steps"] == 12 and summary["dropped"] == {}
    assert summary["max_clock_gap"] <= staleness + 1
    for worker in summary["per_worker"].values():
        assert worker["pushes"] >= 1 and worker["by_reference"] == worker["pushes"]
    assert summary["per_worker"]["0"]["held_s"] > 0
    assert _ours() == before


@pytest.mark.parametrize(("applied", "momentum"), [(True, 0.0), (False, 0.0), (False, 0.9)],
                         ids=["step-at-once", "kept-folded", "kept-for-the-step"])
def test_a_push_by_reference_that_needs_no_newer_version_is_answered_once_let_go_of(
        applied: bool, momentum: float) -> None:
    """Its sender writes its buffers again once answered. Async's step takes it at once:
    the answer comes after that step (and names the version that holds it). A strategy
    that keeps it for a later step while its worker goes on (here a sync whose workers do
    not wait): plain SGD folds it in as it comes (nodes.fold); any other optimizer reads
    it at the step, so the coordinator copies it out of the segment first. Each time the
    buffer is overwritten the moment the answer comes, and the step still reads the push.
    (Momentum's first step is plain SGD's: its buffer starts as the gradient.)"""
    strategy: Any = Async(workers=2, momentum_correction=False)  # (the step's arithmetic as set)
    if not applied:
        strategy = Sync(workers=2)
        strategy.rhythm = Rhythm(push=PushKind.GRADIENT, local_steps=1, wait=Wait.NOTHING)

    async def scenario() -> None:
        coordinator = Coordinator(model=_model(), strategy=strategy,
                                  config=CoordinatorConfig(batch_size=8, steps=5),
                                  optimizer=lambda ps: torch.optim.SGD(ps, lr=LR, momentum=momentum))
        endpoint = coordinator.bind()
        run = asyncio.create_task(coordinator.run())
        context = zmq.asyncio.Context()
        host_token, shm = HostToken(), SharedAllocator()
        dealers = []
        for _ in range(2):
            dealer = context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(endpoint)
            dealers.append(dealer)

        async def ask(rank: int, message: Any, refer: Any = None) -> Any:
            await dealers[rank].send_multipart(encode(message, refer=refer))
            frames = await asyncio.wait_for(dealers[rank].recv_multipart(copy=False), 10.0)
            return decode([f.buffer for f in frames])

        try:
            digest = coordinator.flat.layout.digest
            for rank in (0, 1):
                welcome = await ask(rank, Join(request=1, rank=rank, layout=digest, build=BUILD,
                                               shared=host_token.offer))
                assert isinstance(welcome, Welcome) and welcome.shared
            await dealers[1].send_multipart(encode(Ready(sender=1, request=2, batches=10)))
            assert isinstance(await ask(0, Ready(sender=0, request=2, batches=10)), Ack)
            await asyncio.wait_for(dealers[1].recv_multipart(), 10.0)
            before = [w.clone() for w in coordinator.flat.weights]
            torch.manual_seed(1)
            grads = shm.allocate([(b.numel, b.dtype) for b in coordinator.flat.layout.buckets])
            for g in grads:
                g.normal_()
            pushed = [g.clone() for g in grads]
            reply = await ask(0, Push(sender=0, request=3, version=0, clock=0, loss=1.0,
                                      samples=8, tensors=grads), refer=shm.locate)
            assert isinstance(reply, Ack) and not reply.dropped
            for g in grads:
                g.fill_(math.nan)  # its next backward
            assert coordinator.metrics.worker(0)["by_reference"] == 1
            if applied:
                assert reply.version == coordinator.version == 1
                mean = pushed
            else:
                assert reply.version == coordinator.version == 0
                other = [torch.randn(b.numel, dtype=b.dtype) for b in coordinator.flat.layout.buckets]
                reply = await ask(1, Push(sender=1, request=3, version=0, clock=0, loss=1.0,
                                          samples=8, tensors=tuple(other)))
                assert isinstance(reply, Ack) and not reply.dropped
                for _ in range(100):  # (answered before its step: sync's worker waits for it)
                    if coordinator.version == 1:
                        break
                    await asyncio.sleep(0.05)
                assert coordinator.version == 1
                mean = [(a + b) / 2 for a, b in zip(pushed, other, strict=True)]
            for w, w0, g in zip(coordinator.flat.weights, before, mean, strict=True):
                torch.testing.assert_close(w, w0 - LR * g)
        finally:
            context.destroy(linger=0)
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
            host_token.close()
            shm.close()

    asyncio.run(scenario())


def test_a_worker_with_no_room_in_shared_memory_pushes_bytes(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def no_room(self: SharedAllocator, buckets: object) -> tuple[torch.Tensor, ...]:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(SharedAllocator, "allocate", no_room)
    with caplog.at_level(logging.WARNING, logger="tensorbus.worker"):
        _, summary = _train(Sync(workers=2), shared=True)
    assert summary["steps"] == 8
    assert all(w["by_reference"] == 0 for w in summary["per_worker"].values())
    assert "no room for the gradients in shared memory" in caplog.text


def test_only_the_float_tensors_of_a_push_or_of_weights_come_by_reference() -> None:
    shm = SharedAllocator()
    try:
        floats, indices = shm.allocate([(16, torch.float32), (16, torch.int64)])
        refused = [
            (Push(sender=0, version=1, clock=0, loss=0.0, samples=1, tensors=(indices,)),
             "int64 tensor by reference in a PUSH"),
            (Weights(tensors=(indices,)), "int64 tensor by reference in a WEIGHTS"),
            (Welcome(rank=0, world_size=1, strategy="sync", push="gradient", local_steps=1,
                     wait="newer", batch_size=1, pub_port=1, heartbeat_s=1.0, timeout_s=1.0,
                     lr=0.1, tensors=(floats,)), "float32 tensor by reference in a WELCOME"),
        ]
        for message, says in refused:
            with pytest.raises(SharedTensorError, match=says):
                decode(encode(message, refer=shm.locate), segments=SegmentCache())
        taken = decode(encode(Weights(version=3, generation=5, tensors=(floats,)),
                              refer=shm.locate), segments=SegmentCache())
        assert isinstance(taken, Weights) and taken.generation == 5
        assert taken.tensors[0].data_ptr() != floats.data_ptr()  # its own mapping of it
    finally:
        shm.close()


def test_a_fifo_named_as_a_segment_does_not_hang_the_reader() -> None:
    name = f"tensorbus-{os.getpid()}-1-{'f' * 16}"
    os.mkfifo(ROOT / name)
    try:
        started = time.monotonic()
        with pytest.raises(SharedTensorError, match="cannot be mapped"):
            SegmentCache().view([name, 0], 4, torch.float32)
        assert not HostToken.seen(f"{name} {'0' * 32}")
        assert time.monotonic() - started < 5
    finally:
        os.unlink(ROOT / name)


def test_a_coordinator_copies_a_rejoining_workers_held_push_out_of_its_segment() -> None:
    """Kept for a step that waits for a straggler, a push by reference would be rewritten by
    its worker's next backward once it joins again: the coordinator copies it first, and
    the fold's record of it (which a NaN push after it folds again from) too."""
    from tensorbus.nodes.fold import Fold
    from tensorbus.nodes.intake import Held

    coordinator = Coordinator(model=_model(), strategy=Sync(workers=2),
                              config=CoordinatorConfig(steps=1))
    coordinator.bind()
    shm = SharedAllocator()
    try:
        grads = shm.allocate([(b.numel, b.dtype) for b in coordinator.flat.layout.buckets])
        for g in grads:
            g.normal_()
        assert coordinator._serving.segments is not None
        pushed = decode(encode(Push(sender=0, version=0, clock=0, loss=1.0, samples=8,
                                    tensors=grads), refer=shm.locate), segments=coordinator._serving.segments)
        coordinator._intake.held[0] = Held(pushed.tensors, 1.0, 8)
        coordinator.stepper.fold = Fold(0, -0.1, coordinator.flat.layout.allocate(), [0], [pushed.tensors])
        coordinator._intake.copy_held(0, coordinator._serving.segments)
        copied = coordinator._intake.held[0].tensors
        assert coordinator.stepper.fold.updates == [copied]
        assert not any(coordinator._serving.segments.holds(t) for t in copied)
        for g in grads:
            g.zero_()  # the worker computes again
        assert all(bool(t.abs().sum() > 0) for t in copied)
    finally:
        shm.close()
        assert coordinator._serving.host_token is not None
        coordinator._serving.server.close()
        coordinator._serving.host_token.close()


def test_a_coordinator_that_cannot_read_the_workers_host_token_gets_bytes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The proof goes both ways: here the coordinator does not see the worker's segment
    (as from a container with its own /dev/shm), says so, and the worker sends bytes."""
    class Blind(HostToken):
        seen = staticmethod(lambda offer: False)

    monkeypatch.setattr("tensorbus.nodes.admission.HostToken", Blind)
    _, summary = _train(Sync(workers=2), shared=True)
    assert all(w["by_reference"] == 0 for w in summary["per_worker"].values())


def test_a_forked_process_that_drops_its_copy_of_a_segment_leaves_the_file() -> None:
    """A process forked from a segment's creator (a DataLoader's worker forked by a worker,
    say) holds a copy of its object: when that copy is collected there, the creator's file
    stays (bus.shared._unlink is the creator's alone)."""
    import gc

    from tensorbus.bus.shared import ROOT, _Segment

    segment = _Segment(4096)
    path = ROOT / segment.name
    pid = os.fork()
    if pid == 0:  # the child: drop its copy, collect, and leave without the parent's atexit
        code = 0
        try:
            del segment
            gc.collect()
        except BaseException:  # noqa: BLE001 - any failure is the child's exit status
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    try:
        assert os.waitstatus_to_exitcode(status) == 0
        assert path.exists()
    finally:
        segment.unlink()
    assert not path.exists()
