"""Compute in place: which buffers a worker's model computes on.

The model's weights are its own buffers, except in two cases where it computes on weights
where another made them, instead of copying them in:

- One coordinator on this host, whose versions come by reference (bus.shared): the model
  computes on the newest version in the coordinator's shared set (`follow_set`), and
  computes again, on a copy, if that set was written meanwhile (`redo`).
- A colocated coordinator shard (nodes.colocated), which makes its versions in weight sets
  of the whole model (nodes.colocated_sets): the model is bound to the set holding the version
  it loads (`follow_colocated_sets`, `bind`).

`InPlace` owns that binding and the back-off that follows a redo (COPY_AFTER_REDO).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import cast

import torch

from tensorbus.bus.layout import Shard
from tensorbus.bus.messages import Weights
from tensorbus.nodes.colocated_sets import ColocatedSets
from tensorbus.nodes.flat import FlatModel
from tensorbus.nodes.link import Link
from tensorbus.nodes.version_chain import PendingVersion

log = logging.getLogger("tensorbus.worker")
# After a compute on a coordinator's weight set that was written again meanwhile (done
# again), the next computes copy their weights in before one computes in place again: 2
# after a first, twice as many after each redo of the first in place after them (up to
# 64), so that a worker often slower than the sets are reused wastes few computes, and one
# held up once soon computes in place again.
COPY_AFTER_REDO = (2, 64)


@dataclass(frozen=True)
class OnSet:
    """The version the model computes on where it lies, in a coordinator's set."""

    weights: Weights
    first: torch.Tensor  # its first tensor: the set's counter is read through it
    generation: int  # the set's, as published with the version


class InPlace:
    def __init__(self, flat: FlatModel, links: list[Link], shards: list[Shard],
                 colocated_sets: ColocatedSets | None) -> None:
        """`colocated_sets`: the colocated shard's weight sets (on the CPU only), if any."""
        self._flat = flat
        self._links = links
        self._shards = shards
        self.colocated_sets = colocated_sets
        self.own = flat.weights  # the model's private buffers
        self.sharing = False  # this session binds the model to the colocated sets
        self.follows_sets = False  # this session may compute on a coordinator's sets
        self.on_set: OnSet | None = None  # the coordinator's set the model computes on now
        self._copying = 0  # computes left that copy their weights in (COPY_AFTER_REDO)
        self._backoff = 0  # how many the last redo had copy (0: the last in place held)
        self.redone = 0  # computes on a set rewritten meanwhile: done again

    def follow_set(self) -> None:
        """Before a compute, where the model may compute in place (`follows_sets`): bind it
        to the coordinator's set that the newest version came in (a copy of the model saved
        a compute), or back to its own buffers for a version that comes otherwise.

        The coordinator does not know that the set is read: its pool writes a set again
        some versions after publishing it (bus.shared, SharedWeightPool), bumping its counter first.
        The compute reads the counter again once the gradient is made, before it is made
        ready to push (LocalSteps.compute): moved, and the gradient is thrown away and
        computed again (`redo`). The set is mapped read-only here: nothing in the worker
        writes the model's weights while they lie there (each load goes to its own buffers)."""
        link = self._links[0]
        if self._copying:
            self._copying -= 1
            return
        taken = link.versions.take_shared()
        if taken is not None:
            # By reference, each tensor is one view of the set (never in pieces).
            assert all(isinstance(t, torch.Tensor) for t in taken.tensors)
            tensors = cast(tuple[torch.Tensor, ...], tuple(taken.tensors))
            self._flat.rebind(tensors)
            link.versions.rebind(tensors)
            self.on_set = OnSet(taken, tensors[0], taken.generation)
        elif self.on_set is not None and link.versions.newest() > link.version:
            self.leave_set(keep=False)  # what comes is loaded whole

    def computed(self) -> None:
        """After a compute that held: one in place, on a set left alone, ends the back-off."""
        if self.on_set is not None:
            self._backoff = 0

    def leave_set(self, *, keep: bool) -> None:
        """Bind the model back to its own buffers, if it computes on a coordinator's set;
        `keep`: the version it held is to be copied in before the next compute (unless a
        newer one comes first: Link.give_back)."""
        on, self.on_set = self.on_set, None
        if on is None:
            return
        self._flat.rebind(self.own)
        link = self._links[0]
        link.versions.rebind(self.own)
        if keep:
            link.versions.give_back(on.weights)

    def off_set(self) -> None:
        """As the worker ends, in any way: a model still bound to a coordinator's set (a
        failed run) gets its own buffers back, holding what the set holds now, so that
        whoever uses the model after (from Python) may write its weights."""
        on = self.on_set
        if on is not None:
            with torch.no_grad():
                for own, where in zip(self.own, self._flat.weights, strict=True):
                    own.copy_(where)
            self.leave_set(keep=False)

    def redo(self, rank: int) -> None:
        """After a compute on a coordinator's set that was written again meanwhile: the
        next ones copy their weights in (COPY_AFTER_REDO), the first the newest version."""
        on = self.on_set
        assert on is not None
        log.info("worker %d: the %s wrote the weights of version %d again while they were "
                 "computed on: computing again on the newest version", rank,
                 self._links[0].peer, on.weights.version)
        self.redone += 1
        first, most = COPY_AFTER_REDO
        self._backoff = self._copying = min(max(2 * self._backoff, first), most)
        self.leave_set(keep=True)

    def follow_colocated_sets(self, latest: list[PendingVersion | None]) -> None:
        """Before loading `latest`, beside a colocated shard: bind the model to the set
        the shard made its newest version in (its range is then in place), or back to
        its own buffers for anything else from that shard (see nodes.colocated_sets)."""
        assert self.colocated_sets is not None
        local = latest[self.colocated_sets.index]
        if local is None:
            return  # nothing new from the shard beside us: its range stays where it is
        found = (self.colocated_sets.holding(local.weights.tensors)
                 if local.weights is not None and not local.changes else None)
        self.bind(found if found is not None else self.own, latest)

    def bind(self, weights: tuple[torch.Tensor, ...],
             latest: list[PendingVersion | None] | None = None) -> None:
        """Make `weights` (the model's own buffers, or a colocated set) the model's, carrying
        over every range that `latest` (nothing, if not given) does not load whole."""
        current = self._flat.weights
        if weights is current:
            return
        assert self.colocated_sets is not None  # only colocated sets give the model other sets
        with torch.no_grad():
            for i, shard in enumerate(self._shards):
                newer = latest[i] if latest is not None else None
                if newer is None or newer.weights is None:
                    for dst, src in zip(shard.take(weights), shard.take(current), strict=True):
                        dst.copy_(src)
        self._flat.rebind(weights)
        for link, shard in zip(self._links, self._shards, strict=True):
            link.versions.rebind(shard.take(weights))
        # Last: the shard may reuse the set we leave as soon as this says we left it.
        self.colocated_sets.bind(None if weights is self.own else weights)

    def forget_loaded(self) -> None:
        """On the loop, once the compute thread has loaded the newest weights: the links
        let go of their frames too, so that their senders may reuse them."""
        for link in self._links:
            link.versions.forget_loaded()
