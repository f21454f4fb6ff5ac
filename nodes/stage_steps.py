"""A pipeline stage's local steps: its micro-batches, forward and backward, in schedule order.

A stage worker's step is its part of one batch's pass through the pipeline (run on the
compute thread, as any worker's step is: nodes.local_steps). The first stage draws the
batch from its shard and cuts it into M micro-batches; every stage then runs the actions
of its schedule (nodes.pipeline_order):

- forward of micro-batch m: its inputs (the first stage's cut of the batch; any other's,
  the previous stage's outputs, from nodes.neighbours), through the stage; the outputs go
  to the next stage with the micro-batch's targets, and are kept, with their graph, until
  the backward of m. The last stage takes the SPEC's loss on its outputs and targets,
  weighted by the micro-batch's share of the batch, n_m / n, so that the weighted losses
  add up to the loss over the whole batch;
- backward of m: from the weighted loss (the last stage), or from the gradients of the
  outputs that the next stage sent back; the gradients of the stage's parameters
  accumulate, and those of its floating-point inputs go to the previous stage, with the
  micro-batch's share of the loss. Its activations are let go of then.

After the last action the stage's parameters hold the gradient of the batch's loss, as
one process accumulating the same micro-batches in the same order would have: pushed as
any gradient is (or stepped on by its own optimizer under average). Each stage reports the
batch's loss, which the last stage's shares carry up the pipeline.

What a step is measured by (its push carries them): its seconds in forward and backward
alone (`busy_s`), the seconds from its first action's start to its last one's end
(`span_s`: on the first stage, the whole pipeline's step), and the most micro-batches
whose activations it held at once (`held`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tensorbus.bus.clock import SYSTEM_CLOCK, Clock
from tensorbus.bus.messages import ActivationGrads, Activations, Kind, Welcome
from tensorbus.bus.pieces import Received, whole
from tensorbus.nodes.compute import OffLoop
from tensorbus.nodes.in_place import OnSet
from tensorbus.nodes.local_steps import ComputeError, LocalSteps, NotALoss
from tensorbus.nodes.neighbours import Neighbours
from tensorbus.nodes.pipeline_order import Action, Op, Schedule, order


class StageSteps(LocalSteps):
    """LocalSteps whose step is a pipeline stage's part of a batch."""

    def __init__(self, *, neighbours: Neighbours, clock: Clock = SYSTEM_CLOCK,
                 version: Callable[[], int] = lambda: 0, **local: Any) -> None:
        """`version`: the version of the stage's weights now (what its activations say)."""
        super().__init__(**local)
        self._neighbours = neighbours
        self._clock = clock
        self._version = version
        self.stage, self.stages = neighbours.stage, neighbours.stages
        self.micro_batches = 0  # (the Welcome's, once configured)
        self._order: list[Action] = []
        self.busy_s = self.span_s = 0.0  # the last step's (see the module's docstring)
        self.held = 0

    async def configure(self, welcome: Welcome, rank: int, *, weights_pushed: bool,
                        off_loop: OffLoop) -> None:
        await super().configure(welcome, rank, weights_pushed=weights_pushed, off_loop=off_loop)
        if self.scale is not None:
            raise ComputeError(f"stage {self.stage}: --precision fp16-mixed scales the loss on "
                               "the last stage and checks every stage's gradients as one: not "
                               "done across pipeline stages; use bf16-mixed")
        if welcome.micro_batches < 1:
            raise ComputeError(f"stage {self.stage}: the coordinator asks for "
                               f"{welcome.micro_batches} micro-batches")
        self.micro_batches = welcome.micro_batches
        self._order = order(Schedule.parse(welcome.schedule), self.stage, self.stages,
                            self.micro_batches)

    def compute(self, local_steps: int, current: int, announce: Any, on_set: OnSet | None
                ) -> tuple[float, int]:
        """`local_steps` steps of this stage into gradient set `current`, each the stage's
        part of one batch (each followed by a step of its own optimizer where it has one);
        then the gradient (or the weights) made ready to push, and `announce`d."""
        outbox = self.outbox
        assert outbox is not None
        outbox.anchor()
        total_loss, samples = 0.0, 0
        self.busy_s = self.span_s = 0.0
        for _ in range(local_steps):
            self._faults.before_step(self.count)
            self._flat.begin_backward()
            loss, seen = self._batch(self.count)
            self._flat.gather_grads()
            if self.optimizer is not None:
                self._step_optimizer(self.optimizer)
            self.count += 1
            total_loss += loss
            samples += seen
        self._neighbours.flush()
        # (Before the announcement: the push that it lets go reads it.)
        self.last_forward = (total_loss / local_steps, samples)
        if self.optimizer is not None:
            self._flat.stage(weights=True)
            outbox.fill_weights()
        else:
            for i in range(self._shards):
                outbox.fill(i, current)
                if announce is not None:
                    announce(i)
        return total_loss / local_steps, samples

    def _batch(self, step: int) -> tuple[float, int]:
        """The stage's actions for step `step`: its loss over the batch, and its samples."""
        first, last = self.stage == 0, self.stage == self.stages - 1
        cut: list[tuple[torch.Tensor, torch.Tensor]] = []
        batch = 0
        if first:
            inputs, targets = self._data.next()
            batch = len(inputs)
            if batch < self.micro_batches:
                raise ComputeError(f"{self._name}: a batch of {batch} samples cannot be cut into "
                                   f"{self.micro_batches} micro-batches: raise --batch-size or "
                                   "lower --micro-batches")
            cut = list(zip(torch.tensor_split(inputs, self.micro_batches),
                           torch.tensor_split(targets, self.micro_batches), strict=True))
        passed = not first  # (the first stage drew the batch: counted here once its part comes)
        # micro -> what its backward needs: (inputs, outputs, targets' size) or the weighted loss
        kept: dict[int, Any] = {}
        loss, samples, held = 0.0, 0, 0
        began = self._clock.monotonic()
        for action in self._order:
            if action.op is Op.FORWARD:
                if first:
                    inputs_m, targets_m = cut[action.micro]
                    received: tuple[torch.Tensor, ...] = (inputs_m,)
                else:
                    message = self._take(Kind.ACTIVATIONS, step, action.micro)
                    assert isinstance(message, Activations)
                    received = tuple(_whole(t) for t in message.tensors[:message.outputs])
                    targets_m = _whole(message.tensors[message.outputs])
                    batch = message.batch
                    if passed:
                        self._data.passed(message.shard)
                        passed = False
                started = self._clock.monotonic()
                kept[action.micro] = self._forward(step, action.micro, received, targets_m,
                                                   batch, last)
                samples += len(targets_m)
                held = max(held, len(kept))
            else:
                gradients: tuple[torch.Tensor, ...] = ()
                share = 0.0
                if not last:
                    message = self._take(Kind.ACTIVATION_GRADS, step, action.micro)
                    assert isinstance(message, ActivationGrads)
                    gradients = tuple(_whole(t) for t in message.tensors)
                    share = message.loss
                started = self._clock.monotonic()
                if action.micro > 0:  # (backwards run in micro-batch order: nodes.pipeline_order)
                    self._flat.accumulate()
                share = self._backward_micro(step, action.micro, kept.pop(action.micro),
                                             gradients, share)
                loss += share
            self.busy_s += self._clock.monotonic() - started
        self.span_s += self._clock.monotonic() - began
        self.held = held
        return loss, samples

    @property
    def _name(self) -> str:
        """How errors name this stage's worker."""
        return f"stage {self.stage} of pipeline {self._rank}"

    def _take(self, kind: Kind, step: int, micro: int) -> Any:
        what = ("the activations" if kind is Kind.ACTIVATIONS else "the gradients") + \
            f" of micro-batch {micro} of step {step}"
        return self._neighbours.take(kind, step, micro, what)

    def _forward(self, step: int, micro: int, inputs: tuple[torch.Tensor, ...],
                 targets: torch.Tensor, batch: int, last: bool) -> Any:
        """Forward of one micro-batch: what its backward will need."""
        for x in inputs:
            if x.is_floating_point() and self.stage > 0:
                x.requires_grad_(True)  # (a leaf: its gradient goes back to the previous stage)
        try:
            with self._precision.autocast(self._flat.device):
                outputs = self.model(*inputs)
                if last:
                    value = self.loss(outputs, targets)
        except Exception as e:
            raise ComputeError(f"{self._name}: forward"
                               f"{' or loss' if last else ''} raised {type(e).__name__}: {e}") from e
        if last:
            if not (isinstance(value, torch.Tensor) and value.numel() == 1):
                raise ComputeError(
                    f"{self._name}: loss(output, target) returned "
                    f"{NotALoss(value)}, not a tensor of one element: return the loss over the "
                    "batch as a tensor (its mean, as torch.nn.functional.cross_entropy gives)")
            return inputs, value * (len(targets) / batch)
        sent = outputs if isinstance(outputs, tuple | list) else (outputs,)
        if not sent or not all(isinstance(t, torch.Tensor) for t in sent):
            raise ComputeError(f"{self._name}: the stage returned "
                               f"{type(outputs).__name__}: a stage that is not the last must "
                               "return a tensor or a tuple of tensors")
        self._neighbours.send(Activations(
            sender=self._rank, version=self._version(), stage=self.stage, step=step, micro=micro,
            outputs=len(sent), batch=batch, shard=self._data.length,
            tensors=(*(t.detach().contiguous() for t in sent), targets.contiguous())))
        return inputs, tuple(sent)

    def _backward_micro(self, step: int, micro: int, kept: Any,
                        gradients: tuple[torch.Tensor, ...], share: float) -> float:
        """Backward of one micro-batch; its share of the batch's loss."""
        inputs, made = kept
        try:
            if isinstance(made, torch.Tensor):  # the last stage's weighted loss
                share = float(made.detach())
                made.backward()
            else:
                floats = [t for t in made if t.is_floating_point()]
                if len(floats) != len(gradients):
                    raise ComputeError(
                        f"{self._name}: {len(gradients)} gradients came back for "
                        f"{len(floats)} floating-point outputs of micro-batch {micro}")
                pairs = [(t, g) for t, g in zip(floats, gradients, strict=True) if t.requires_grad]
                if pairs:
                    torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        except ComputeError:
            raise
        except Exception as e:
            raise ComputeError(f"{self._name}: backward raised "
                               f"{type(e).__name__}: {e}") from e
        if self.stage > 0:
            back = tuple((x.grad if x.grad is not None else torch.zeros_like(x)).contiguous()
                         for x in inputs if x.is_floating_point())
            self._neighbours.send(ActivationGrads(sender=self._rank, stage=self.stage, step=step,
                                                  micro=micro, loss=share, tensors=back))
        return share


def _whole(tensor: Received) -> torch.Tensor:
    """A received tensor in one piece (a stage sends each as one frame: no copy then)."""
    return whole(tensor)
