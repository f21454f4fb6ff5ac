"""Accuracy over training time without slowing training: copies of the master weights
taken every `eval_every_s` seconds of training time, evaluated once training is over
(`eval` lines of the metrics file, which `tensorbus plot` draws)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from nodes.master import Master
from nodes.metrics import Metrics

Evaluate = Callable[[nn.Module], dict[str, float]]


@dataclass
class _Point:
    """A copy of the weights taken during training."""

    version: int
    samples: int
    train_s: float
    weights: tuple[torch.Tensor, ...]


class EvalPoints:
    """The copies taken so far, and when the next is due. Inert without `every` or
    without `evaluate`."""

    def __init__(self, every: float | None, evaluate: Evaluate | None) -> None:
        self._every = every if evaluate is not None else None
        self._evaluate = evaluate
        self._points: list[_Point] = []
        self._next_s = 0.0

    def due(self, train_s: float) -> bool:
        """Whether a copy is to be taken at `train_s` seconds of training."""
        return self._every is not None and train_s >= self._next_s

    def take(self, master: Master, version: int, samples: int, train_s: float) -> None:
        """Copy the master's weights, of `version`, as they are at `train_s`."""
        if self._every is None:
            return
        weights = tuple(w.clone() for w in master.flat.weights)
        self._points.append(_Point(version, samples, train_s, weights))
        self._next_s = train_s + self._every

    def evaluate(self, master: Master, metrics: Metrics) -> None:
        """Evaluate each copy on the master's model (its weights loaded in turn, the final
        ones put back after), one `eval` line each; then forget them."""
        if not self._points or self._evaluate is None:
            return
        flat = master.flat
        final = tuple(w.clone() for w in flat.weights)
        master.own()  # the final version may still be on its way to the workers
        try:
            for point in self._points:
                flat.load(point.weights)
                figures = self._evaluate(flat.module)
                metrics.write("eval", version=point.version, samples=point.samples,
                              train_s=round(point.train_s, 6), **figures)
        finally:
            flat.load(final)
        self._points.clear()
