"""A worker's local steps, computed on its compute thread.

`LocalSteps` owns what a step computes with and what it leaves: the model and the SPEC's
loss, fp16's loss scale (nodes.precision), the worker's own optimizer and schedule where
the strategy has workers step their weights (periodic averaging), and the batch to compute
again after a compute on a coordinator's weight set that was written meanwhile
(nodes.in_place). Each shard's range of the gradient that is pushed goes to the outbox
(nodes.outbox) as soon as backward has finished it, so that it can go out while backward
goes on.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tensorbus.bus.messages import Welcome
from tensorbus.bus.shared import SegmentCache
from tensorbus.nodes.compute import OffLoop
from tensorbus.nodes.epochs import RankData
from tensorbus.nodes.faults import Faults
from tensorbus.nodes.flat import FlatModel
from tensorbus.nodes.in_place import OnSet
from tensorbus.nodes.optimizers import OptimizerFactory, make_optimizer
from tensorbus.nodes.outbox import Outbox
from tensorbus.nodes.precision import LossScale, Precision
from tensorbus.nodes.schedules import Schedule, SchedulerFactory, make_schedule

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# fp16 steps in a row skipped for an overflow, after which the gradient goes as it is.
_MAX_OVERFLOWS = 32


class ComputeError(Exception):
    """The SPEC's model or loss raised on a batch; the message says which and what."""


class NotALoss(Exception):
    """What loss() returned was no loss: its message says what it was."""

    def __init__(self, returned: Any) -> None:
        super().__init__(f"a tensor of shape {tuple(returned.shape)}"
                         if isinstance(returned, torch.Tensor) else type(returned).__name__)


class Rewritten(Exception):
    """The coordinator's set the model computed on was written again meanwhile."""


