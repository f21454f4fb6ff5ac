"""Integration: a coordinator and workers in one event loop, over real ZeroMQ on loopback.

The central check is the sync equivalence of DESIGN.md: N workers of batch b give the
weights of single-process SGD with momentum on batch N*b over the same samples in the same
order. The others feed the coordinator hostile or unwelcome messages through a raw socket
and check that it answers with a coded Reject and trains on unharmed.
"""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import torch
import zmq
import zmq.asyncio
from specs import load_example

from tensorbus.bus.codec import decode, encode
from tensorbus.bus.errors import RejectedError
from tensorbus.bus.messages import Join, Push, Reject
from tensorbus.nodes import Coordinator, CoordinatorConfig, Worker, WorkerConfig
from tensorbus.strategies import Sync

pytestmark = pytest.mark.timeout(60)



digits = load_example("digits")
LR, MOMENTUM = 0.05, 0.9


def _sgd(params):  # type: ignore[no-untyped-def]
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def _coordinator(workers: int, steps: int, batch_size: int, **config: object) -> Coordinator:
    torch.manual_seed(0)
    return Coordinator(
        model=digits.model(),
        strategy=Sync(workers=workers),
        config=CoordinatorConfig(batch_size=batch_size, steps=steps, **config),  # type: ignore[arg-type]
        optimizer=_sgd,
    )


def _worker(endpoint: str, rank: int = -1) -> Worker:
    return Worker(model=digits.model(), data=digits.data, loss=digits.loss,
                  config=WorkerConfig(connect=endpoint, rank=rank, request_timeout_s=10.0))


def _single_process(steps: int, batch_size: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = digits.model()
    optimizer = _sgd(model.parameters())
    batches = iter(digits.data(0, 1, batch_size))
    for _ in range(steps):
        inputs, targets = next(batches)
        optimizer.zero_grad()
        digits.loss(model(inputs), targets).backward()
        optimizer.step()
    return model


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_sync_equals_single_process_with_batch_n_times_b(workers: int) -> None:
    steps, b = 20, 8

    async def train() -> tuple[Coordinator, dict]:
        coordinator = _coordinator(workers, steps, b)
        endpoint = coordinator.bind()
        results = await asyncio.gather(
            coordinator.run(), *(_worker(endpoint).run() for _ in range(workers))
        )
        return coordinator, results[0]

    coordinator, summary = asyncio.run(train())
    reference = _single_process(steps, workers * b)
    assert summary["steps"] == steps
    assert summary["samples"] == steps * workers * b
    assert summary["dropped"] == {} and summary["rejected"] == {}
    # Sync is lockstep: a worker is at most one push ahead of another, and never stale.
    assert summary["max_clock_gap"] == (1 if workers > 1 else 0)
    assert summary["max_staleness"] == 0
    # Every version goes out (the last may be cut by the stop): each is awaited by all.
    assert steps <= summary["broadcasts"] <= steps + 1
    moved = 0.0
    for (name, got), want, start in zip(
        coordinator.model.named_parameters(), reference.parameters(), _initial().parameters(),
        strict=True,
    ):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=f"parameter {name}")
        moved = max(moved, (want - start).abs().max().item())
    assert moved > 1e-2  # the comparison is of weights that trained, not of the initial ones


def _initial() -> torch.nn.Module:
    torch.manual_seed(0)
    return digits.model()


async def _raw_dealer(endpoint: str) -> tuple[zmq.asyncio.Context, zmq.asyncio.Socket]:
    context = zmq.asyncio.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(endpoint)
    return context, socket


async def _ask(socket: zmq.asyncio.Socket, frames: list) -> object:
    await socket.send_multipart(frames)
    reply = await asyncio.wait_for(socket.recv_multipart(), 5.0)
    return decode(reply)


