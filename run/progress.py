"""The progress line of `local` and `coordinator`: a bar on a terminal, log lines otherwise.

On a terminal the bar is redrawn in place, on a line of its own; whatever else is written
to stderr meanwhile (log lines, a worker's relayed output) goes through `above`, which
clears the bar first, so that no line is glued to it: the next step draws it again.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Iterator
from typing import Any, TextIO

from tensorbus.nodes.coordinator import Progress


class ProgressLine:
    def __init__(self, stream: TextIO, *, every_s: float = 0.1, log_every_s: float = 5.0) -> None:
        self._stream = stream
        self._tty = stream.isatty()
        self._every = every_s if self._tty else log_every_s
        self._last = 0.0
        self._shown = False
        self._origin: tuple[float, int, int, float] | None = None  # wall_s, version, samples, done

    def __call__(self, p: Progress) -> None:
        now = time.monotonic()
        final = p.done is not None and p.done >= 1.0
        if now - self._last < self._every and not final:
            return
        self._last = now
        # Rates from the first step on: start-up (workers importing torch) is not training.
        if self._origin is None:
            self._origin = (p.wall_s, p.version, p.samples, p.done or 0.0)
        elapsed = p.wall_s - self._origin[0]
        rate = (p.version - self._origin[1]) / elapsed if elapsed > 0 else 0.0
        sample_rate = (p.samples - self._origin[2]) / elapsed if elapsed > 0 else 0.0
        line = f"v{p.version}"
        if p.done is not None:
            done = min(p.done, 1.0)
            bar = "#" * int(done * 24)
            spent = p.wall_s - self._origin[0]
            gained = done - self._origin[3]
            eta = spent * (1 - done) / gained if gained > 0 else float("nan")
            of = f"/{p.target}" if p.target else ""
            line = f"[{bar:<24}] v{p.version}{of} {done:.0%}  eta {_clock(eta)}"
        elif p.target is None:  # epochs of shards without len(): known after a first pass
            line += " (total unknown until each worker's first pass ends)"
        line += f"  {rate:.1f} steps/s  {sample_rate:.0f} samples/s"
        line += f"  loss {p.loss:.4f}"
        if self._tty:
            self._stream.write("\r" + line + "\x1b[K")
            self._shown = True
        else:
            self._stream.write(f"progress: {line}\n")
        self._stream.flush()

    def close(self) -> None:
        if self._shown:
            self._stream.write("\n")
            self._stream.flush()
            self._shown = False

    def clear(self) -> None:
        """Take the bar off the terminal: something else is about to be written there."""
        if self._shown:
            self._stream.write("\r\x1b[K")
            self._shown = False

    @contextlib.contextmanager
    def above(self) -> Iterator[None]:
        """For the block, writes to sys.stderr clear the bar first (on a terminal)."""
        if not self._tty:
            yield
            return
        before = sys.stderr
        sys.stderr = _Above(before, self)  # type: ignore[assignment]
        try:
            yield
        finally:
            sys.stderr = before


class _Above:
    """A stream whose writes clear the progress line first."""

    def __init__(self, stream: TextIO, line: ProgressLine) -> None:
        self._stream, self._line = stream, line

    def write(self, text: str) -> int:
        if text:
            self._line.clear()
        return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, encoding, ...
        return getattr(self._stream, name)


class CurrentStderr:
    """sys.stderr as it is when written to, for a logging handler made before the progress
    line stands in for it."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _clock(seconds: float) -> str:
    if math.isnan(seconds):  # no rate yet
        return "?"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}:{secs:02d}"
