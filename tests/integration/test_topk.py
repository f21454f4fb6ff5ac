"""--compress topk:R: the largest R of each gradient range, with error feedback.

Unit: the worker's outbox sends k = ceil(R n) elements per range, the largest by magnitude
of the gradient plus what was left before, and owes exactly the rest: after any number of
steps, what was sent plus the residual is the sum of the gradients; a non-finite gradient
is sent as it is and leaves the residual alone; its wire layout is an index and a value
bucket per range. Integration (one loop, real ZeroMQ): sync trains on
top-k pushes, the coordinator adding them into zeros at their indices; a member's update
naming an element the model lacks is dropped and counted, and changes nothing.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
import zmq
import zmq.asyncio
from specs import load_example

from tensorbus.bus.codec import decode, encode
from tensorbus.bus.layout import Compression, Layout
from tensorbus.bus.messages import BUILD, Ack, Join, Push, Ready, Welcome
from tensorbus.nodes import Coordinator, CoordinatorConfig, Worker, WorkerConfig
from tensorbus.nodes.flat import FlatModel
from tensorbus.nodes.outbox import Outbox
from tensorbus.strategies import Sync

pytestmark = pytest.mark.timeout(60)

digits = load_example("digits")


def test_the_wire_layout_has_an_index_and_a_value_bucket_per_range() -> None:
    layout = Layout.of([("w", torch.zeros(10, 30)), ("b", torch.zeros(10, dtype=torch.float64))])
    wire = Compression.parse("topk:0.05").wire(layout)
    assert [(b.dtype, b.numel) for b in wire.buckets] == [
        (torch.int64, 15), (torch.float32, 15), (torch.int64, 1), (torch.float64, 1)]
    assert wire.digest == layout.digest  # the same model


@pytest.mark.parametrize("text", ["topk:0", "topk:1", "topk:-0.1", "topk:", "topk:x", "top:0.1", "int3"])
def test_a_bad_compression_says_what_to_write(text: str) -> None:
    with pytest.raises(ValueError, match="choose bf16, fp16 or topk:R with 0 < R < 1"):
        Compression.parse(text)


@pytest.mark.parametrize(("shards", "inputs"), [(1, 40), (2, 40), (1, 3000)])
def test_what_was_sent_plus_what_is_owed_is_every_gradient(shards: int, inputs: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(inputs, 25)  # 1025 parameters, or 75025 (nodes.largest's fast path)
    flat = FlatModel(model)
    cut = [flat.layout.shard(i, shards) for i in range(shards)]
    outbox = Outbox(flat, cut, Compression.parse("topk:0.01"), weights=False)
    sent = [torch.zeros(b.numel, dtype=torch.float64) for b in flat.layout.buckets]
    total = [torch.zeros(b.numel, dtype=torch.float64) for b in flat.layout.buckets]
    for _ in range(30):
        for g, t in zip(flat.grads, total, strict=True):
            g.copy_(torch.randn(g.numel()))
            t.add_(g.double())
        for i, shard in enumerate(cut):
            before = [r.clone() for r in outbox._residual]
            outbox.fill(i, 0)
            part = outbox.parts[0][i]
            for n, span in enumerate(shard.spans):
                indices, values = part[2 * n], part[2 * n + 1]
                assert indices.numel() == max(1, -(-span.numel // 100))
                assert len(set(indices.tolist())) == indices.numel()
                owed = (before[span.bucket][span.start:span.stop]
                        + flat.grads[span.bucket][span.start:span.stop]).abs()
                # The largest by magnitude: none left behind is larger than one sent.
                kept = torch.ones_like(owed, dtype=torch.bool)
                kept[indices] = False
                assert owed[kept].max() <= owed[indices].min()
                sent[span.bucket][span.start:span.stop].index_add_(0, indices, values.double())
    for s, r, t in zip(sent, outbox._residual, total, strict=True):
        assert torch.allclose(s + r.double(), t, atol=1e-4)



def test_a_non_finite_gradient_is_sent_as_it_is_and_leaves_the_residual_alone() -> None:
    torch.manual_seed(0)
    flat = FlatModel(torch.nn.Linear(40, 25))
    whole = [flat.layout.shard(0, 1)]
    outbox = Outbox(flat, whole, Compression.parse("topk:0.01"), weights=False)
    flat.grads[0].copy_(torch.randn(flat.grads[0].numel()))
    outbox.fill(0, 0)
    owed = outbox._residual[0].clone()
    # More NaNs than k: were they added to the residual, it would send NaN for many pushes.
    flat.grads[0].copy_(torch.randn(flat.grads[0].numel()))
    flat.grads[0][:50] = float("nan")
    outbox.fill(0, 0)
    assert not torch.isfinite(outbox.parts[0][0][1]).all()  # sent: the coordinator drops it
    assert torch.equal(outbox._residual[0], owed)
    flat.grads[0].copy_(torch.randn(flat.grads[0].numel()))
    outbox.fill(0, 0)
    assert torch.isfinite(outbox.parts[0][0][1]).all()  # the next push is clean

def _coordinator(compress: str, steps: int = 40) -> Coordinator:
    torch.manual_seed(0)
    return Coordinator(model=digits.model(), strategy=Sync(workers=2), lr=0.1, evaluate=digits.evaluate,
                       config=CoordinatorConfig(batch_size=16, steps=steps, compress=compress))


def test_sync_trains_on_topk_pushes() -> None:
    async def train(compress: str) -> dict:
        coordinator = _coordinator(compress)
        endpoint = coordinator.bind()
        workers = [Worker(model=digits.model(), data=digits.data, loss=digits.loss,
                          config=WorkerConfig(connect=endpoint)) for _ in range(2)]
        summary, *_ = await asyncio.gather(coordinator.run(), *(w.run() for w in workers))
        return summary

    torch.manual_seed(0)
    initial = digits.evaluate(digits.model())
    full, sparse = asyncio.run(train("")), asyncio.run(train("topk:0.05"))
    assert sparse["steps"] == 40 and sparse["dropped"] == {}
    assert sparse["test_loss"] < initial["test_loss"] - 0.1  # it learns
    assert sparse["test_loss"] < full["test_loss"] + 0.5  # and not wildly worse


def test_an_index_out_of_range_is_dropped_and_changes_nothing() -> None:
    async def scenario() -> None:
        coordinator = _coordinator("topk:0.01", steps=5)
        endpoint = coordinator.bind()
        run = asyncio.create_task(coordinator.run())
        context = zmq.asyncio.Context()
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)

        async def ask(message: object) -> object:
            await dealer.send_multipart(encode(message))  # type: ignore[arg-type]
            frames = await asyncio.wait_for(dealer.recv_multipart(copy=False), 5.0)
            return decode([f.buffer for f in frames])

        try:
            welcome = await ask(Join(request=1, rank=0, layout=coordinator.flat.layout.digest, build=BUILD))
            assert isinstance(welcome, Welcome)
            # A second member opens the start gate with us.
            other = _raw(context, endpoint)
            await other.send_multipart(encode(Join(request=1, rank=1, layout=coordinator.flat.layout.digest,
                                                   build=BUILD)))
            await asyncio.wait_for(other.recv_multipart(), 5.0)
            await other.send_multipart(encode(Ready(sender=1, request=2, batches=10)))
            assert isinstance(await ask(Ready(sender=0, request=2, batches=10)), Ack)
            before = [w.clone() for w in coordinator.flat.weights]
            wire = Compression.parse("topk:0.01").wire(coordinator.flat.layout)
            tensors = [torch.zeros(b.numel, dtype=b.dtype) for b in wire.buckets]
            tensors[0][0] = coordinator.flat.layout.buckets[0].numel  # one past the end
            reply = await ask(Push(sender=0, request=3, clock=0, loss=1.0, samples=16,
                                   tensors=tuple(tensors)))
            assert isinstance(reply, Ack) and reply.dropped == "out_of_range"
            assert coordinator.metrics.dropped["out_of_range"] == 1
            assert all(torch.equal(a, b) for a, b in zip(before, coordinator.flat.weights, strict=True))
        finally:
            context.destroy(linger=0)
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)

    asyncio.run(scenario())


def _raw(context: zmq.asyncio.Context, endpoint: str) -> zmq.asyncio.Socket:
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(endpoint)
    return socket