def test_hostile_messages_get_coded_rejects_and_change_nothing() -> None:
    async def scenario() -> tuple[list[Reject], dict]:
        coordinator = _coordinator(2, 5, 8)
        endpoint = coordinator.bind()
        run = asyncio.create_task(coordinator.run())
        context, raw = await _raw_dealer(endpoint)
        layout = coordinator.flat.layout
        good_grads = layout.allocate()
        header = msgpack.unpackb(encode(Push(sender=0, version=0, clock=0, loss=1.0, samples=8,
                                             tensors=good_grads))[0])
        lies = {"protocol": {**header, "p": 99}, "kind": {**header, "k": 77},
                "bytes": {**header, "t": [[s[0], s[1], s[2] + 4] for s in header["t"]]}}
        replies = [await _ask(raw, [b"\x93garbage"])]
        for lie in lies.values():
            replies.append(await _ask(raw, [msgpack.packb(lie), *encode(Push(
                sender=0, version=0, clock=0, loss=1.0, samples=8, tensors=good_grads))[1:]]))
        wrong_shape = (torch.zeros(layout.buckets[0].numel + 1),)
        replies.append(await _ask(raw, encode(Push(sender=0, version=0, clock=0, loss=1.0,
                                                   samples=8, tensors=wrong_shape))))
        replies.append(await _ask(raw, encode(Push(sender=0, version=0, clock=0, loss=1.0,
                                                   samples=8, tensors=good_grads))))
        replies.append(await _ask(raw, encode(Join(rank=0, layout="not-this-model"))))
        context.destroy(linger=0)
        assert coordinator.version == 0  # nothing above moved the model
        await asyncio.gather(*(_worker(endpoint).run() for _ in range(2)))
        return replies, await run

    replies, summary = asyncio.run(scenario())
    assert all(isinstance(r, Reject) for r in replies), replies
    codes = [r.code for r in replies]  # type: ignore[attr-defined]
    assert codes == ["malformed", "protocol", "unknown_kind", "malformed", "layout",
                     "unknown_worker", "layout"]
    assert summary["steps"] == 5
    assert summary["rejected"] == {"malformed": 2, "protocol": 1, "unknown_kind": 1,
                                   "layout": 2, "unknown_worker": 1}


def test_a_taken_rank_is_refused() -> None:
    async def scenario() -> None:
        coordinator = _coordinator(2, 3, 8)
        endpoint = coordinator.bind()
        run = asyncio.create_task(coordinator.run())
        first = asyncio.create_task(_worker(endpoint, rank=0).run())
        await asyncio.sleep(0.5)  # the start gate holds rank 0 until a second worker comes
        with pytest.raises(RejectedError) as refused:
            await _worker(endpoint, rank=0).run()
        assert refused.value.code == "rank_taken"
        assert str(refused.value) == ("rejected (rank_taken): rank 0 is another worker's: give "
                                      "each worker its own --rank, or none (it then takes the "
                                      "lowest free one)")
        with pytest.raises(RejectedError) as refused:
            await _worker(endpoint, rank=7).run()
        assert str(refused.value) == (
            "rejected (full): rank 7 is not one of this run's (0..1): give a --rank in that "
            "range, or none, or start the coordinator with more --workers or --max-workers")
        await asyncio.gather(first, _worker(endpoint, rank=1).run())
        assert (await run)["steps"] == 3

    asyncio.run(scenario())


