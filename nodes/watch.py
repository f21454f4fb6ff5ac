"""What the coordinator observes of time: workers' telemetry, stragglers, the trace, the status.

The coordinator tells a `Watch` what happens (a push arrived with its telemetry, an answer
went out after being held, an update was applied, a broadcast sent); the watch adds the
figures up (`nodes.telemetry`), names stragglers in the log and the metrics as soon as they
show, writes the timeline (`nodes.trace`, with `--trace`), and makes the rows of the status
table. It never touches a socket; the coordinator stays the one place that acts.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tensorbus.bus.messages import Push
from tensorbus.nodes.metrics import Metrics
from tensorbus.nodes.telemetry import Telemetry, sane_seconds
from tensorbus.nodes.trace import COORDINATOR_TRACK, Trace

log = logging.getLogger("tensorbus.coordinator")


@dataclass(frozen=True)
class WorkerStatus:
    """One row of the status table."""

    rank: int
    state: str  # computing, pushing, barrier, staleness, start gate, loading, joining, ...
    seen_s: float  # seconds since its last message
    clock: int  # updates pushed
    version: int  # the version it works on
    behind: int  # versions it is behind the coordinator
    compute_ms: float | None  # recent compute time per update (median of the last few)
    shares: tuple[float, float, float]  # of its time: computing, communicating, waiting
    straggler: bool


@dataclass(frozen=True)
class Status:
    """The whole table: the run and a row per live worker."""

    state: str
    version: int
    target: int | None
    samples: int
    train_s: float
    loss: float | None
    workers: tuple[WorkerStatus, ...]


class Watch:
    def __init__(self, metrics: Metrics, *, trace: Path | None = None) -> None:
        self.metrics = metrics
        self.telemetry = Telemetry()
        self.trace = Trace(trace) if trace is not None else None
        self._answered: dict[int, float] = {}  # rank -> wall time its last push was answered

    def pushed(self, rank: int, push: Push, arrived: float) -> None:
        """A push arrived (at wall time `arrived`), with its worker's figures."""
        # Sane figures only from here on: NaN from a confused peer would make invalid JSON.
        figures = dict(zip(("compute_s", "comm_s", "wait_s"), self.telemetry.record(
            rank, compute_s=push.compute_s, comm_s=push.comm_s, wait_s=push.wait_s,
            at=arrived),
            strict=True))
        counters = self.metrics.worker(rank)
        for name, seconds in figures.items():
            counters[name] += seconds
        counters["peak_bytes"] = max(counters["peak_bytes"], max(push.peak_bytes, 0))
        if push.span_s > 0:  # a pipeline stage's (nodes.stage_steps): sane figures only
            counters["busy_s"] = counters.get("busy_s", 0.0) + sane_seconds(push.busy_s)
            counters["span_s"] = counters.get("span_s", 0.0) + sane_seconds(push.span_s)
            counters["held"] = max(counters.get("held", 0), max(push.held, 0))
        self.metrics.write("worker", rank=rank, version=push.version, clock=push.clock,
                           **{name: round(seconds, 6) for name, seconds in figures.items()})
        if self.trace is not None and math.isfinite(push.began):
            track = self.trace.worker(rank)
            computed = push.began + figures["compute_s"]
            last = self._answered.get(rank)
            if last is not None:  # from its last answer to this compute: waiting, loading
                self.trace.span(track, "wait", last, push.began, clock=push.clock, ended="compute")
            self.trace.span(track, "compute", push.began, computed, version=push.version,
                            clock=push.clock)
            self.trace.span(track, "push", computed, arrived, version=push.version)
        for verdict in self.telemetry.check():
            text = verdict.describe()
            (log.warning if verdict.slow else log.info)("%s", text)
            self.metrics.write("straggler", rank=verdict.rank, slow=verdict.slow,
                               compute_s=round(verdict.compute_s, 6),
                               others_s=round(verdict.others_s, 6), clock=push.clock)
            if self.trace is not None:
                self.trace.instant(self.trace.worker(verdict.rank),
                                   "straggler" if verdict.slow else "caught up", arrived)

    def answered(self, rank: int, *, held_since: float | None = None) -> None:
        """A push of `rank` was answered now, held back since `held_since` (wall) if it was."""
        now = time.time()
        if held_since is not None and self.trace is not None:
            self.trace.span(self.trace.worker(rank), "wait", held_since, now, held_by="strategy")
        self._answered[rank] = now

    def left(self, rank: int) -> None:
        self.telemetry.forget(rank)
        self._answered.pop(rank, None)

    def span(self, name: str, start: float, **args: Any) -> None:
        """A span of the coordinator's own, from `start` (wall) to now."""
        if self.trace is not None:
            self.trace.span(COORDINATOR_TRACK, name, start, time.time(), **args)

    def row(self, rank: int, **fields: Any) -> WorkerStatus:
        """A status row: the caller's membership facts plus this watch's figures."""
        times = self.telemetry.workers.get(rank)
        recent = self.telemetry.recent(rank)
        return WorkerStatus(
            rank=rank, compute_ms=recent * 1000 if recent is not None else None,
            shares=times.shares() if times else (0.0, 0.0, 0.0),
            straggler=bool(times and times.straggler), **fields,
        )

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
