"""Run metrics: one JSON object a line as training goes, and the closing summary.

The summary holds at least what DESIGN.md lists (strategy, workers, steps, wall_s,
final_loss, dropped, max_staleness, max_clock_gap) plus whatever `evaluate` returned, the
versions broadcast (fewer than the versions made where updates came faster than the
weights could go out: a version overtaken before it left is not sent),
and per worker: updates pushed (and of those, pushed by reference from shared memory:
`bus.shared`), applied and dropped, seconds held back by the strategy, and
the seconds it reported computing, communicating and waiting (see `nodes.telemetry`).
Training time (`train_s`) runs from the opening of the start gate to the stop, so that
start-up (processes importing torch, loading data) is not counted as training.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import IO, Any

from tensorbus.bus.clock import SYSTEM_CLOCK, Clock


class MetricsError(Exception):
    """The metrics file cannot be written; the message names it and why."""


class Metrics:
    def __init__(self, path: Path | None, *, strategy: str, workers: int,
                 append: bool = False, clock: Clock = SYSTEM_CLOCK) -> None:
        self._clock = clock  # (the coordinator's: a virtual one in one-loop tests)
        # A resumed run goes on in the same file, after the records of the run it resumes.
        mode = "a" if append else "w"
        try:
            self._file: IO[str] | None = path.open(mode, encoding="utf-8") if path else None
        except OSError as e:
            raise MetricsError(f"cannot write the metrics file {path}: {e.strerror}: give a "
                               "path in a folder you can write in") from None
        self.strategy = strategy
        self.workers = workers
        self.started = self._clock.monotonic()
        self.steps = 0
        self.final_loss: float | None = None
        self.samples = 0
        self.dropped: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.max_staleness = 0
        self.max_clock_gap = 0
        self.broadcasts = 0  # versions published (whole or as changes); the rest were overtaken
        self.lost: list[dict[str, Any]] = []
        self.failed: list[dict[str, Any]] = []  # workers that left with an error of theirs
        self.per_worker: dict[int, dict[str, float]] = {}
        self.trained_from: float | None = None  # when the start gate opened
        self.trained_until: float | None = None  # when the stop began
        self.ended = ""  # why training ended
        self.resumed_from: int | None = None  # the checkpoint's version, in a resumed run
        self.stopped_by: str | None = None  # what asked for the stop before the end (a signal)
        self.checkpoint: str | None = None  # the last checkpoint written
        self.unused = 0  # samples each epoch leaves out, as the workers' data says
        # Sections of the summary that the run's launcher adds (run.pipelines: "pipeline").
        self.sections: dict[str, Any] = {}

    def worker(self, rank: int) -> dict[str, float]:
        """The counters of one worker, made on first use."""
        if rank not in self.per_worker:
            self.per_worker[rank] = {"joins": 0, "pushes": 0, "by_reference": 0,
                                     "applied": 0, "dropped": 0,
                                     "held_s": 0.0, "compute_s": 0.0, "comm_s": 0.0,
                                     "wait_s": 0.0, "peak_bytes": 0}
        return self.per_worker[rank]

    def resumed(self, version: int, samples: int, path: str) -> None:
        """Go on counting from a checkpoint: versions and samples done before it count."""
        self.steps = version
        self.samples = samples
        self.resumed_from = version
        self.write("resume", version=version, samples=samples, checkpoint=path)

    def training_started(self) -> None:
        self.trained_from = self._clock.monotonic()
        self.write("start")

    def training_ended(self) -> None:
        if self.trained_until is None:
            self.trained_until = self._clock.monotonic()

    def train_s(self) -> float:
        if self.trained_from is None:
            return 0.0
        return (self.trained_until or self._clock.monotonic()) - self.trained_from

    def wall_s(self) -> float:
        return self._clock.monotonic() - self.started

    def write(self, event: str, **fields: Any) -> None:
        if self._file is not None:
            record = {"event": event, "wall_s": round(self.wall_s(), 6), **fields}
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def step(
        self, version: int, loss: float, samples: int, workers: tuple[int, ...], staleness: int = 0,
        lr: float | None = None,
    ) -> None:
        """A version made; `lr`: the learning rate it was stepped with (the workers' own
        under average without an outer optimizer)."""
        self.steps = version
        self.final_loss = loss
        self.samples += samples
        self.write("step", version=version, train_s=round(self.train_s(), 6), loss=loss,
                   samples=samples, workers=list(workers), staleness=staleness, lr=lr)

    def summary(self, evaluation: dict[str, float]) -> dict[str, Any]:
        return {
            "event": "summary",
            "strategy": self.strategy,
            "workers": self.workers,
            "steps": self.steps,
            "samples": self.samples,
            "wall_s": round(self.wall_s(), 3),
            "train_s": round(self.train_s(), 3),
            "final_loss": self.final_loss,
            "dropped": dict(self.dropped),
            "rejected": dict(self.rejected),
            "max_staleness": self.max_staleness,
            "max_clock_gap": self.max_clock_gap,
            "broadcasts": self.broadcasts,
            "lost": self.lost,
            "failed": self.failed,
            "ended": self.ended,
            "resumed_from": self.resumed_from,
            "stopped_by": self.stopped_by,
            "checkpoint": self.checkpoint,
            "unused": self.unused,
            "per_worker": {
                str(rank): {k: round(v, 3) if isinstance(v, float) else v for k, v in c.items()}
                for rank, c in sorted(self.per_worker.items())
            },
            **self.sections,
            **evaluation,
        }

    def close(self, summary: dict[str, Any] | None = None) -> None:
        if self._file is not None:
            if summary is not None:
                self._file.write(json.dumps(summary) + "\n")
            self._file.close()
            self._file = None