def test_a_worker_that_misses_every_broadcast_catches_up_by_pulling(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The clone pattern: with its SUB socket never connected, a worker learns of each new
    version by asking, and ends on the same weights as the coordinator."""
    from tensorbus.bus.transport import ZmqClient

    async def scenario() -> tuple[Worker, Worker, dict]:
        coordinator = _coordinator(2, 6, 8, heartbeat_s=0.05, timeout_s=5.0)
        endpoint = coordinator.bind()
        run = asyncio.create_task(coordinator.run())
        hearing = _worker(endpoint, rank=0)
        with monkeypatch.context() as patch:
            patch.setattr(ZmqClient, "subscribe", lambda self, port, shared=False: None)
            lost = _worker(endpoint, rank=1)
            training = asyncio.create_task(lost.run())
            await asyncio.sleep(0.2)  # it has joined with the patch in place
        await asyncio.gather(hearing.run(), training)
        return hearing, lost, await run

    hearing, lost, summary = asyncio.run(scenario())
    # Every sync version needs both workers' gradients, and an update computed on an old
    # version is dropped: six versions with nothing dropped mean that the deaf worker had
    # each version before it computed on it. (A seventh push may race the Stop.)
    assert summary["steps"] == 6
    assert summary["dropped"] == {}
    assert lost.clock in (6, 7) and hearing.clock in (6, 7)


def test_a_non_finite_update_is_dropped_and_its_worker_computes_again() -> None:
    """Worker 1's first loss is NaN: that update is dropped (counted as not_finite), the
    worker computes again on the same version instead of waiting, and sync goes on."""
    calls = {"n": 0}

    def poisoned_once(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        value = digits.loss(output, target)
        return value * float("nan") if calls["n"] == 1 else value

    async def scenario() -> dict:
        coordinator = _coordinator(2, 4, 8)
        endpoint = coordinator.bind()
        poisoned = Worker(model=digits.model(), data=digits.data, loss=poisoned_once,
                          config=WorkerConfig(connect=endpoint, rank=1))
        results = await asyncio.gather(coordinator.run(), _worker(endpoint, rank=0).run(),
                                       poisoned.run())
        return results[0]

    summary = asyncio.run(scenario())
    assert summary["steps"] == 4
    assert summary["dropped"] == {"not_finite": 1}
    assert summary["final_loss"] == summary["final_loss"]  # finite: NaN never reached the model


@pytest.mark.parametrize(("compress", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_compressed_gradients_train_like_full_ones_within_their_rounding(
        compress: str, dtype: torch.dtype) -> None:
    """--compress: the gradients travel in half the bytes, the coordinator adds them into its
    fp32 weights, and the run tracks the uncompressed one to within the dtype's rounding."""
    steps, b, workers = 20, 8, 2
    seen: list[torch.dtype] = []

    async def train(compress: str) -> Coordinator:
        coordinator = _coordinator(workers, steps, b, compress=compress)
        endpoint = coordinator.bind()
        push = coordinator._push

        async def spy(peer, member, message, now):  # type: ignore[no-untyped-def]
            seen.extend(t.dtype for t in message.tensors)
            await push(peer, member, message, now)

        coordinator._push = spy  # type: ignore[method-assign]
        await asyncio.gather(coordinator.run(), *(_worker(endpoint).run() for _ in range(workers)))
        return coordinator

    full = asyncio.run(train(""))
    assert set(seen) == {torch.float32}
    seen.clear()
    narrow = asyncio.run(train(compress))
    assert set(seen) == {dtype} and len(seen) == steps * workers
    for (name, got), want, start in zip(narrow.model.named_parameters(),
                                        full.model.parameters(), _initial().parameters(),
                                        strict=True):
        moved = (want - start).abs().max().item()
        gap = (got - want).abs().max().item()
        assert 0 < gap < 0.05 * moved, f"parameter {name}: {gap} apart, moved {moved}"
        assert got.dtype == torch.float32  # fp32 master weights


def test_a_push_in_the_wrong_dtype_is_refused_as_layout() -> None:
    """A coordinator that expects bf16 gradients refuses fp32 ones, and the other way round."""
    async def scenario() -> None:
        coordinator = _coordinator(1, 5, 8, compress="bf16")
        endpoint = coordinator.bind()
        run = asyncio.create_task(coordinator.run())
        context, dealer = await _raw_dealer(endpoint)
        try:
            grads = tuple(torch.zeros(b.numel) for b in coordinator.flat.layout.buckets)
            reply = await _ask(dealer, encode(Push(clock=0, loss=1.0, samples=8, tensors=grads)))
            assert isinstance(reply, Reject) and reply.code == "layout"
        finally:
            context.destroy(linger=0)
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)

    asyncio.run(scenario())
