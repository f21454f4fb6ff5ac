"""The coordinator's master weights, the buffer sets versions are made in, and the step.

A version is published zero-copy: the snapshot that broadcasts, Welcomes and Pull answers
send is the master's own buffer set (`Snapshot`), which no step writes afterwards while a
send may read it. A step that makes the next version from the updates alone (plain SGD
on dense gradients, the plain mean of pushed weights: `Master.into_spare`) writes it into
a free set of the pool, which then becomes the master (`adopt`); any other step first moves
the master off the snapshot to a copy (`own`). A relay publishes copies instead
(`alias=False`): its upstream Link loads into the master's buffers.

What is here is arithmetic and buffer bookkeeping, with no socket: the coordinator
(nodes.coordinator) decides when a step is taken, in which thread, and what is sent; it
only tells each send of a snapshot's buffers here (`tracked`), so that no step writes them
while one reads them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch

from tensorbus.bus import quantize
from tensorbus.bus.buffers import SendBuffers, Tracker, all_done
from tensorbus.bus.layout import Compression, Layout, Shard
from tensorbus.bus.pieces import Received, fold, sum_into, whole
from tensorbus.bus.shared import SharedWeightPool
from tensorbus.nodes import changes as changed
from tensorbus.nodes.config import CoordinatorConfig
from tensorbus.nodes.flat import FlatModel
from tensorbus.nodes.fold import step_alpha

Buffers = tuple[torch.Tensor, ...]
Update = tuple[Received, ...]  # one push's tensors, views into its frames


@dataclass
class Snapshot:
    """The published buffers of one version (the master's own, or a relay's copy);
    Welcome and Pull replies send them too."""

    version: int
    buffers: Buffers
    # One per send begun (a send under way is a _Pending): the pool that gets the buffers
    # back reads this same list, so a send begun before the release still counts.
    trackers: list[Tracker | None] = field(default_factory=list)

    @property
    def free(self) -> bool:
        """Whether nothing reads the buffers: they may be written in place."""
        return all_done(self.trackers)


class Master:
    """The master weights (`flat`'s buffers), the optimizer that steps them, the pool of
    sets versions are made in, and the snapshot last published."""

    def __init__(self, flat: FlatModel, optimizer: torch.optim.Optimizer | None, pool: SendBuffers,
                 *, compression: Compression, weights_pushed: bool, alias: bool = True,
                 clip_grad_norm: float | None = None, fragments: tuple[Shard, ...] = ()) -> None:
        """`fragments`: the model's, under streaming averaging (bus.layout.Layout.fragments),
        where each version is made by averaging one of them, its pushes that fragment's."""
        self.flat = flat
        self.fragments = fragments
        # Each fragment's parameters, which its steps' optimizer steps alone (their own
        # momentum): the layout's entries, in order, that lie in its spans.
        self._fragment_params = [
            [i for i, e in enumerate(flat.layout.entries)
             if any(s.bucket == e.bucket and s.start <= e.offset < s.stop for s in f.spans)]
            for f in fragments]
        # The averaged gradient's norm is bounded before each step (pushed gradients only).
        self.clip_grad_norm = None if weights_pushed else clip_grad_norm
        self.optimizer = optimizer
        self.pool = pool
        self.alias = alias
        self.compression = compression
        self.weights_pushed = weights_pushed
        self.snapshot: Snapshot | None = None
        self._params = list(flat.module.parameters())
        buckets = flat.layout.buckets
        topk = compression.topk is not None
        # Top-k updates change few elements a version: broadcast those (nodes.changes).
        self.differ = changed.Differ(buckets) if topk else None
        # With plain SGD, a top-k update is applied at its k elements only, and those
        # steps' elements are the Changes, with no comparison (nodes.changes.Touched).
        self.touched = changed.Touched(buckets) if topk and not weights_pushed else None

    # The step ------------------------------------------------------------------------------

    def plain_lr(self) -> float | None:
        """The learning rate where a step is plain SGD on pushed gradients, else None.
        (Not with clipping: the fused plain steps never hold the averaged gradient whole.)"""
        if self.weights_pushed or self.clip_grad_norm is not None:
            return None
        return changed.plain_sgd_lr(self.optimizer, self._params)

    def into_spare(self, lr: float | None) -> bool:
        """Whether a step can write the next version into a spare buffer set, leaving the
        master as it was: plain SGD on dense gradients, or the plain mean of pushed weights
        (both read the master only, if at all). Not a relay's (see `alias`)."""
        if not self.alias or self.touched is not None:
            return False
        return lr is not None or (self.weights_pushed and self.optimizer is None
                                  and self.compression.topk is None
                                  and self.compression.bits is None and not self.fragments)

    def fragment(self, version: int) -> int | None:
        """The fragment whose average alone made `version` (streaming averaging: pushes
        computed on version v carry fragment v mod P, strategies.base.Rhythm.fragment), or
        None: versions are made of whole pushes."""
        if not self.fragments or version < 1:
            return None
        return (version - 1) % len(self.fragments)

    def step(self, updates: list[Update], scale: float, *, version: int,
             into: Buffers | None = None, folded: int = 0) -> None:
        """Average the updates and take one step with the result, making version `version`.

        Gradients: their mean, times `scale`, goes into the gradient buffers and the
        optimizer steps; with plain SGD (nodes.changes.plain_sgd_lr) the same
        arithmetic is done without the buffers: block by block for dense updates, at their
        k elements for top-k ones. Weights: their mean replaces the weights, or with an
        outer optimizer, (weights - mean) is the gradient it steps on. With `into` (where
        `into_spare`), the next version goes there and the master is left as it was;
        for plain SGD, the updates are folded into it one after the other (bus.pieces.fold),
        the first `folded` of them already (nodes.fold). (`version` is what top-k's sparse
        step records as the version its elements were written for: nodes.changes.Touched.)
        """
        lr = self.plain_lr()
        if into is not None and not self.into_spare(lr):
            raise ValueError("only plain SGD on dense gradients, or a plain mean of weights, "
                             "writes into another buffer set")
        if into is not None and lr is None:  # pushed weights: their mean, straight there
            with torch.no_grad():
                for b, out in enumerate(into):
                    sum_into(out, [update[b] for update in updates], scale / len(updates))
            return
        if lr is not None:
            if self.touched is not None:
                self._sparse_step(updates, scale, lr, version)
            else:  # into the spare set, or in place (a caller's own step): the same bits
                alpha = step_alpha(lr, scale, len(updates))  # as nodes.fold's
                with torch.no_grad():
                    for b, weights in enumerate(self.flat.weights):
                        out = into[b] if into is not None else weights
                        fold(out, weights if folded == 0 else None,
                             [update[b] for update in updates[folded:]], alpha)
            return
        fragment = self.fragment(version)
        places = self._places(fragment)
        self.mean(updates, scale, places)
        if self.clip_grad_norm is not None:  # on the average, as DDP users clip after it
            self.flat.clip_grads(self.clip_grad_norm)
        with torch.no_grad():
            for mean, weights in places:
                if self.weights_pushed:
                    if self.optimizer is None:
                        weights.copy_(mean)
                    else:
                        mean.sub_(weights).neg_()
        if self.optimizer is not None:
            if fragment is None:
                self.optimizer.step()
            else:  # (its parameters alone: the others' momentum stays as it was)
                with self.flat.grads_of(self._fragment_params[fragment]):
                    self.optimizer.step()

    def _places(self, fragment: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Where an update's tensors go, in order (each, or each pair for top-k and
        quantized ones): (gradient, weights) of each bucket, or of each span of `fragment`."""
        grads, weights = self.flat.grads, self.flat.weights
        if fragment is None:
            return list(zip(grads, weights, strict=True))
        return [(grads[s.bucket][s.start:s.stop], weights[s.bucket][s.start:s.stop])
                for s in self.fragments[fragment].spans]

    def mean(self, updates: list[Update], scale: float,
             places: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        """The mean of the updates (in the given order), times `scale`, into the gradient
        buffers (or the gradients of `places`: see _places). Top-k updates are added into
        zeros at their indices; quantized weights (changes from the master, bus.quantize)
        are taken from the master."""
        bits = self.compression.bits
        with torch.no_grad():
            for b, (mean, weights) in enumerate(places or self._places(None)):
                if bits is not None:
                    mean.copy_(weights)
                    for update in updates:
                        quantize.dequantize_add(mean, whole(update[2 * b]),
                                                whole(update[2 * b + 1]), bits,
                                                alpha=-scale / len(updates))
                elif self.compression.topk is not None:
                    mean.zero_()
                    for update in updates:  # small: k elements each
                        mean.index_add_(0, whole(update[2 * b]), whole(update[2 * b + 1]))
                    if scale / len(updates) != 1.0:  # (async: one update, unscaled; no pass)
                        mean.mul_(scale / len(updates))
                else:
                    # Read where they arrived (no copy before), a block at a time.
                    sum_into(mean, [update[b] for update in updates], scale / len(updates))

    def _sparse_step(self, updates: list[Update], scale: float, lr: float, version: int) -> None:
        """Plain SGD on top-k updates at their k elements, straight into the weights: the
        step `step` would take over their mean in a buffer of zeros (up to the order of
        float additions), without passing over every element three times. The elements
        written are the next Changes (see `changes`)."""
        assert self.touched is not None
        alpha = -lr * scale / len(updates)
        with torch.no_grad():
            for b, weights in enumerate(self.flat.weights):
                for update in updates:
                    at = whole(update[2 * b])
                    weights.index_add_(0, at, whole(update[2 * b + 1]), alpha=alpha)
                    self.touched.add(b, at)
        self.touched.made(version)

    # Whose buffers ---------------------------------------------------------------------------

    def spare(self) -> Buffers:
        """A free set of the pool, for the next version to be written into (see `step`)."""
        return self.pool.take()

    def let_go(self, buffers: Buffers) -> None:
        """Give back a set taken with `spare` that did not become the master (a step that
        failed, a fold no step took): nothing sends it."""
        self.pool.release(buffers, [])

    def published(self, buffers: Buffers) -> bool:
        """Whether `buffers` are the snapshot's: sends may read them, nothing may write them."""
        return self.snapshot is not None and self.snapshot.buffers is buffers

    def own(self) -> None:
        """Before the master weights are written in place: if they are the published
        snapshot, move the master to a copy in a free set."""
        if self.published(self.flat.weights):
            self.flat.rebind(self.copy())

    def adopt(self, weights: Buffers) -> None:
        """Make `weights`, where a step wrote the next version, the master; the old master
        goes back to the pool unless it is the snapshot (which gives it back when replaced)."""
        old = self.flat.weights
        self.flat.rebind(weights)
        if not self.published(old):
            self.pool.release(old, [])

    def copy(self) -> Buffers:
        """The master weights copied into a buffer set from the pool (no allocation once
        the pool holds free sets: tests/test_hot_path.py)."""
        buffers = self.pool.take()
        with torch.no_grad():
            for dst, src in zip(buffers, self.flat.weights, strict=True):
                dst.copy_(src)
        return buffers

    # Snapshots ---------------------------------------------------------------------------------

    def take_snapshot(self, version: int) -> Snapshot:
        """The current weights, of `version`, become the snapshot that Welcome, Pull and
        broadcasts send: the master's own buffers (from now on not written in place: see
        `own`), or, for a relay, a copy."""
        old = self.snapshot
        if old is not None and self.published(self.flat.weights):
            # Published already and unchanged since (a version made without a step): the
            # same buffers, with the sends that may still read them.
            old.version = version
        else:
            buffers = self.flat.weights if self.alias else self.copy()
            self.snapshot = Snapshot(version, buffers)
            if old is not None:
                self.pool.release(old.buffers, old.trackers)
        if self.touched is not None:
            self.touched.start(version)
        assert self.snapshot is not None  # made above, or kept
        return self.snapshot

    def changes(self, version: int) -> Buffers | None:
        """What changed since the snapshot, to make it `version`, where that is little
        (top-k's Changes, nodes.changes); None: send the whole weights."""
        old = self.snapshot
        if old is None or old.version >= version:
            return None
        changes = None
        if self.touched is not None:  # written by sparse steps only: listed as they went
            changes = self.touched.changes(self.flat.weights, old.version, version)
        if changes is None and self.differ is not None:
            changes = self.differ(self.flat.weights, old.buffers)
        return changes

    def advance_snapshot(self, changes: Buffers, version: int, shared_pool: SharedWeightPool | None) -> None:
        """Make the snapshot `version` with these `changes`: written in place where nothing
        reads it (no send, no colocated worker computing on it; its generation in `shared_pool`
        bumped first), or else a fresh one (the old one goes back to the pool)."""
        snapshot = self.snapshot
        assert snapshot is not None
        if snapshot.free and not self.pool.held(snapshot.buffers):
            if shared_pool is not None:  # read by reference, maybe: written again now
                shared_pool.bump(snapshot.buffers)
            changed.apply(snapshot.buffers, changes)
            snapshot.version = version
            if self.touched is not None:
                self.touched.start(version)
        else:
            self.take_snapshot(version)


class _Pending:
    """A send of a snapshot under way: done once the send has returned and ZeroMQ has let
    go of its frames (or it failed, and sent nothing)."""

    __slots__ = ("_returned", "_tracker")

    def __init__(self) -> None:
        self._returned = False
        self._tracker: Tracker | None = None

    def returned(self, tracker: Tracker | None) -> None:
        self._returned, self._tracker = True, tracker

    @property
    def done(self) -> bool:
        return self._returned and (self._tracker is None or self._tracker.done)


class AllDone:
    """Done once every one of these sends is."""

    __slots__ = ("_sends",)

    def __init__(self, sends: list[Tracker | None]) -> None:
        self._sends = sends

    @property
    def done(self) -> bool:
        return all_done(self._sends)


async def tracked(snapshot: Snapshot, send: Awaitable[Tracker | None]) -> Tracker | None:
    """Await a send of the snapshot's buffers; in its trackers from the start (a _Pending),
    so that neither a step nor the pool takes the buffers back meanwhile."""
    pending = _Pending()
    snapshot.trackers.append(pending)
    try:
        tracker = await send
    except BaseException:
        pending.returned(None)  # it sent nothing
        raise
    pending.returned(tracker)
    return tracker


def shared_version_sets(allocate: Callable[[], Buffers], shared_pool: SharedWeightPool, *,
                held: Callable[[Buffers], bool] | None = None) -> SendBuffers:
    """A pool of weight sets that `allocate` makes in `shared_pool`: a set's generation goes up
    before it is written again, and it is reused only while 3 others are free, so that a
    version's set changes versions after it was published (bus.buffers), not at the next
    one (but for top-k's Changes, which write the last whole version's set in place:
    `Master.advance_snapshot`)."""
    return SendBuffers(allocate, keep=3, held=held, reused=shared_pool.bump, dropped=shared_pool.release)


def version_sets(layout: Layout, shared_pool: SharedWeightPool | None) -> SendBuffers:
    """The buffer sets a coordinator makes its versions in: in `shared_pool`'s shared memory
    (which workers of its host read where they lie), or private."""
    if shared_pool is None:
        return SendBuffers(layout.allocate)
    return shared_version_sets(shared_pool.allocator(layout.sizes(), layout.allocate), shared_pool)


def shared_weight_pool(config: CoordinatorConfig) -> SharedWeightPool | None:
    """Where a coordinator makes its versions for workers of its host to read by reference
    (bus.shared.SharedWeightPool): with `config.shared_memory`, on a machine where that is safe."""
    return SharedWeightPool() if config.shared_memory and SharedWeightPool.usable() else None
