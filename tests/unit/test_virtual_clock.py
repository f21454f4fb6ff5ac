"""Unit: a virtual-time loop (bus.clock) does not move its time while a thread works for it.

Its time jumps to the next timer when nothing is ready and no thread works for it. A
thread's work is over for the loop only once its result is there: a step's compute
(nodes.compute.in_thread) whose end was said before its result let the loop jump through
its timers meanwhile, seconds of virtual time in a few real milliseconds, and more on a
loaded machine (a standby test's takeover took 4.2 virtual seconds for 2.3).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from tensorbus.bus.clock import LoopClock, run_virtual
from tensorbus.nodes.compute import ComputeThread, in_thread

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def thread() -> Iterator[ComputeThread]:
    compute = ComputeThread("test")
    yield compute
    compute.shutdown()


async def _beating(clock: LoopClock, beats: list[float]) -> None:
    """A timer due every 50 ms of virtual time, as a node's heartbeats are: what the loop
    would jump to."""
    while True:
        await asyncio.sleep(0.05)
        beats.append(clock.monotonic())


def test_a_thread_s_work_takes_no_virtual_time_until_its_result_is_in(thread: ComputeThread) -> None:
    def work(i: int) -> int:
        time.sleep(0.0005)  # (real time, which the loop must not count)
        return i

    async def main(clock: LoopClock) -> tuple[list[int], float, list[float]]:
        loop = asyncio.get_running_loop()
        beats: list[float] = []
        beating = asyncio.create_task(_beating(clock, beats))
        got = []
        for i in range(300):
            result, ended = in_thread(loop, thread, lambda i=i: work(i))
            got.append(await result)
            await ended
        beating.cancel()
        return got, clock.monotonic(), beats

    got, now, beats = run_virtual(main)
    assert got == list(range(300))
    assert now == 0.0 and beats == []


def test_time_jumps_when_nothing_works() -> None:
    async def main(clock: LoopClock) -> tuple[float, float]:
        started = time.monotonic()
        await asyncio.sleep(100.0)
        return clock.monotonic(), time.monotonic() - started

    virtual_s, real_s = run_virtual(main)
    assert virtual_s == 100.0 and real_s < 1.0
