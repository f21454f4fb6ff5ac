"""What is evaluated once training is over: copies of the master weights taken every
`eval_every_s` seconds of training time (`eval` lines of the metrics file, which `tensorbus
plot` draws), then the final model, whose figures go in the run's summary. Taking copies,
not evaluating during training, keeps the evaluation from slowing training."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tensorbus.nodes.failures import TrainingError
from tensorbus.nodes.master import Master
from tensorbus.nodes.metrics import Metrics

Evaluate = Callable[[nn.Module], dict[str, float]]

# The fields of an `eval` line that evaluate()'s names must not overwrite.
_EVAL_FIELDS = ("event", "wall_s", "version", "samples", "train_s", "epoch")


class EvaluateError(Exception):
    """evaluate() raised, or returned something other than names to numbers; the message
    says which."""


def figures(evaluate: Evaluate, model: nn.Module, *, taken: Collection[str] = ()) -> dict[str, float]:
    """evaluate(model) as names to floats (a tensor of one element, or a numpy number, is
    taken as its value), so that the metrics file and the summary can hold them; names in
    `taken` are the record's own. EvaluateError if it raised or returned anything else.
    evaluate() gets the model in eval mode (dropout off, BatchNorm on its running
    statistics), and the model's mode is given back after."""
    training = model.training
    model.eval()
    try:
        result = evaluate(model)
    except Exception as e:
        raise EvaluateError(f"evaluate() raised {type(e).__name__}: {e}") from e
    finally:
        model.train(training)
    if not isinstance(result, Mapping):
        raise EvaluateError(f"evaluate(model) returned {type(result).__name__}: it must return "
                            "a dict of names to numbers, such as {'accuracy': 0.91}")
    numbers = {}
    for name, value in result.items():
        if not isinstance(name, str) or name in taken:
            raise EvaluateError(
                f"evaluate(model) returned the name {name!r}, which "
                + ("is not a str" if not isinstance(name, str) else "the summary uses for its own")
                + f": name its figures otherwise (taken: {', '.join(sorted(taken))})")
        try:
            numbers[name] = float(value)
        except Exception:  # noqa: BLE001 - whatever float() refuses is said so
            raise EvaluateError(
                f"evaluate(model) returned {name!r} as {type(value).__name__}, not a number: "
                "give a float (or a tensor of one element, or a numpy number)") from None
    return numbers


@dataclass
class _Point:
    """A copy of the weights taken during training."""

    version: int
    samples: int
    train_s: float
    epoch: int | None  # passes over the shards done, where they are counted
    weights: tuple[torch.Tensor, ...]
    buffers: tuple[torch.Tensor, ...]  # the model's (nodes.model_buffers), as they were


class EvalPoints:
    """The copies taken so far, and when the next is due: every `every` seconds of
    training from its start, or at the end of every `every_epochs` passes over the
    shards. Inert without either, or without `evaluate`."""

    def __init__(self, every: float | None, evaluate: Evaluate | None, *,
                 every_epochs: int | None = None) -> None:
        self._every = every if evaluate is not None else None
        self._every_epochs = every_epochs if evaluate is not None else None
        self._evaluate = evaluate
        self._points: list[_Point] = []
        self._next_s = 0.0
        self._next_epoch = every_epochs or 0

    @property
    def by_epoch(self) -> bool:
        return self._every_epochs is not None

    def due(self, train_s: float, epoch: int | None = None) -> bool:
        """Whether a copy is to be taken at `train_s` seconds of training, `epoch` passes
        done (None: not known yet)."""
        if self._every_epochs is not None:
            return epoch is not None and epoch >= self._next_epoch
        return self._every is not None and train_s >= self._next_s

    def take(self, master: Master, version: int, samples: int, train_s: float,
             epoch: int | None = None) -> None:
        """Copy the master's weights, of `version`, and its model's buffers, as they are at
        `train_s`."""
        if self._every is None and self._every_epochs is None:
            return
        if self._every_epochs is not None and epoch is None:
            return  # (by epoch: not at the start)
        weights = tuple(w.clone() for w in master.flat.weights)
        buffers = master.flat.model_buffers.copy()
        self._points.append(_Point(version, samples, train_s, epoch, weights, buffers))
        if self._every is not None:
            self._next_s = train_s + self._every
        if self._every_epochs is not None and epoch is not None:
            self._next_epoch = epoch + self._every_epochs

    def evaluate(self, master: Master, metrics: Metrics) -> None:
        """Evaluate each copy on the master's model (its weights loaded in turn, the final
        ones put back after), one `eval` line each; then forget them."""
        if not self._points or self._evaluate is None:
            return
        flat = master.flat
        final = tuple(w.clone() for w in flat.weights)
        final_buffers = flat.model_buffers.copy()
        master.own()  # the final version may still be on its way to the workers
        try:
            for point in self._points:
                flat.load(point.weights)
                flat.model_buffers.load(point.buffers)
                said = figures(self._evaluate, flat.module, taken=_EVAL_FIELDS)
                epoch = {"epoch": point.epoch} if point.epoch is not None else {}
                metrics.write("eval", version=point.version, samples=point.samples,
                              train_s=round(point.train_s, 6), **epoch, **said)
        finally:
            flat.load(final)
            flat.model_buffers.load(final_buffers)
        self._points.clear()


def summarize(points: EvalPoints, evaluate: Evaluate | None, master: Master,
              metrics: Metrics) -> dict[str, Any]:
    """Evaluate the copies, then the final model (its buffers already the run's newest),
    and close the metrics with the run's summary, which is returned. An `evaluate` that
    fails keeps what training made: the summary without its figures, then TrainingError."""
    if metrics.trained_from is None and metrics.stopped_by is not None:
        evaluate = None  # stopped (Ctrl-C, say) before training began: nothing to score
    try:
        if evaluate is not None:
            points.evaluate(master, metrics)
        evaluation = figures(evaluate, master.flat.module, taken=metrics.summary({})) if evaluate else {}
    except EvaluateError as e:
        metrics.close(metrics.summary({}))
        raise TrainingError(str(e)) from e.__cause__
    summary = metrics.summary(evaluation)
    metrics.close(summary)
    return summary
