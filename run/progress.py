"""The progress line of `local` and `coordinator`: a bar on a terminal, log lines otherwise."""

from __future__ import annotations

import time
from typing import TextIO

from nodes.coordinator import Progress


class ProgressLine:
    def __init__(self, stream: TextIO, *, every_s: float = 0.1, log_every_s: float = 5.0) -> None:
        self._stream = stream
        self._tty = stream.isatty()
        self._every = every_s if self._tty else log_every_s
        self._last = 0.0
        self._shown = False

    def __call__(self, p: Progress) -> None:
        now = time.monotonic()
        final = p.target is not None and p.version >= p.target
        if now - self._last < self._every and not final:
            return
        self._last = now
        rate = p.version / p.wall_s if p.wall_s > 0 else 0.0
        line = f"v{p.version}"
        if p.target:
            done = p.version / p.target
            bar = "#" * int(done * 24)
            eta = (p.target - p.version) / rate if rate else 0.0
            line = f"[{bar:<24}] {p.version}/{p.target}  eta {_clock(eta)}"
        line += f"  {rate:.1f} steps/s  {p.samples / p.wall_s if p.wall_s else 0:.0f} samples/s"
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


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}:{secs:02d}"
