"""Weight sets shared in one process by a colocated shard and its worker: no copy between them.

A colocated shard (nodes.colocated) makes each version of its range of the model in a
buffer set from its pool (the copy-on-write master: nodes.master), publishes
it, and its worker, in the same process, would then copy that range into its own model:
a copy of half the model each version, with two workers, on the way from the step to the
next compute. Here the shard's pool sets are instead ranges of whole-model sets, and the
worker binds its model to the set that holds the version it loads (`nodes.flat.FlatModel.
rebind`): its own range is then in place already (`bus.pieces.copy_into` leaves it), and
only the other shards' ranges are copied in, from their frames.

Who may write what, and when (the invariant this module keeps):

- A set's shard range is written only by the shard, and only while the set is in no one's
  hands: not published, not on the wire, and not the set the worker's model is bound to
  (`held`, which the pool asks before it reuses a set: bus.buffers.SendBuffers).
- The other ranges of a set are written only by the worker, only while its model is bound
  to that set (loading the other shards' weights), or moving to it (see `nodes.in_place.InPlace.bind`).
- The worker binds to a set only while it holds frames of the version published in it, so
  that set is not in the pool then; it lets go of the old set (`bound`) only once done
  reading it.
- The worker never writes a shared set's shard range: anything but a whole version that
  lies in a shared set (Changes, a Welcome, a Pull's answer) is loaded after moving the
  model back to its own private buffers.

So a worker that writes its own weights (a local optimizer: periodic averaging) does not
take part (nodes.colocated then gives its shard no colocated sets), nor does a model on a GPU
(its weights are not the frames' memory; the shard's sets are still whole-model sets in
host memory, two or three of them). A range under 64 KiB goes in-process as a copy (pyzmq
copies small frames; bus.codec evens out chunks so that no larger range ends in one), and
is then loaded as before.

What it costs: each set of the shard's pool is the whole model, not its range.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch

from tensorbus.bus.layout import Layout, Shard
from tensorbus.bus.pieces import Received, spans


class ColocatedSets:
    """The whole-model sets whose range `index` the shard beside a worker makes versions in."""

    def __init__(self, layout: Layout, shard: Shard, index: int, *,
                 allocate: Callable[[], tuple[torch.Tensor, ...]] | None = None) -> None:
        """`allocate`: makes a whole-model set (by default in private memory; a shard's
        SharedWeightPool puts it in shared memory: bus.shared)."""
        self.layout, self.shard, self.index = layout, shard, index
        self._allocate_whole = allocate or layout.allocate
        # The sets made so far, by their range's addresses; each with a weak reference to
        # its range's first tensor, which the pool, the master or the snapshot holds while
        # the set is in use (dead: the pool let go of it, and it can be forgotten).
        self._sets: dict[tuple[int, ...], tuple[weakref.ref[torch.Tensor], tuple[torch.Tensor, ...]]] = {}
        self.bound: tuple[torch.Tensor, ...] | None = None  # the worker computes on it
        self._bound_key: tuple[int, ...] | None = None

    def allocate(self) -> tuple[torch.Tensor, ...]:
        """For the shard's pool: a new whole-model set, whose shard range is returned."""
        self._forget_unused()
        whole = self._allocate_whole()
        part = tuple(self.shard.take(whole))
        self._sets[_key(part)] = (weakref.ref(part[0]), whole)
        return part

    def held(self, part: tuple[torch.Tensor, ...]) -> bool:
        """For the shard's pool: whether the worker's model is bound to this range's set."""
        return self._bound_key is not None and _key(part) == self._bound_key

    def holding(self, tensors: Sequence[Received]) -> tuple[torch.Tensor, ...] | None:
        """The whole set whose shard range these received tensors are, the same memory (an
        in-process broadcast of a version made in it), or None."""
        if not tensors:
            return None
        firsts = tuple(next(spans(t))[1].data_ptr() for t in tensors)
        found = self._sets.get(firsts)
        if found is None or found[0]() is None:
            return None
        whole = found[1]
        for place, tensor in zip(self.shard.take(whole), tensors, strict=True):
            for offset, part in spans(tensor):
                if (part.dtype != place.dtype or offset + part.numel() > place.numel()
                        or part.data_ptr() != place[offset:].data_ptr()):
                    return None
        return whole

    def bind(self, whole: tuple[torch.Tensor, ...] | None) -> None:
        """The worker's model is bound to `whole` now (None: to its own private buffers)."""
        self._bound_key = _key(tuple(self.shard.take(whole))) if whole is not None else None
        self.bound = whole
        self._forget_unused()

    def _forget_unused(self) -> None:
        """Let go of the sets the pool let go of (called on the loop and on the worker's
        compute thread: each step of it is atomic under the GIL)."""
        for key, (first, _) in list(self._sets.items()):
            if first() is None and key != self._bound_key:
                self._sets.pop(key, None)


def _key(part: Sequence[torch.Tensor]) -> tuple[int, ...]:
    return tuple(t.data_ptr() for t in part)
