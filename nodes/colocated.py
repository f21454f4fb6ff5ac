"""Coordinator shards colocated with the workers: worker r of N also serves shard r of N.

The model's flat parameters are cut into N ranges (`bus.layout.Layout.shard`), and each
worker process runs, on one event loop, a `Coordinator` over its range (a `ShardModel`) and
a `Worker` that pushes every shard its range and loads every shard's weights, as with any
sharded parameter server. The worker reaches the shard beside it in-process (inproc over
a shared `bus.transport.Hub`: no TCP, no copy), the others over TCP; and its model computes
on the buffers the shard made its range's newest version in (`nodes.colocated_sets`: no copy).

What it buys: each process sends (N-1)/N of a model's gradient and (N-1)/N of its weights
per step, and receives as much: the bytes of a ring all-reduce, where a central coordinator
moves N whole models in and N out, from a process that also needs a core. Each shard takes
its optimizer step on 1/N of the parameters. Sync over colocated shards steps exactly as
one coordinator does (tests/test_colocated.py).

What it costs is what DDP costs: every process holds part of the model, so a lost process
loses its shard and the run cannot go on without it (`--checkpoint-dir` lets it resume).
So it serves the strategies whose workers all wait for every version (sync, with or
without backups, and periodic averaging), with a fixed set of workers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from torch import nn

from tensorbus.bus.buffers import SendBuffers
from tensorbus.bus.layout import Layout
from tensorbus.bus.shared import SharedWeightPool
from tensorbus.bus.transport import Hub
from tensorbus.nodes.colocated_sets import ColocatedSets
from tensorbus.nodes.config import CoordinatorConfig, WorkerConfig
from tensorbus.nodes.coordinator import Coordinator, Progress
from tensorbus.nodes.evalpoints import Evaluate
from tensorbus.nodes.link import RunFailedError
from tensorbus.nodes.master import shared_version_sets, shared_weight_pool
from tensorbus.nodes.optimizers import OptimizerFactory
from tensorbus.nodes.schedules import SchedulerFactory
from tensorbus.nodes.shards import ShardModel
from tensorbus.nodes.worker import Data, Loss, Worker, WorkerReport
from tensorbus.strategies.base import PushKind, Strategy, Wait


class Colocated:
    """Worker `index` of `count` and the coordinator shard it serves, in this process.

    `model` is the whole model, built alike (same seed) in every process: the shard takes
    its range of it, and the worker trains it. `bind()`, then `run(worker_config)` with
    every shard's endpoint in shard order (this one's included: it is reached in-process).
    `evaluate`, if given, runs on the worker's model once it holds the final weights of
    every shard (give it to one process: its coordinator's summary reports the figures).
    """

    def __init__(
        self,
        *,
        index: int,
        count: int,
        model: nn.Module,
        data: Data,
        loss: Loss,
        strategy: Strategy,
        config: CoordinatorConfig,
        optimizer: OptimizerFactory | None = None,
        scheduler: SchedulerFactory | None = None,
        lr: float = 0.01,
        evaluate: Evaluate | None = None,
        on_step: Callable[[Progress], None] | None = None,
    ) -> None:
        if count < 2:
            raise ValueError(f"colocated shards need at least 2 workers, got {count}: with "
                             "one, run a coordinator and a worker")
        if strategy.rhythm.wait is not Wait.NEWER:
            raise ValueError(
                f"colocated shards serve the strategies whose workers wait for every version "
                f"(sync, average), not {strategy.name}: a process that falls behind holds a "
                "shard everyone needs; use a central coordinator or --shards for it")
        if config.max_workers is not None and config.max_workers != strategy.workers:
            raise ValueError("colocated shards train a fixed set of workers (each serves a "
                             "shard): drop max_workers")
        self.index, self.count = index, count
        self._model, self._data, self._loss, self._optimizer = model, data, loss, optimizer
        self._scheduler = scheduler
        self.hub = Hub()
        try:
            shard = ShardModel(model, index, count)
            layout = Layout.of(model.named_parameters())
            self.colocated_sets: ColocatedSets | None = None
            pool: SendBuffers | None = None
            shared_pool: SharedWeightPool | None = None
            if strategy.rhythm.push is PushKind.GRADIENT:
                # Where the worker pushes gradients (it never writes its weights), the
                # shard makes its versions in ranges of whole-model sets that the worker's
                # model then computes on, without copying the range (see nodes.colocated_sets);
                # sets in shared memory, where the workers of the other processes of this
                # host read the range where it lies (bus.shared.SharedWeightPool).
                shared_pool = shared_weight_pool(config)
                self.colocated_sets = ColocatedSets(layout, shard.shard, index, allocate=(
                    shared_pool.allocator(layout.sizes(), layout.allocate) if shared_pool else None))
                pool = (shared_version_sets(self.colocated_sets.allocate, shared_pool,
                                            held=self.colocated_sets.held)
                        if shared_pool is not None
                        else SendBuffers(self.colocated_sets.allocate, held=self.colocated_sets.held))
            self.coordinator = Coordinator(
                model=shard, strategy=strategy, config=config,
                optimizer=optimizer, lr=lr, on_step=on_step, hub=self.hub, pool=pool,
                scheduler=scheduler,
                shared_pool=shared_pool,
                # The whole model is the worker's, and it holds the final weights by then.
                evaluate=(lambda _: evaluate(model)) if evaluate is not None else None,
            )
        except BaseException:
            self.hub.close()  # nobody else will
            raise
        self.worker: Worker | None = None

    @property
    def model(self) -> nn.Module:
        """The whole model this process trains: every shard's final weights once `run` has
        returned (its worker loads them before it leaves)."""
        return self._model

    def bind(self) -> str:
        """Bind this shard; the endpoint the other workers connect to."""
        return self.coordinator.bind()

    async def run(self, worker: WorkerConfig) -> tuple[dict[str, Any], WorkerReport]:
        """Serve the shard and train until the run ends; the shard's summary and the
        worker's report. If either side fails, the other is stopped and the error raised."""
        tasks: list[asyncio.Task[Any]] = []
        try:
            endpoints = list(worker.endpoints)
            if len(endpoints) != self.count:
                raise ValueError(f"{len(endpoints)} endpoints for {self.count} colocated shards: "
                                 "give every shard's, in shard order, this one's included")
            self.bind()
            endpoints[self.index] = self.coordinator.inproc_endpoint
            self.worker = Worker(model=self._model, data=self._data, loss=self._loss,
                                 config=replace(worker, connect=endpoints, rank=self.index),
                                 optimizer=self._optimizer, hub=self.hub, colocated_sets=self.colocated_sets,
                                 scheduler=self._scheduler)
            training = asyncio.create_task(self.worker.run())
            # Evaluated once our worker is done: it then holds every shard's final weights.
            trained = asyncio.create_task(_after(training))
            serving = asyncio.create_task(self.coordinator.run(before_evaluate=trained))
            tasks += [training, serving, trained]
            done, _ = await asyncio.wait({training, serving}, return_when=asyncio.FIRST_COMPLETED)
            if (serving not in done and not training.cancelled()
                    and isinstance(training.exception(), RunFailedError)):
                # A shard failed the run (ours, or another): ours stops gracefully first,
                # and raises its own failure if it is ours, else our worker's word of it.
                self.coordinator.request_stop("the run failed", quiet=True)
                await serving
                training.result()
            for task in done:
                task.result()  # a failure of either side, raised here
            if serving not in done:
                # Our worker was stopped (by another shard, or a signal there): so is the
                # run. Stop gracefully too, rather than see the workers leave and fail.
                self.coordinator.request_stop("the run stopped", quiet=True)
            return await serving, await training
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.hub.close()  # after both sides closed their sockets (or failed to start)


async def _after(task: asyncio.Task[Any]) -> None:
    """Wait for `task` without taking its result (run() does) or cancelling it."""
    await asyncio.wait({task})

