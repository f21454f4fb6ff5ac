"""The status table of `local` and `coordinator`: what each worker is doing, and who is slow.

Printed every SECONDS with `--status SECONDS`, and on request at any time: `kill -USR1 PID`,
or Enter on the terminal the run was started from (when it runs in the foreground). On a
terminal the table first clears the progress line (which redraws itself at the next step);
elsewhere every line starts with `status:`, so that logs stay greppable.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TextIO, TypeVar

from tensorbus.nodes.coordinator import Coordinator
from tensorbus.nodes.watch import Status

T = TypeVar("T")

HEADER = ("rank", "state", "seen", "clock", "version", "behind", "compute/update",
          "compute", "comm", "wait", "")


def format_status(status: Status) -> list[str]:
    """The table as lines: a line for the run, a header, a row per live worker."""
    of = f"/{status.target}" if status.target else ""
    loss = f"loss {status.loss:.4f}" if status.loss is not None else "no loss yet"
    lines = [(f"v{status.version}{of} {status.state}, {status.train_s:.1f} s training, "
              f"{status.samples} samples, {loss}, {len(status.workers)} worker(s)")]
    rows: list[tuple[str, ...]] = [HEADER]
    for w in status.workers:
        compute = f"{w.compute_ms:.0f} ms" if w.compute_ms is not None else "-"
        rows.append((str(w.rank), w.state, f"{w.seen_s:.1f}s", str(w.clock), str(w.version),
                     str(w.behind), compute, *(f"{share:.0%}" for share in w.shares),
                     "straggler" if w.straggler else ""))
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER))]
    for row in rows:
        cells = [cell.ljust(width) if i == 1 else cell.rjust(width)
                 for i, (cell, width) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
    return lines


def _foreground(stream: TextIO) -> bool:
    """Whether this process owns the terminal's input (not started with `&`, say)."""
    try:
        return os.tcgetpgrp(stream.fileno()) == os.getpgrp()
    except OSError:
        return False


class StatusTable:
    def __init__(self, stream: TextIO, *, every_s: float | None = None) -> None:
        if every_s is not None and not every_s > 0:
            raise ValueError(f"--status must be a positive number of seconds, got {every_s}")
        self._stream = stream
        self._every_s = every_s
        self._tty = stream.isatty()

    def show(self, coordinator: Coordinator) -> None:
        lines = format_status(coordinator.status())
        if self._tty:
            self._stream.write("\r\x1b[K" + "\n".join(lines) + "\n")
        else:
            self._stream.write("".join(f"status: {line}\n" for line in lines))
        self._stream.flush()

    async def around(self, coordinator: Coordinator, work: Awaitable[T]) -> T:
        """Await `work` (the coordinator's run, or a launch around it), showing the table
        every `every_s` seconds and whenever asked."""
        async def periodic() -> None:
            assert self._every_s is not None
            while True:
                await asyncio.sleep(self._every_s)
                self.show(coordinator)

        task = asyncio.create_task(periodic()) if self._every_s is not None else None
        try:
            with self._on_request(coordinator):
                return await work
        finally:
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    @contextlib.contextmanager
    def _on_request(self, coordinator: Coordinator) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        undo: list[Callable[[], object]] = []
        try:
            previous = signal.getsignal(signal.SIGUSR1)
            loop.add_signal_handler(signal.SIGUSR1, self.show, coordinator)
            undo.append(functools.partial(_stop_listening, loop, previous))
        except (RuntimeError, ValueError):  # not the main thread: no signals
            pass
        stdin = sys.stdin
        if stdin is not None and not stdin.closed and stdin.isatty() and _foreground(stdin):
            def on_enter() -> None:
                if not _foreground(stdin):
                    # Sent to the background since: reading the terminal would stop us
                    # (SIGTTIN). Stop listening; SIGUSR1 still works.
                    loop.remove_reader(stdin.fileno())
                    return
                stdin.readline()  # a line is there: the terminal hands input over by lines
                self.show(coordinator)

            loop.add_reader(stdin.fileno(), on_enter)
            undo.append(lambda: loop.remove_reader(stdin.fileno()))
        try:
            yield
        finally:
            for step in undo:
                step()


def _stop_listening(loop: asyncio.AbstractEventLoop, previous: Any) -> None:
    """SIGUSR1 as it was before (asyncio, removing its handler, leaves the signal at its
    default, which ends the process: the CLI's let it pass, see run.entry)."""
    loop.remove_signal_handler(signal.SIGUSR1)
    if previous is not None:  # (None: set outside Python, and left so)
        signal.signal(signal.SIGUSR1, previous)
