"""Unit: a worker whose training fails waits for its compute thread to end (and says so in
the log when that takes long).

A running thread cannot be cancelled: until it ends it writes the model, the gradients and
the outbox. So when the loop's side fails (a stop, a lost coordinator) while backward runs,
the worker must not go on (loading the final weights, starting a new session) before the
thread is done, even if the task that awaited it was cancelled.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tensorbus.nodes.worker import _finishing, _in_thread

pytestmark = pytest.mark.timeout(10)


def test_a_failure_beside_the_compute_waits_for_the_thread_to_end() -> None:
    ended = threading.Event()

    def backward() -> int:
        time.sleep(0.3)
        ended.set()
        return 1

    async def train() -> None:
        compute, done = _in_thread(asyncio.get_running_loop(), backward)
        async with _finishing(done):
            await asyncio.sleep(0.01)
            compute.cancel()  # as a cancelled worker task would cancel what it awaits
            raise RuntimeError("coordinator lost")

    with pytest.raises(RuntimeError, match="coordinator lost"):
        asyncio.run(train())
    assert ended.is_set()


def test_the_result_comes_back_when_nothing_fails() -> None:
    async def train() -> int:
        compute, done = _in_thread(asyncio.get_running_loop(), lambda: 7)
        async with _finishing(done):
            value = await compute
        assert done.done()
        return value

    assert asyncio.run(train()) == 7


def test_a_long_wait_for_the_thread_says_why(monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr("tensorbus.nodes.worker.FINISHING_SAY_S", 0.05)

    async def train() -> None:
        _compute, done = _in_thread(asyncio.get_running_loop(), lambda: time.sleep(0.4))
        async with _finishing(done):
            raise RuntimeError("coordinator lost")

    with caplog.at_level("WARNING", logger="tensorbus.worker"), \
            pytest.raises(RuntimeError, match="coordinator lost"):
        asyncio.run(train())
    assert "training stopped (coordinator lost); waiting for the step being computed" in caplog.text
