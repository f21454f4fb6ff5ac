"""`--trace FILE.json`: a timeline of the run as Chrome trace events (Perfetto, chrome://tracing).

One track (a trace "process") per node: the coordinator's holds its apply, broadcast and
checkpoint spans; each worker's holds its compute, push and wait spans, built by the
coordinator from what the worker's pushes report and when they arrive. Times are wall-clock
microseconds from the start of the trace; a worker's compute spans are on its own clock, so
on other machines they are off by the clocks' skew (NTP keeps that to milliseconds).

The file is written as the run goes, in the JSON array format, one event a line, each line
written whole (line-buffered); `close` ends it with `]`. A run killed midway leaves a file
without it, which Perfetto and chrome://tracing still open (the format allows it), and so
does `load` here.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import IO, Any

COORDINATOR_TRACK = 0  # workers' tracks are rank + 1


def track_of(rank: int) -> int:
    return rank + 1


class Trace:
    def __init__(self, path: Path) -> None:
        self._file: IO[str] | None = path.open("w", encoding="utf-8", buffering=1)
        self._origin = time.time()
        self._named: set[int] = set()
        self._file.write("[\n")
        self.name_track(COORDINATOR_TRACK, "coordinator")

    def name_track(self, track: int, name: str) -> None:
        if track in self._named:
            return
        self._named.add(track)
        self._event({"name": "process_name", "ph": "M", "pid": track, "tid": 0,
                     "args": {"name": name}})
        # Coordinator first, then workers by rank.
        self._event({"name": "process_sort_index", "ph": "M", "pid": track, "tid": 0,
                     "args": {"sort_index": track}})

    def worker(self, rank: int) -> int:
        """The track of worker `rank`, named on first use."""
        track = track_of(rank)
        self.name_track(track, f"worker {rank}")
        return track

    def span(self, track: int, name: str, start: float, end: float, **args: Any) -> None:
        """A complete span from `start` to `end` (wall-clock seconds, time.time())."""
        end = max(end, start)  # clocks of two machines disagree: keep the span, at zero length
        event: dict[str, Any] = {
            "name": name, "cat": "coordinator" if track == COORDINATOR_TRACK else "worker",
            "ph": "X", "pid": track, "tid": 0,
            "ts": round((start - self._origin) * 1e6, 1), "dur": round((end - start) * 1e6, 1),
        }
        if args:
            event["args"] = args
        self._event(event)

    def instant(self, track: int, name: str, at: float, **args: Any) -> None:
        event: dict[str, Any] = {"name": name, "ph": "i", "s": "p", "pid": track, "tid": 0,
                                 "ts": round((at - self._origin) * 1e6, 1)}
        if args:
            event["args"] = args
        self._event(event)

    def _event(self, event: dict[str, Any]) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(event) + ",\n")

    def close(self) -> None:
        if self._file is not None:
            # The last event carries no comma, so that the array is strict JSON.
            self._file.write(json.dumps({"name": "trace_end", "ph": "i", "s": "g", "pid": 0,
                                         "tid": 0, "ts": round((time.time() - self._origin) * 1e6, 1)})
                             + "\n]\n")
            self._file.close()
            self._file = None


def load(path: Path) -> list[dict[str, Any]]:
    """The events of a trace file, closed or not (a killed run leaves no closing `]`)."""
    text = path.read_text(encoding="utf-8").rstrip()
    if not text.endswith("]"):
        text = text.rstrip(",") + "\n]"
    events = json.loads(text)
    if not isinstance(events, list):
        # A file's content, not an argument's type: ValueError, as json's own errors.
        raise ValueError(f"{path} is not a JSON array of trace events")  # noqa: TRY004
    return events