class LocalSteps:
    # A pipeline stage's figures of its last step (nodes.stage_steps); none here.
    busy_s = span_s = 0.0
    held = 0

    def __init__(self, *, model: nn.Module, loss: Loss, flat: FlatModel, shards: int,
                 data: RankData, faults: Faults, optimizer: OptimizerFactory | None,
                 scheduler: SchedulerFactory | None) -> None:
        self.model = model
        self.loss = loss
        self._flat = flat
        self._shards = shards  # coordinator shards: ranges of the flat parameters
        self._data = data
        self._faults = faults
        self._make_optimizer = optimizer  # used only when the strategy has workers own one
        self._make_scheduler = scheduler
        self.optimizer: torch.optim.Optimizer | None = None
        self._schedule: Schedule | None = None  # on its own optimizer, if it has one
        self._clip = 0.0  # the gradient norm its own steps clip to (average's); 0: none
        self._precision = Precision.FULL  # the run's, from the Welcome (nodes.precision)
        self.scale: LossScale | None = None  # fp16's loss scale, kept across rejoins
        self._rank = -1  # the worker's, as errors name it
        self.count = 0  # local steps computed
        self.outbox: Outbox | None = None  # what pushes carry (made when training starts)
        self.last_forward: tuple[float, int] = (math.nan, 0)  # the last forward's loss, samples
        self._on_range: Callable[[int], None] | None = None  # set while the last backward runs
        self.again: tuple[torch.Tensor, torch.Tensor] | None = None  # the batch to redo

    async def configure(self, welcome: Welcome, rank: int, *, weights_pushed: bool,
                        off_loop: OffLoop) -> None:
        """Take a session's terms: an optimizer of its own where it pushes weights, the
        clipping of its steps, and the precision (a loss scale for fp16)."""
        self._rank = rank
        if weights_pushed and self.optimizer is None:
            make = self._make_optimizer or (lambda ps: torch.optim.SGD(ps, lr=welcome.lr))
            # In a thread: a first optimizer may import for seconds (torch._dynamo), and the
            # loop must keep beating meanwhile.
            self.optimizer = await off_loop(make_optimizer, make, self.model.parameters())
            if self._make_scheduler is not None:
                self._schedule = make_schedule(self._make_scheduler, self.optimizer)
        self._clip = welcome.clip_grad_norm if weights_pushed else 0.0
        try:
            self._precision = Precision.parse(welcome.precision)
            self._precision.check(self._flat.device)
        except ValueError as e:
            raise ComputeError(f"worker {rank}: {e}") from None
        if self._precision is Precision.FP16 and self.scale is None:
            self.scale = LossScale()

    def range_done(self, i: int) -> None:
        """Called on the backward thread when shard i's range has all its gradients."""
        on_range = self._on_range
        if on_range is not None:
            on_range(i)

    def compute(self, local_steps: int, current: int, announce: Callable[[int], None] | None,
                on_set: OnSet | None) -> tuple[float, int]:
        """Compute `local_steps` gradients (each followed by a step of its own optimizer
        where it has one) into gradient set `current`; each shard's range of the last one
        is filled into the outbox and `announce`d once backward has finished it. Returns
        the mean loss and the samples seen; raises Rewritten where `on_set`, the set the
        model computed on, was written meanwhile (nothing was announced then)."""
        finished: set[int] = set()
        rewritten: list[int] = []
        # None: the caller makes what is pushed itself (streaming averaging, nodes.streaming).
        outbox = self.outbox
        if outbox is not None:
            outbox.anchor()  # (pushed weights, quantized: the change is taken from here)

        def finish(i: int) -> None:
            assert outbox is not None  # (pushed gradients always go through it)
            if i not in finished:
                finished.add(i)
                if on_set is not None and SegmentCache.generation(on_set.first) != on_set.generation:
                    # The gradient is made (every weight it read, read): had the set been
                    # written meanwhile, its counter would have moved by now (bus.shared).
                    rewritten.append(i)
                    return
                outbox.fill(i, current)
                if announce is not None:
                    announce(i)

        total_loss, samples = 0.0, 0
        scale, overflows = self.scale, 0
        step = 0
        while step < local_steps:
            self._faults.before_step(self.count)
            inputs, targets = self.again or self._data.next()
            self.again = None
            self._flat.begin_backward()
            pushes_gradient = step == local_steps - 1 and self.optimizer is None
            # (A scaled gradient is ready to send once unscaled, after backward.)
            figure = self._backward(inputs, targets,
                                    finish if pushes_gradient and scale is None else None)
            self._flat.gather_grads()
            if scale is not None and not scale.unscale(self._flat.grads):
                overflows += 1
                # Skipped: the next batch instead, on the same weights. Where overflows
                # go on and on (the scale is far below 1), the model itself is not
                # finite: the gradient goes as it is, for the coordinator to judge.
                if overflows < _MAX_OVERFLOWS:
                    self.count += 1
                    continue
            if self.optimizer is not None:
                self._step_optimizer(self.optimizer)
            self.count += 1
            step += 1
            total_loss += figure
            samples += len(inputs)
        if self.optimizer is not None:
            if outbox is not None:
                outbox.fill_weights()
        else:
            for i in range(self._shards):  # those backward did not report (no hook ran)
                finish(i)
        if rewritten:  # (in place, local_steps is 1: this batch is the compute's only one)
            self.count -= local_steps
            self.again = (inputs, targets)
            raise Rewritten
        return total_loss / local_steps, samples

    def _backward(self, inputs: torch.Tensor, targets: torch.Tensor,
                  on_range: Callable[[int], None] | None) -> float:
        """Forward, loss and backward on one batch, `on_range` told of each shard's range
        as backward finishes it; the loss."""
        self._on_range = on_range
        scale = self.scale
        try:
            with self._precision.autocast(self._flat.device):
                loss = self.loss(self.model(inputs), targets)
            if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
                raise NotALoss(loss)
            figure = float(loss.detach())
            self.last_forward = (figure, len(inputs))  # what an early push reports
            (loss * scale.scale if scale is not None else loss).backward()
        except NotALoss as e:
            raise ComputeError(
                f"worker {self._rank}: loss(output, target) returned {e}, not a tensor of one "
                "element: return the loss over the batch as a tensor (its mean, as "
                "torch.nn.functional.cross_entropy gives)") from None
        except Exception as e:
            raise ComputeError(
                f"worker {self._rank}: forward, loss or backward raised {type(e).__name__}: {e}"
            ) from e
        finally:
            self._on_range = None
        return figure

    def _step_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """A step of the worker's own optimizer (periodic averaging's local steps)."""
        if self._clip:
            self._flat.clip_grads(self._clip)
        optimizer.step()
        if self._schedule is not None:  # (its epochs: passes over its shard)
            epochs = self._data.epochs
            assert epochs is not None
            self._schedule.after_step(epochs.position // epochs.length if epochs.length > 0 else None)
