"""Copies of the master weights taken during training and evaluated after it (nodes.evalpoints):
each `eval` line holds what evaluate() says of the weights as they were when it was taken,
and the final weights are the master's again afterwards."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from tensorbus.nodes import Coordinator, CoordinatorConfig
from tensorbus.nodes.evalpoints import EvalPoints, EvaluateError, figures
from tensorbus.nodes.metrics import Metrics
from tensorbus.strategies import Sync

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


def test_figures_are_numbers_whatever_number_type_evaluate_gives() -> None:
    import numpy as np

    said = figures(lambda m: {"a": torch.tensor(0.25), "b": np.float32(1.5), "c": 3, "d": [2.0][0]},
                   nn.Linear(2, 2))
    assert said == {"a": 0.25, "b": 1.5, "c": 3.0, "d": 2.0}
    assert all(type(v) is float for v in said.values())  # (json.dumps takes them all)


@pytest.mark.parametrize(("result", "says"), [
    ({"acc": torch.ones(3)}, "returned 'acc' as Tensor, not a number"),
    ({"acc": "high"}, "returned 'acc' as str, not a number"),
    ({1: 0.5}, "returned the name 1, which is not a str"),
    ({"steps": 5}, "returned the name 'steps', which the summary uses for its own"),
    ([0.5], "returned list: it must return a dict of names to numbers"),
])
def test_what_is_not_names_to_numbers_is_said_so(result: object, says: str) -> None:
    with pytest.raises(EvaluateError, match=re.escape(says)) as raised:
        figures(lambda m: result, nn.Linear(2, 2), taken=("steps",))  # type: ignore[arg-type, return-value]
    assert raised.value.__cause__ is None  # (the SPEC's traceback would not help)


def test_an_evaluate_that_raises_is_said_with_its_cause() -> None:
    def evaluate(model: nn.Module) -> dict[str, float]:
        raise KeyError("test set")

    with pytest.raises(EvaluateError, match=re.escape("evaluate() raised KeyError: 'test set'")) as e:
        figures(evaluate, nn.Linear(2, 2))
    assert isinstance(e.value.__cause__, KeyError)


@pytest.mark.parametrize("training", [True, False])
def test_evaluate_sees_eval_mode_and_the_mode_is_given_back(training: bool) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5))
    model.train(training)
    seen: list[bool] = []

    def evaluate(m: nn.Module) -> dict[str, float]:
        seen.append(m.training or any(sub.training for sub in m.modules()))
        return {"x": 1.0}

    assert figures(evaluate, model) == {"x": 1.0}
    assert seen == [False]
    assert all(sub.training is training for sub in model.modules())

    def failing(m: nn.Module) -> dict[str, float]:
        raise RuntimeError("boom")

    with pytest.raises(EvaluateError):
        figures(failing, model)
    assert model.training is training  # given back, even when evaluate() raised
