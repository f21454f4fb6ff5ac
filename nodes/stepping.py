"""How a coordinator makes its next version of the master weights from the updates a
strategy applies: the optimizer it steps (or none, for a plain average of pushed
weights), its learning rate, and the step itself, folded as pushes come where it can be.

The master weights are also the published snapshot (nodes.master): a step that makes the
next version from the updates alone (`Master.into_spare`) writes it into a free buffer
set, which then becomes the master; any other step writes in place, on a master moved
off the snapshot first (`Master.own`). A plain SGD step whose first pushes (in the
step's rank order) were folded in as they came (nodes.fold) goes on from there.

A step over few parameters is taken on the loop: shorter than the hop to a thread, it
would hold heartbeats back by less than that hop costs. Any other runs in a thread.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Callable, Iterable, Sequence

import torch

from tensorbus.bus.messages import Push
from tensorbus.bus.pieces import Received, all_finite
from tensorbus.nodes.flat import FlatModel
from tensorbus.nodes.fold import Fold, next_to_fold, step_alpha
from tensorbus.nodes.master import Master
from tensorbus.nodes.optimizers import OptimizerFactory, make_optimizer
from tensorbus.nodes.outer import DelayedNesterov
from tensorbus.strategies.base import PushKind, Strategy

log = logging.getLogger("tensorbus.coordinator")

SMALL_STEP = 1 << 20  # parameters: a step over at most this many is taken on the loop


def master_optimizer(
    params: Iterable[torch.nn.Parameter], strategy: Strategy, factory: OptimizerFactory | None,
    lr: float,
) -> torch.optim.Optimizer | None:
    """What steps the master weights: the SPEC's optimizer (or SGD at `lr`) over pushed
    gradients; over pushed weights the strategy's outer optimizer (SGD, or delayed
    Nesterov: nodes.outer), or None (a plain average: workers own their optimizers)."""
    if strategy.rhythm.push is not PushKind.WEIGHTS:
        return make_optimizer(factory or (lambda ps: torch.optim.SGD(ps, lr=lr)), params)
    outer = strategy.outer
    if outer is None:
        return None
    if outer.every > 1:
        return DelayedNesterov(params, lr=outer.lr, momentum=outer.momentum, every=outer.every)
    return torch.optim.SGD(params, lr=outer.lr, momentum=outer.momentum, nesterov=outer.nesterov)


def correct_momentum(optimizer: torch.optim.Optimizer | None, strategy: Strategy) -> None:
    """Lower the optimizer's momentum where the strategy's stale updates add their own
    (async, ssp: strategies.stale), and say so."""
    if optimizer is None:
        return
    for group in optimizer.param_groups:
        asked = group.get("momentum")
        if not isinstance(asked, float | int) or not asked:
            continue
        group["momentum"] = strategy.corrected_momentum(float(asked))
        if group["momentum"] != asked:
            log.info("%s with %d workers: momentum %g -> %g and each gradient scaled by 1/%d, "
                     "for the momentum their stale updates add (momentum correction; "
                     "--no-momentum-correction turns it off)", strategy.name, strategy.workers,
                     asked, group["momentum"], strategy.workers)


def stepped_lr(optimizer: torch.optim.Optimizer | None, strategy: Strategy, lr: float) -> float:
    """The learning rate versions are stepped with now: the optimizer's, or `lr` (the
    workers') under average without an outer optimizer (their SGD's, or their SPEC
    optimizer's own)."""
    if optimizer is None or strategy.rhythm.push is PushKind.WEIGHTS:
        return lr
    return float(optimizer.param_groups[0]["lr"])


def follow_lrs(optimizer: torch.optim.Optimizer | None, lrs: str) -> None:
    """Step with a script's learning rates (Push.lrs: its scheduler's), one a group."""
    if optimizer is None or not lrs:
        return
    values = json.loads(lrs)
    if len(values) != len(optimizer.param_groups):
        raise ValueError(f"{len(values)} learning rates for {len(optimizer.param_groups)} "
                         "parameter groups")
    for group, lr in zip(optimizer.param_groups, values, strict=True):
        group["lr"] = float(lr)


class Stepper:
    """Makes versions on `master`: one step at a time, under the coordinator's step lock
    (held by the caller for `step`, taken here for a fold). `version`: the coordinator's
    newest, the one the next step is made on."""

    def __init__(self, master: Master, flat: FlatModel, *, step_lock: asyncio.Lock,
                 version: Callable[[], int]) -> None:
        self.master = master
        self._version = version
        self._flat = flat
        self._step_lock = step_lock
        self.small = sum(b.numel for b in flat.layout.buckets) <= SMALL_STEP
        self.fold: Fold | None = None  # the next version, made as its pushes come

    async def step(self, updates: list[tuple[Received, ...]], scale: float, *,
                   ranks: Sequence[int] = ()) -> None:
        """Make the next version from `updates` (of `ranks`, in the step's order)."""
        master, version = self.master, self._version()
        lr = master.plain_lr()
        fold, self.fold = self.fold, None
        folded = (fold.folded(version, step_alpha(lr, scale, len(updates)), ranks)
                  if fold is not None and lr is not None else None)
        if fold is not None and folded is None:
            master.let_go(fold.into)  # it cannot serve this step
            fold = None
        into = fold.into if fold is not None else (master.spare() if master.into_spare(lr) else None)
        if into is None:
            master.own()
        step = functools.partial(master.step, updates, scale, version=version + 1, into=into,
                                 folded=folded or 0)
        try:
            if self.small:
                step()
            else:
                await asyncio.to_thread(step)
        except Exception:
            # The step failed and is over: nothing counts what it wrote. (Cancelled, the
            # thread may still be writing: the set is let go of, not given back.)
            if into is not None:
                master.let_go(into)
            raise
        if into is not None:
            master.adopt(into)

    def fold_for(self, rank: int, message: Push, *, quorum: int | None,
                 members: Callable[[], Sequence[int]]) -> Fold | None:
        """The fold to fold this push into now (made if need be), or None: it is not a
        dense plain SGD step's, of the version being made, next in rank order (of the
        live ranks `members()` gives, asked only here; `quorum`: the updates the step
        averages)."""
        lr, version = self.master.plain_lr(), self._version()
        if lr is None or quorum is None or not self.master.into_spare(lr) or message.version != version:
            return None
        alpha = step_alpha(lr, 1.0, quorum)  # as the step's (sync's scale is 1)
        if self.fold is not None and (self.fold.version != version or self.fold.alpha != alpha):
            self.let_go_of_fold()  # of an older version, or the quorum changed
        if not next_to_fold(self.fold.ranks if self.fold else [], rank, members()):
            return None  # (a set is taken only once there is something to fold into it)
        if self.fold is None:
            self.fold = Fold(version, alpha, self.master.spare())
        return self.fold

    async def fold_in(self, fold: Fold, rank: int, message: Push) -> bool:
        """Fold a push in (nodes.fold); whether it was finite."""
        async with self._step_lock:
            if self.fold is not fold or fold.version != self._version():
                # A step took the fold (its set may be published now) or let go of it while
                # we waited for the lock: check the push on its own, as any other.
                return all(all_finite(t) for t in message.tensors)
            add = functools.partial(fold.add, self._flat.weights, rank, message.tensors)
            try:
                return add() if self.small else await asyncio.to_thread(add)
            except BaseException:
                self.fold = None  # (cancelled, the thread may still write it: forgotten)
                raise

    def let_go_of_fold(self) -> None:
        if self.fold is not None:
            self.master.let_go(self.fold.into)
            self.fold = None
