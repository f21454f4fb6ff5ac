"""Copies of the master weights taken during training and evaluated after it (nodes.evalpoints):
each `eval` line holds what evaluate() says of the weights as they were when it was taken,
and the final weights are the master's again afterwards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from nodes import Coordinator, CoordinatorConfig
from nodes.evalpoints import EvalPoints
from nodes.metrics import Metrics
from strategies import Sync

pytestmark = pytest.mark.timeout(30)


def _weight_sum(model: nn.Module) -> dict[str, float]:
    return {"sum": float(sum(p.detach().sum() for p in model.parameters()))}


def test_each_copy_is_evaluated_as_taken_and_the_final_weights_come_back(tmp_path: Path) -> None:
    torch.manual_seed(0)
    master = Coordinator(model=nn.Linear(6, 3), strategy=Sync(workers=1),
                         config=CoordinatorConfig(batch_size=4, steps=5)).master
    points = EvalPoints(1.0, _weight_sum)
    sums = []
    for version, train_s in enumerate((0.0, 0.4, 1.1, 1.5, 2.2), start=1):
        if points.due(train_s):
            points.take(master, version, samples=4 * version, train_s=train_s)
            sums.append(_weight_sum(master.flat.module)["sum"])
        with torch.no_grad():
            master.flat.weights[0].add_(1.0)  # the next version
    final = [w.clone() for w in master.flat.weights]
    metrics = Metrics(tmp_path / "m.jsonl", strategy="sync", workers=1)
    points.evaluate(master, metrics)
    metrics.close()
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [(r["version"], r["samples"], r["train_s"]) for r in lines] == [
        (1, 4, 0.0), (3, 12, 1.1), (5, 20, 2.2)]  # every second of training, not each step
    assert [r["sum"] for r in lines] == pytest.approx(sums)
    assert len(set(sums)) == 3  # (each copy is of its own version)
    assert all(torch.equal(a, b) for a, b in zip(master.flat.weights, final, strict=True))
    metrics = Metrics(tmp_path / "again.jsonl", strategy="sync", workers=1)
    points.evaluate(master, metrics)  # evaluated once: forgotten after
    metrics.close()
    assert (tmp_path / "again.jsonl").read_text() == ""


def test_without_a_period_or_an_evaluate_nothing_is_taken(tmp_path: Path) -> None:
    master = Coordinator(model=nn.Linear(6, 3), strategy=Sync(workers=1),
                         config=CoordinatorConfig(batch_size=4, steps=5)).master
    for points in (EvalPoints(None, _weight_sum), EvalPoints(1.0, None)):
        assert not points.due(10.0)
        points.take(master, 1, samples=4, train_s=10.0)
        metrics = Metrics(tmp_path / "m.jsonl", strategy="sync", workers=1)
        points.evaluate(master, metrics)
        metrics.close()
        assert (tmp_path / "m.jsonl").read_text() == ""
