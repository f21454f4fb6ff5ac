"""A worker's compute thread and its bridges to the event loop.

The thread is where a worker's steps (data, forward, backward) and its other work off the
event loop run, one at a time, so that heartbeats go on meanwhile. The bridges: a job's
result and its end as loop futures (`in_thread`), waiting for a failed step to end before
anything else touches the model (`finishing`), a backward's ranges announced to the loop
(`announce`), and iter() of a SPEC's data run on the loop's thread (`iter_on_loop`).

A daemon thread, unlike a ThreadPoolExecutor's: a running step cannot be interrupted, and
a worker that has left its run (stopped, or told to) must not wait at its exit for a step,
or a slow data(), to end. A job cancelled before it began never runs; either way its
future is done, which is how the worker knows the thread is done with the model
(`finishing`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any, Protocol, TypeVar

from tensorbus.bus.clock import working

log = logging.getLogger("tensorbus.worker")
_T = TypeVar("_T")
FINISHING_SAY_S = 5.0  # a failed worker waiting longer for its compute thread says so
_Job = tuple[concurrent.futures.Future[Any], Callable[[], Any]]


class ScriptEnded(Exception):  # noqa: N818 - not an error: how a script's worker ends
    """A script that brings its own loop has ended it (nodes.own_loop): its worker leaves
    the run as one whose work is done."""


class ComputeThread:
    """One daemon thread running the jobs submitted, in order."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = False
        self._closed = False

    def submit(self, work: Callable[..., _T], *args: Any) -> concurrent.futures.Future[_T]:
        """Run `work(*args)` on the thread, in the caller's context (as asyncio.to_thread)."""
        if self._closed:
            raise RuntimeError("the compute thread is shut down")
        future: concurrent.futures.Future[_T] = concurrent.futures.Future()
        context = contextvars.copy_context()
        self._jobs.put((future, lambda: context.run(work, *args)))
        if not self._started:
            self._started = True
            self._thread.start()
        return future

    def shutdown(self) -> None:
        """No more jobs; those not begun are cancelled. The one running, if any, ends when
        it ends: nothing waits for it."""
        self._closed = True
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, work = job
            if not future.set_running_or_notify_cancel():
                continue  # cancelled before it began
            try:
                result = work()
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on it
                future.set_exception(e)
            else:
                future.set_result(result)


class OffLoop(Protocol):
    """Runs `work(*args)` off the event loop (on the compute thread); awaitable."""

    def __call__(self, work: Callable[..., _T], *args: Any) -> asyncio.Future[_T]: ...


def in_thread(loop: asyncio.AbstractEventLoop, thread: ComputeThread,
              work: Callable[[], _T]) -> tuple[asyncio.Future[_T], asyncio.Future[None]]:
    """Run `work` on `thread`: its result, and a future done once `work` can no longer touch
    anything, which cancelling the first does not change (a running thread cannot be
    cancelled). Both come from the executor's own future, which is done when `work`
    returns or raises, and also when it is cancelled before it began: a future resolved
    from inside `work` would never be, had `work` never run."""
    ended = working(loop.create_future())  # (a virtual clock waits for it: bus.clock)
    job = thread.submit(work)
    result = asyncio.wrap_future(job, loop=loop)

    def over(_: concurrent.futures.Future[_T]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            loop.call_soon_threadsafe(resolve, ended)

    # After wrap_future's own callback, which hands the result to the loop: `ended`, which
    # a virtual clock waits for, is done only once the result is on its way.
    job.add_done_callback(over)
    return result, ended


@contextlib.asynccontextmanager
async def finishing(ended: asyncio.Future[None], leaving: Callable[[], bool]
                    ) -> AsyncIterator[None]:
    """Run the body beside the compute thread; if the body fails, wait for the thread to
    end before going on: until then it writes the model, the gradients and the outbox,
    which whatever comes next (loading the final weights, a new session) uses too. A
    worker `leaving` for good (a signal) uses none of them again, and does not wait.

    The wait has no deadline, as the step itself has none (a thread cannot be stopped,
    and a step may rightly be long); a wait past FINISHING_SAY_S says why in the log."""
    try:
        yield
    except BaseException as e:
        if leaving():
            raise
        done, _ = await asyncio.wait({ended}, timeout=FINISHING_SAY_S)
        if not done:
            log.warning("training stopped (%s); waiting for the step being computed to end "
                        "before going on: a running step cannot be interrupted",
                        str(e) or type(e).__name__)
            await asyncio.wait({ended})
        raise


@contextlib.asynccontextmanager
async def cancelling(task: asyncio.Future[Any]) -> AsyncIterator[None]:
    """Run the body beside `task`; if the body fails, cancel the task and wait for it."""
    try:
        yield
    except BaseException:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise


def announce(loop: asyncio.AbstractEventLoop, ready: list[asyncio.Future[None]], i: int) -> None:
    """From the backward thread: shard i's part is ready to send."""
    loop.call_soon_threadsafe(resolve, ready[i])


def resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def iter_on_loop(loop: asyncio.AbstractEventLoop) -> Callable[[Iterable[Any]], Iterator[Any]]:
    """iter(), called on `loop`'s thread from whichever thread asks (waiting for it there).

    Why: a DataLoader with workers forks them when iterated, and a process forked from a
    thread of an executor fails as it exits (exit status 1, which the DataLoader reports
    in tracebacks as a worker that 'exited unexpectedly'): its threading shutdown joins
    the executor's threads, the forking one included. The loop's thread is the main one."""
    def anew(shards: Iterable[Any]) -> Iterator[Any]:
        if loop.is_closed() or threading.get_ident() == loop_thread:
            return iter(shards)
        made: concurrent.futures.Future[Iterator[Any]] = concurrent.futures.Future()

        def make() -> None:
            try:
                made.set_result(iter(shards))
            except BaseException as e:  # noqa: BLE001 - handed to the thread that asked
                made.set_exception(e)

        try:
            loop.call_soon_threadsafe(make)
        except RuntimeError:  # closed meanwhile: no loop to wait for
            return iter(shards)
        while True:
            try:
                return made.result(timeout=1.0)
            except TimeoutError:
                if loop.is_closed():  # (closed before it ran make: it never will)
                    return iter(shards)

    loop_thread = threading.get_ident()  # (made on the loop's thread)
    return anew
