"""A worker's compute thread: where its steps (data, forward, backward) and its other work
off the event loop run, one at a time, so that heartbeats go on meanwhile.

A daemon thread, unlike a ThreadPoolExecutor's: a running step cannot be interrupted, and
a worker that has left its run (stopped, or told to) must not wait at its exit for a step,
or a slow data(), to end. A job cancelled before it began never runs; either way its
future is done, which is how the worker knows the thread is done with the model
(nodes.worker's `_finishing`).
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

_T = TypeVar("_T")
_Job = tuple[concurrent.futures.Future[Any], Callable[[], Any]]


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
