"""Integration: a pipeline stage's links to its neighbours (nodes.neighbours), two stages in
one event loop over real ZeroMQ on loopback, their compute threads as threads: activations
arrive where ZeroMQ put them, what a neighbour does not send is dropped, a silent neighbour
ends a wait with NeighbourLost naming it, and a session's end interrupts a wait at once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import torch

from tensorbus.bus.codec import encode
from tensorbus.bus.messages import ActivationGrads, Activations, Heartbeat, Kind
from tensorbus.bus.transport import Hub, ZmqSender
from tensorbus.nodes.neighbours import NEXT, PREVIOUS, NeighbourLost, Neighbours, routing_id

pytestmark = pytest.mark.timeout(20)


@asynccontextmanager
async def _pair(*, beating: bool = True, timeout_s: float = 5.0
                ) -> AsyncIterator[tuple[Neighbours, Neighbours]]:
    """Stage 0 and stage 1 of a pipeline of 2 (pipeline 3), linked; stage 1 beats only if
    `beating`."""
    hub = Hub()
    first = Neighbours(stage=0, stages=2, micro_batches=lambda: 2, hub=hub)
    second = Neighbours(stage=1, stages=2, micro_batches=lambda: 2, hub=hub)
    tasks = []
    try:
        for n in (first, second):
            n.pipeline = 3
            n.bind()
        first.connect({NEXT: second.inbox}, heartbeat_s=0.05, timeout_s=timeout_s)
        second.connect({PREVIOUS: first.inbox}, heartbeat_s=0.05, timeout_s=timeout_s)
        tasks = [asyncio.create_task(first.receive()), asyncio.create_task(second.receive()),
                 asyncio.create_task(first.heartbeats())]
        if beating:
            tasks.append(asyncio.create_task(second.heartbeats()))
        yield first, second
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        first.close()
        second.close()
        hub.close()


def test_activations_go_forward_and_their_gradients_back() -> None:
    outputs, targets = torch.randn(8, 1024), torch.arange(8)

    async def scenario() -> None:
        async with _pair() as (first, second):
            await asyncio.to_thread(first.send, Activations(
                sender=3, stage=0, step=5, micro=1, outputs=1, batch=16,
                tensors=(outputs, targets)))
            got = await asyncio.to_thread(second.take, Kind.ACTIVATIONS, 5, 1, "activations")
            assert isinstance(got, Activations) and (got.step, got.micro, got.batch) == (5, 1, 16)
            assert torch.equal(got.tensors[0], outputs) and torch.equal(got.tensors[1], targets)
            # (over the received frame itself, writable, so that it takes a gradient)
            assert isinstance(got.tensors[0], torch.Tensor)
            assert got.tensors[0].requires_grad_().is_leaf
            await asyncio.to_thread(second.send, ActivationGrads(
                sender=3, stage=1, step=5, micro=1, loss=0.25, tensors=(2 * outputs,)))
            back = await asyncio.to_thread(first.take, Kind.ACTIVATION_GRADS, 5, 1, "gradients")
            assert isinstance(back, ActivationGrads) and back.loss == 0.25
            assert torch.equal(back.tensors[0], 2 * outputs)
            await asyncio.to_thread(first.flush)

    asyncio.run(scenario())


def test_what_a_neighbour_does_not_send_is_dropped_and_counted() -> None:
    async def scenario() -> None:
        hub = Hub()
        second = Neighbours(stage=1, stages=2, micro_batches=lambda: 2, hub=hub)
        second.pipeline = 3
        second.bind()
        receiving = asyncio.create_task(second.receive())
        # Stage 0 of pipeline 3, by hand; and a stranger, which is no neighbour.
        sender = ZmqSender(second.inbox, routing_id=routing_id(0, 3), hub=hub)
        stranger = ZmqSender(second.inbox, routing_id=routing_id(0, 9), hub=hub)
        try:
            await stranger.send(encode(Heartbeat(sender=9)))
            await sender.send(encode(ActivationGrads(  # (a kind stage 0 does not send)
                sender=3, stage=1, step=0, micro=0, loss=0.0, tensors=(torch.zeros(2),))))
            await sender.send(encode(Activations(  # (micro-batch 7 of 2)
                sender=3, stage=0, step=0, micro=7, outputs=1, batch=2,
                tensors=(torch.zeros(2), torch.zeros(2)))))
            await sender.send(encode(Activations(  # (one tensor: no targets)
                sender=3, stage=0, step=0, micro=0, outputs=1, batch=2, tensors=(torch.zeros(2),))))
            await sender.send(encode(Activations(  # (another stage's, under stage 0's name)
                sender=3, stage=1, step=0, micro=0, outputs=1, batch=2,
                tensors=(torch.zeros(2), torch.zeros(2)))))
            deadline = time.monotonic() + 5
            while second.refused < 5 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert second.refused == 5
            assert len(second.mailbox) == 0
        finally:
            receiving.cancel()
            await asyncio.gather(receiving, return_exceptions=True)
            sender.close()
            stranger.close()
            second.close()
            hub.close()

    asyncio.run(scenario())


def test_a_silent_neighbour_ends_the_wait_naming_it() -> None:
    async def scenario() -> None:
        async with _pair(beating=False, timeout_s=0.3) as (first, _):
            started = time.monotonic()
            with pytest.raises(NeighbourLost) as lost:
                await asyncio.to_thread(first.take, Kind.ACTIVATION_GRADS, 0, 0,
                                        "the gradients of micro-batch 0 of step 0")
            assert 0.3 <= time.monotonic() - started < 3.0
            assert (lost.value.stage, lost.value.pipeline) == (1, 3)
            assert "stage 1 of pipeline 3 was silent for" in str(lost.value)
            assert "while this stage waited for the gradients of micro-batch 0" in str(lost.value)

    asyncio.run(scenario())


def test_a_neighbour_that_beats_is_waited_for_and_an_interruption_ends_the_wait() -> None:
    async def scenario() -> None:
        async with _pair(timeout_s=0.3) as (first, _):
            waiting = asyncio.ensure_future(asyncio.to_thread(
                first.take, Kind.ACTIVATION_GRADS, 0, 0, "gradients"))
            await asyncio.sleep(1.0)  # (past the timeout: the neighbour's beats keep it)
            assert not waiting.done()
            first.mailbox.interrupt(RuntimeError("the session ended"))
            with pytest.raises(RuntimeError, match="the session ended"):
                await asyncio.wait_for(waiting, 5)

    asyncio.run(scenario())
