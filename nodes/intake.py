"""A coordinator's intake of pushes: each one judged, counted, and kept for its step.

A push is dropped, and counted, when it cannot be stepped on: not finite (found as it is
folded into the next version where it can be, nodes.fold, or else checked on its own),
naming elements the model does not have (top-k), or past its worker's epochs while the
run's length is not known yet. Otherwise the strategy says what becomes of it (Arrived);
one it keeps waits here (`held`) for the step that applies it. The model's buffers a push
carries are taken unless it was dropped or the run is over.

This part decides and records; the coordinator answers (its `_push`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from tensorbus.bus.clock import Clock
from tensorbus.bus.errors import LayoutError
from tensorbus.bus.messages import Push
from tensorbus.bus.pieces import Received, all_finite
from tensorbus.bus.shared import SegmentCache
from tensorbus.nodes import changes as changed
from tensorbus.nodes.admission import Rejections
from tensorbus.nodes.membership import Member
from tensorbus.nodes.metrics import Metrics
from tensorbus.nodes.model_buffers import ServedBuffers
from tensorbus.nodes.run_length import RunLength
from tensorbus.nodes.stepping import Stepper
from tensorbus.nodes.watch import Watch
from tensorbus.strategies.base import Arrived, Decision, Drop, DropReason, Keep, Strategy

DIVERGED_AFTER = 8  # non-finite updates in a row from every worker: the run has diverged


@dataclass
class Held:
    tensors: tuple[Received, ...]  # views into received frames; they keep the frames alive
    loss: float
    samples: int
    lrs: str = ""  # a script's learning rates (Push.lrs)
    steps: int = 0  # the worker's local steps behind it (its data used)


@dataclass(frozen=True)
class Taken:
    decisions: list[Decision]
    dropped: str  # why it was dropped (a DropReason's value), or ""
    by_reference: bool  # its tensors lie in the worker's shared memory (bus.shared)


class Intake:
    def __init__(
        self, *, stepper: Stepper, strategy: Strategy, length: RunLength, metrics: Metrics,
        watch: Watch, buffers: ServedBuffers, rejections: Rejections, clock: Clock,
    ) -> None:
        self._stepper = stepper
        self._strategy = strategy
        self._length = length
        self._metrics = metrics
        self._watch = watch
        self._buffers = buffers
        self._rejections = rejections
        self._clock = clock
        self.held: dict[int, Held] = {}  # rank -> its push kept for a step
        self._not_finite: dict[int, int] = {}  # rank -> non-finite updates in a row

    async def take(self, peer: bytes, member: Member, message: Push, now: float, *,
                   members: Callable[[], list[int]], segments: SegmentCache | None, stopping: bool,
                   over: Callable[[], bool]) -> Taken:
        """Judge `member`'s push and record what became of it. `members()`: the live ranks;
        `over`: whether the run has made its last version (its buffers are not taken)."""
        rank, stepper = member.rank, self._stepper
        fold = (stepper.fold_for(rank, message, quorum=self._strategy.quorum(), members=members)
                if math.isfinite(message.loss) and not stopping else None)
        if fold is not None:
            finite = await stepper.fold_in(fold, rank, message)
        else:
            finite = math.isfinite(message.loss) and all(all_finite(t) for t in message.tensors)
        decisions = self._judge(peer, member, message, now, finite=finite)
        if fold is not None and finite and Keep(rank, message.version) not in decisions:
            stepper.let_go_of_fold()  # folded, but not taken: the step must not count it
        counts = self._metrics.worker(rank)
        counts["pushes"] += 1
        if message.overflows:
            counts["overflows"] = message.overflows
        by_reference = bool(segments is not None and message.tensors and segments.holds(message.tensors[0]))
        if by_reference:
            counts["by_reference"] += 1
        self._watch.pushed(rank, message, self._clock.wall())
        dropped = ""
        for decision in decisions:
            match decision:
                case Keep(worker=worker):
                    self.held[worker] = Held(message.tensors, message.loss, message.samples,
                                             message.lrs, self.steps(message))
                case Drop(reason=reason):
                    self._metrics.dropped[reason.value] += 1
                    counts["dropped"] += 1
                    self._length.used(rank, self.steps(message))
                    dropped = reason.value
        if message.state and not dropped and not over():
            try:
                self._buffers.take(rank, message.state)
            except LayoutError as e:
                self._rejections.warn(peer, "buffers", f"worker {rank} sent buffers that are "
                                                       f"not the model's ({e}): they are left out")
        return Taken(decisions, dropped, by_reference)

    def _judge(self, peer: bytes, member: Member, message: Push, now: float, *,
               finite: bool) -> list[Decision]:
        rank, version = member.rank, message.version
        if not finite:
            self._not_finite[rank] = self._not_finite.get(rank, 0) + 1
            self._rejections.warn(peer, "not_finite", f"worker {rank} pushed a non-finite "
                                                      f"update on version {version}")
            return [Drop(rank, version, DropReason.NOT_FINITE)]
        if (self._stepper.master.compression.topk is not None
                and changed.out_of_range(self._stepper.master.flat.layout, message.tensors)):
            self._rejections.warn(peer, "out_of_range", f"worker {rank} pushed a top-k update "
                                                        "naming elements the model does not have")
            return [Drop(rank, version, DropReason.OUT_OF_RANGE)]
        if self._length.past_its_epochs(rank, member.batches):
            return [Drop(rank, version, DropReason.PAST_EPOCHS)]
        self._not_finite[rank] = 0
        speed = message.samples / message.compute_s if message.compute_s > 0 else 0.0
        decisions = self._strategy.handle(Arrived(rank, version, now, speed))
        self._metrics.max_clock_gap = max(self._metrics.max_clock_gap, self._strategy.clock_gap())
        return decisions

    def copy_held(self, rank: int, segments: SegmentCache | None) -> None:
        """Copy `rank`'s held push out of its shared memory, if it lies there: a worker that
        joins again computes before the step that holds its push (bus.shared, Ownership)."""
        held = self.held.get(rank)
        if held is None or segments is None or not any(map(segments.holds, held.tensors)):
            return
        # (Only what lies in its segment: frames are ours already.)
        copied = tuple(t.clone() if isinstance(t, torch.Tensor) and segments.holds(t) else t
                       for t in held.tensors)
        self.held[rank] = Held(copied, held.loss, held.samples, held.lrs, held.steps)
        fold = self._stepper.fold
        if fold is not None and rank in fold.ranks:
            # What it folded from it, it folds again (a non-finite push after it) from the copy.
            fold.updates[fold.ranks.index(rank)] = copied

    def steps(self, message: Push) -> int:
        """The local steps behind a push: as it says, or as the rhythm says."""
        return message.steps or self._strategy.rhythm.local_steps

    def diverged(self, members: Iterable[int], parked: Callable[[int], bool],
                 ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """Whether no version can come of the updates pushed: the last DIVERGED_AFTER of
        every member's were not finite, or of every member's that the others wait on (with
        a push held for a step, or its request `parked`): those never push again until a
        version comes, so their count would never rise. If so, (those ranks, the waiting)."""
        ranks = list(members)
        bad = tuple(sorted(r for r in ranks if self._not_finite.get(r, 0) >= DIVERGED_AFTER))
        waiting = tuple(sorted(r for r in ranks if r not in bad and (r in self.held or parked(r))))
        if not bad or len(bad) + len(waiting) < len(ranks):
            return None
        return bad, waiting
