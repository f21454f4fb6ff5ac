"""Broadcast topics (bus.transport): the coordinator's XPUB hands up which topics are taken,
and a version is made as bytes, or as references, only for someone who takes it.

Over real ZeroMQ: `ZmqServer.wants` follows subscribers as they come and go (the first
subscription to a topic, the last one's end, prefixes as SUB matches them); in one loop, a
sync run whose workers all load by reference publishes no version as bytes, and one with a
worker on bytes publishes both.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch
import zmq
from test_fold import LR, _model, _worker

from tensorbus.bus.shared import ROOT, SharedWeightPool
from tensorbus.bus.transport import TOPIC_ALL, TOPIC_SHARED, TOPIC_WEIGHTS, ZmqServer
from tensorbus.nodes import Coordinator, CoordinatorConfig
from tensorbus.strategies import Sync

pytestmark = pytest.mark.timeout(60)


def _until(server: ZmqServer, topic: bytes, wanted: bool, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while server.wants(topic) != wanted and time.monotonic() < deadline:
        time.sleep(0.005)
    return server.wants(topic) == wanted


def test_the_server_knows_which_topics_subscribers_take() -> None:
    server = ZmqServer("tcp://127.0.0.1:0", max_message_bytes=1 << 20)
    context: zmq.Context[Any] = zmq.Context()
    try:
        assert not any(server.wants(t) for t in (TOPIC_ALL, TOPIC_WEIGHTS, TOPIC_SHARED))
        first, second = context.socket(zmq.SUB), context.socket(zmq.SUB)
        for sub in (first, second):
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, TOPIC_SHARED)
            sub.connect(f"tcp://127.0.0.1:{server.pub_port}")
        assert _until(server, TOPIC_SHARED, True)
        assert not server.wants(TOPIC_WEIGHTS) and not server.wants(TOPIC_ALL)
        first.close()  # one of two gone: still taken
        time.sleep(0.2)
        assert server.wants(TOPIC_SHARED)
        second.setsockopt(zmq.UNSUBSCRIBE, TOPIC_SHARED)
        assert _until(server, TOPIC_SHARED, False)
        second.setsockopt(zmq.SUBSCRIBE, b"")  # everything, as a prefix
        assert _until(server, TOPIC_WEIGHTS, True) and server.wants(TOPIC_SHARED)
        second.close()
        assert _until(server, TOPIC_WEIGHTS, False)
    finally:
        server.close()
        context.destroy(linger=0)


@pytest.mark.skipif(not ROOT.is_dir() or not SharedWeightPool.usable(),
                    reason="no /dev/shm, or not x86-64 (weights go as bytes)")
@pytest.mark.parametrize("bytes_worker", [False, True], ids=["all-by-reference", "one-on-bytes"])
def test_a_version_is_made_only_for_the_topics_taken(bytes_worker: bool) -> None:
    topics: list[bytes] = []

    async def scenario() -> list[torch.Tensor]:
        coordinator = Coordinator(
            model=_model(), strategy=Sync(workers=2), config=CoordinatorConfig(batch_size=8, steps=8),
            optimizer=lambda ps: torch.optim.SGD(ps, lr=LR))
        endpoint = coordinator.bind()
        server = coordinator._serving.server
        assert server is not None
        publish = server.publish

        async def watched(frames: Any, topic: bytes = TOPIC_ALL) -> Any:
            topics.append(topic)
            return await publish(frames, topic)

        server.publish = watched  # type: ignore[method-assign]
        await asyncio.gather(coordinator.run(), *(
            _worker(endpoint, r, None, shared_memory=not (bytes_worker and r == 1)).run()
            for r in (0, 1)))
        return [w.clone() for w in coordinator.flat.weights]

    weights = asyncio.run(scenario())
    assert all(bool(torch.isfinite(w).all()) for w in weights)
    assert topics.count(TOPIC_SHARED) >= 8
    assert (topics.count(TOPIC_WEIGHTS) >= 8) if bytes_worker else TOPIC_WEIGHTS not in topics
