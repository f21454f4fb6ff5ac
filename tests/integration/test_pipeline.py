"""Integration: pipeline stages over the bus, in one event loop, over real ZeroMQ on loopback.

A coordinator a stage and a StageWorker a stage and pipeline, as run.pipelines makes them,
train examples/digits_pipeline.py under sync with SGD and momentum. The central check is
the equivalence the issue asks for: a pipeline of 2 and of 4 stages gives the weights of
one process accumulating the same micro-batches, to 1e-5; so do 2 pipelines of 2 stages
(data x pipeline), against one process on the batches of both; and under average, with
one pipeline, against local SGD by hand.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from specs import load_example

from tensorbus.nodes import Coordinator, CoordinatorConfig, WorkerConfig
from tensorbus.nodes.pipeline_directory import PipelineDirectory
from tensorbus.nodes.stage_worker import StageWorker
from tensorbus.nodes.stages import Stage, build_stage, cut, whole
from tensorbus.strategies import PeriodicAveraging, Sync

pytestmark = pytest.mark.timeout(30)

spec = load_example("digits_pipeline")
LR, MOMENTUM, BATCH = 0.05, 0.9, 16


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


async def _train(stages: int, pipelines: int, micro: int, steps: int | None, *,
                 schedule: str = "1f1b", average_every: int = 0, epochs: int | None = None,
                 data: Any = spec.data) -> tuple[list[Coordinator], list[dict[str, Any]]]:
    torch.manual_seed(0)
    models = cut(spec.stages(), stages)
    directory = PipelineDirectory(stages)

    def strategy() -> Sync | PeriodicAveraging:
        if average_every:
            return PeriodicAveraging(workers=pipelines, average_every=average_every)
        return Sync(workers=pipelines)

    coordinators = [
        Coordinator(model=models[s], strategy=strategy(),
                    config=CoordinatorConfig(batch_size=BATCH, steps=steps, epochs=epochs,
                                             pipeline=stages,
                                             stage=s, micro_batches=micro, schedule=schedule,
                                             heartbeat_s=0.1, timeout_s=5.0),
                    optimizer=_sgd, directory=directory)
        for s in range(stages)]
    endpoints = [c.bind() for c in coordinators]
    workers = [
        StageWorker(stage=s, stages=stages, model=build_stage(spec.stages, s, stages),
                    data=data, loss=spec.loss, optimizer=_sgd,
                    config=WorkerConfig(connect=endpoints[s], rank=d, request_timeout_s=5.0))
        for d in range(pipelines) for s in range(stages)]
    results = await asyncio.gather(*(c.run() for c in coordinators), *(w.run() for w in workers))
    return coordinators, list(results[:stages])


def _single_process(steps: int, pipelines: int, micro: int) -> Stage:
    """The same micro-batches accumulated in one process: each pipeline's batch is one
    slice of the global batch, cut into `micro`, each weighted by its share."""
    torch.manual_seed(0)
    model = Stage(*spec.stages())
    optimizer = _sgd(model.parameters())
    batches = iter(spec.data(0, 1, pipelines * BATCH))
    for _ in range(steps):
        inputs, targets = next(batches)
        optimizer.zero_grad()
        for x, y in zip(inputs.split(BATCH), targets.split(BATCH), strict=True):
            for xm, ym in zip(torch.tensor_split(x, micro), torch.tensor_split(y, micro), strict=True):
                weight = len(ym) / (len(y) * pipelines)
                (spec.loss(model(xm), ym) * weight).backward()
        optimizer.step()
    return model


def _difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    pairs = zip(a.parameters(), b.parameters(), strict=True)
    return max((x - y).abs().max().item() for x, y in pairs)


@pytest.mark.parametrize(("stages", "schedule"), [(2, "1f1b"), (4, "1f1b"), (4, "gpipe")])
def test_a_pipeline_gives_the_weights_of_one_process_accumulating_its_micro_batches(
        stages: int, schedule: str) -> None:
    steps, micro = 4, 4
    coordinators, summaries = asyncio.run(_train(stages, 1, micro, steps, schedule=schedule))
    reference = _single_process(steps, 1, micro)
    assert [s["steps"] for s in summaries] == [steps] * stages
    assert _difference(whole([c.model for c in coordinators]), reference) < 1e-5
    # Every stage reports the batch's loss, carried up from the last stage.
    losses = {round(s["final_loss"], 6) for s in summaries}
    assert len(losses) == 1
    # Its figures: time in forward and backward, the step's span, the activations held.
    for stage, summary in enumerate(summaries):
        figures = summary["per_worker"]["0"]
        assert 0 < figures["busy_s"] <= figures["span_s"]
        held = micro if schedule == "gpipe" else min(stages - stage, micro)
        assert figures["held"] == held
        assert figures["peak_bytes"] > 0


def test_two_pipelines_of_two_stages_give_the_weights_of_one_process_on_both_batches() -> None:
    steps, micro = 3, 2
    coordinators, _ = asyncio.run(_train(2, 2, micro, steps))
    reference = _single_process(steps, 2, micro)
    assert _difference(whole([c.model for c in coordinators]), reference) < 1e-5


def test_average_with_one_pipeline_is_local_sgd_on_the_whole_model() -> None:
    # Each stage's worker steps its own optimizer (SGD with momentum) on its stage's
    # accumulated gradient, and with one pipeline the average is its weights.
    steps, micro, every = 2, 2, 3
    coordinators, summaries = asyncio.run(_train(2, 1, micro, steps, average_every=every))
    reference = _single_process(steps * every, 1, micro)
    assert [s["steps"] for s in summaries] == [steps, steps]
    assert _difference(whole([c.model for c in coordinators]), reference) < 1e-5


def test_under_epochs_the_stages_that_draw_no_batches_learn_a_generator_s_length() -> None:
    # data() without len(): only the first stage reads it, and tells the others its length
    # once its first pass has ended, so that every stage's coordinator ends at 2 epochs.
    def generated(rank: int, world_size: int, batch_size: int) -> Any:
        yield from list(spec.data(rank, world_size, batch_size))[:5]

    _, summaries = asyncio.run(_train(2, 1, 2, None, epochs=2, data=generated))
    assert [s["steps"] for s in summaries] == [10, 10]
