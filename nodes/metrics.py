"""Run metrics: one JSON object a line as training goes, and the closing summary.

The summary holds at least what DESIGN.md lists (strategy, workers, steps, wall_s,
final_loss, dropped, max_staleness, max_clock_gap) plus whatever `evaluate` returned.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import IO, Any


class Metrics:
    def __init__(self, path: Path | None, *, strategy: str, workers: int) -> None:
        self._file: IO[str] | None = path.open("w", encoding="utf-8") if path else None
        self.strategy = strategy
        self.workers = workers
        self.started = time.monotonic()
        self.steps = 0
        self.final_loss: float | None = None
        self.samples = 0
        self.dropped: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.max_staleness = 0
        self.max_clock_gap = 0
        self.lost: list[dict[str, Any]] = []

    def wall_s(self) -> float:
        return time.monotonic() - self.started

    def write(self, event: str, **fields: Any) -> None:
        if self._file is not None:
            record = {"event": event, "wall_s": round(self.wall_s(), 6), **fields}
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def step(self, version: int, loss: float, samples: int, workers: tuple[int, ...]) -> None:
        self.steps = version
        self.final_loss = loss
        self.samples += samples
        self.write("step", version=version, loss=loss, samples=samples, workers=list(workers))

    def summary(self, evaluation: dict[str, float]) -> dict[str, Any]:
        return {
            "event": "summary",
            "strategy": self.strategy,
            "workers": self.workers,
            "steps": self.steps,
            "samples": self.samples,
            "wall_s": round(self.wall_s(), 3),
            "final_loss": self.final_loss,
            "dropped": dict(self.dropped),
            "rejected": dict(self.rejected),
            "max_staleness": self.max_staleness,
            "max_clock_gap": self.max_clock_gap,
            "lost": self.lost,
            **evaluation,
        }

    def close(self, summary: dict[str, Any] | None = None) -> None:
        if self._file is not None:
            if summary is not None:
                self._file.write(json.dumps(summary) + "\n")
            self._file.close()
            self._file = None
