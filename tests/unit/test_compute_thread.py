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
from collections.abc import Iterator

import pytest

from tensorbus.nodes.compute import ComputeThread, finishing, in_thread

pytestmark = pytest.mark.timeout(10)


def _staying() -> bool:
    return False


@pytest.fixture
def thread() -> Iterator[ComputeThread]:
    compute = ComputeThread("test")
    yield compute
    compute.shutdown()


def test_a_failure_beside_the_compute_waits_for_the_thread_to_end(
        thread: ComputeThread) -> None:
    ended = threading.Event()

    def backward() -> int:
        time.sleep(0.3)
        ended.set()
        return 1

    async def train() -> None:
        compute, done = in_thread(asyncio.get_running_loop(), thread, backward)
        async with finishing(done, _staying):
            await asyncio.sleep(0.01)
            compute.cancel()  # as a cancelled worker task would cancel what it awaits
            raise RuntimeError("coordinator lost")

    with pytest.raises(RuntimeError, match="coordinator lost"):
        asyncio.run(train())
    assert ended.is_set()


def test_the_result_comes_back_when_nothing_fails(
        thread: ComputeThread) -> None:
    async def train() -> int:
        compute, done = in_thread(asyncio.get_running_loop(), thread, lambda: 7)
        async with finishing(done, _staying):
            value = await compute
        assert done.done()
        return value

    assert asyncio.run(train()) == 7


def test_a_long_wait_for_the_thread_says_why(monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture,
                                             thread: ComputeThread) -> None:
    monkeypatch.setattr("tensorbus.nodes.compute.FINISHING_SAY_S", 0.05)

    async def train() -> None:
        _compute, done = in_thread(asyncio.get_running_loop(), thread,
                                   lambda: time.sleep(0.4))
        async with finishing(done, _staying):
            raise RuntimeError("coordinator lost")

    with caplog.at_level("WARNING", logger="tensorbus.worker"), \
            pytest.raises(RuntimeError, match="coordinator lost"):
        asyncio.run(train())
    assert "training stopped (coordinator lost); waiting for the step being computed" in caplog.text


def test_a_compute_cancelled_before_it_began_is_over_at_once(
        thread: ComputeThread) -> None:
    """The hang of a worker on SIGTERM: its step was cancelled before the thread took it,
    and the wait for the thread's end waited for ever."""
    release = threading.Event()
    ran = threading.Event()

    async def train() -> float:
        loop = asyncio.get_running_loop()
        busy, _ = in_thread(loop, thread, lambda: release.wait(5))  # the one thread, taken
        compute, done = in_thread(loop, thread, ran.set)
        started = time.monotonic()
        try:
            async with finishing(done, _staying):
                compute.cancel()
                raise RuntimeError("stopped")
        except RuntimeError:
            pass
        waited = time.monotonic() - started
        release.set()
        await busy
        return waited

    assert asyncio.run(train()) < 0.5
    assert not ran.is_set()


def test_a_worker_leaving_for_good_does_not_wait_for_its_step(
        thread: ComputeThread) -> None:
    release = threading.Event()

    async def train() -> float:
        _compute, done = in_thread(asyncio.get_running_loop(), thread,
                                   lambda: release.wait(5))
        started = time.monotonic()
        try:
            async with finishing(done, lambda: True):
                raise asyncio.CancelledError
        except asyncio.CancelledError:
            pass
        waited = time.monotonic() - started
        release.set()
        return waited

    assert asyncio.run(train()) < 0.5


def test_the_thread_does_not_hold_its_process_at_exit() -> None:
    """A daemon: a process whose worker has left does not wait for a slow data() to end."""
    import subprocess
    import sys

    code = ("import time\nfrom tensorbus.nodes.compute import ComputeThread\n"
            "t = ComputeThread('slow'); t.submit(time.sleep, 60); time.sleep(0.2); t.shutdown()\n")
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", code], check=True, timeout=20)
    assert time.monotonic() - started < 10
