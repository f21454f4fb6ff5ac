"""Where each worker's time goes, and who the straggler is: the coordinator's view of its workers.

Every push carries the worker's own measurements (see `bus.messages.Push`): seconds spent
computing the update, and since the compute before it, seconds communicating and seconds
waiting (held back by the strategy, or for a version). `Telemetry` adds them up per rank and
keeps its recent compute times, from which it names stragglers: a worker whose recent
compute time stays at least `factor` times the median of the other workers' and `floor_s`
above it. "Recent" is its updates that arrived in the last `span_s` seconds, and at least
`window` of them: a median over seconds, not over a few updates, because a machine shared
with other work preempts single workers for tens to hundreds of milliseconds at a time,
which at a few milliseconds a step is many updates in a row.
It has no clock of its own and no I/O: figures in, verdicts out, as strategies are.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass
class WorkerTimes:
    """One rank's totals and its recent compute times (per update)."""

    compute_s: float = 0.0
    comm_s: float = 0.0
    wait_s: float = 0.0
    updates: int = 0
    recent: deque[float] = field(default_factory=deque)
    arrived: deque[float] = field(default_factory=deque)  # when each of `recent` came
    straggler: bool = False

    def shares(self) -> tuple[float, float, float]:
        """The shares of time computing, communicating and waiting (zeros before any)."""
        total = self.compute_s + self.comm_s + self.wait_s
        if total <= 0:
            return 0.0, 0.0, 0.0
        return self.compute_s / total, self.comm_s / total, self.wait_s / total


@dataclass(frozen=True)
class Verdict:
    """A worker became a straggler (`slow`) or stopped being one."""

    rank: int
    slow: bool
    compute_s: float  # its recent compute time per update
    others_s: float  # the other workers' median recent compute time per update

    def describe(self) -> str:
        ms, others_ms = self.compute_s * 1000, self.others_s * 1000
        if self.slow:
            ratio = self.compute_s / self.others_s if self.others_s > 0 else float("inf")
            return (f"worker {self.rank} is a straggler: {ms:.0f} ms computing an update "
                    f"(median of its last ones), {ratio:.1f}x the others' {others_ms:.0f} ms")
        return (f"worker {self.rank} is no longer a straggler: {ms:.0f} ms computing an "
                f"update, the others {others_ms:.0f} ms")


class Telemetry:
    # The defaults name a worker slowed by 28 ms a step among four 3-ms ones 2 s after
    # its first update, and not a worker preempted for half a second now and then
    # (tests/unit/test_telemetry.py).
    def __init__(self, *, window: int = 8, factor: float = 2.0, floor_s: float = 0.010,
                 span_s: float = 2.0) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        if not factor > 1:
            raise ValueError(f"factor must be above 1, got {factor}")
        if not span_s >= 0:
            raise ValueError(f"span_s must be at least 0, got {span_s}")
        self.window = window
        self.factor = factor
        self.floor_s = floor_s
        self.span_s = span_s
        self.workers: dict[int, WorkerTimes] = {}
        # Judged 8 times a span, not at every update: a median over seconds of updates
        # costs tens of microseconds a rank, which a push's path cannot pay each time.
        self._every_s = span_s / 8
        self._latest = -math.inf  # the newest arrival recorded
        self._checked = -math.inf  # the arrival time of the last check

    def record(self, rank: int, *, compute_s: float, comm_s: float, wait_s: float,
               at: float) -> tuple[float, float, float]:
        """Add one update's figures, arrived at time `at` (seconds, any clock that does
        not go back; negative or non-finite figures, from a confused peer, count as 0),
        and return them as counted, for whoever records them elsewhere."""
        times = self.workers.setdefault(rank, WorkerTimes())
        compute_s, comm_s, wait_s = (sane_seconds(x) for x in (compute_s, comm_s, wait_s))
        times.compute_s += compute_s
        times.comm_s += comm_s
        times.wait_s += wait_s
        times.updates += 1
        times.recent.append(compute_s)
        times.arrived.append(at)
        self._latest = max(self._latest, at)
        # Only what the window and the span need: the oldest go once the rest cover both
        # (or once there are _KEPT, however little time they span).
        while len(times.recent) > self.window and (
                at - times.arrived[1] >= self.span_s or len(times.recent) > _KEPT):
            times.recent.popleft()
            times.arrived.popleft()
        return compute_s, comm_s, wait_s

    def forget(self, rank: int) -> None:
        """A worker left: it no longer counts among the others (its totals stay)."""
        times = self.workers.get(rank)
        if times is not None:
            times.recent.clear()
            times.arrived.clear()
            times.straggler = False

    def recent(self, rank: int) -> float | None:
        """The median of the rank's recent compute times; None before any."""
        times = self.workers.get(rank)
        if times is None or not times.recent:
            return None
        return statistics.median(times.recent)

    def check(self) -> list[Verdict]:
        """Who became a straggler, or stopped being one, since the last check.

        A rank is judged once it has `window` recent updates over `span_s`; the
        others' figure is the median of their recent medians, so that with three or more
        workers one slow rank does not raise the bar it is measured against.
        """
        if self._latest - self._checked < self._every_s:
            return []
        self._checked = self._latest
        ready = {r: statistics.median(t.recent) for r, t in self.workers.items()
                 if len(t.recent) >= self.window
                 and t.arrived[-1] - t.arrived[0] >= self.span_s}
        verdicts = []
        for rank, mine in ready.items():
            others = [v for r, v in ready.items() if r != rank]
            if not others:
                continue
            bar = statistics.median(others)
            times = self.workers[rank]
            slow = mine >= self.factor * bar and mine - bar >= self.floor_s
            # Recovered only once well below the bar: no flapping around the threshold.
            recovered = mine < (1 + self.factor) / 2 * bar or mine - bar < self.floor_s / 2
            if slow and not times.straggler:
                times.straggler = True
                verdicts.append(Verdict(rank, True, mine, bar))
            elif times.straggler and recovered:
                times.straggler = False
                verdicts.append(Verdict(rank, False, mine, bar))
        return verdicts


_KEPT = 4096  # recent times kept at most a rank: 2 s of half-millisecond updates


def sane_seconds(seconds: float) -> float:
    """A peer's figure of seconds, or 0 where it is not one (NaN, negative, infinite)."""
    return seconds if 0.0 <= seconds < float("inf") else 0.0
