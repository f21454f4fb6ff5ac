"""Versions as what changed: found on the coordinator, checked and applied on a worker.

Under `--compress topk:R` a version changes few elements of the weights (the k of each
update, with plain SGD), yet broadcasting it whole sends every element to every worker,
for every update: under async, that is most of what the bus moves. The coordinator then
broadcasts `bus.messages.Changes` instead: per bucket, the indices of the elements that
differ from the last published version, and their new values.

- `Differ` (coordinator) compares the weights with the last published snapshot, bit for
  bit (integer views: -0.0 and 0.0 differ, as they do in the weights), into a buffer
  made once, and lists the elements that differ. Where more than `most` of them do (an
  optimizer with momentum or weight decay changes them all), it answers None and the
  whole version goes out as before; after GIVE_UP such versions in a row, it stops
  comparing.
- `Touched` (coordinator) knows them without comparing, where every version since the
  last published one was made by a sparse step: plain SGD (`plain_sgd_lr`) applied at the
  k elements of each top-k update, straight into the weights, instead of a step over
  every element of a gradient that is mostly zeros. It lists the elements those steps
  wrote (a written element whose value came out the same goes too: harmless).
- `out_of_range` and `apply` (worker) check received Changes against the layout and
  write them into the weights of `base`, which then hold `version` exactly.

The index and value tensors are made anew for each version: k-sized, not model-sized.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import numpy as np
import torch
import torch.optim.optimizer as _optimizer_module

from tensorbus.bus.layout import Bucket, Layout
from tensorbus.bus.pieces import Received, whole

# Same-size integer views: compared as integers, two floats are equal only bit for bit.
_BITS: Final = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
GIVE_UP: Final = 8  # versions in a row that changed too much, after which none is compared


class Differ:
    def __init__(self, buckets: Sequence[Bucket], *, most: float = 0.25) -> None:
        self._limit = int(most * sum(b.numel for b in buckets))
        self._differs = [np.empty(b.numel, dtype=bool) for b in buckets]  # made once
        self._misses = 0  # versions in a row that changed too much

    def __call__(self, now: Sequence[torch.Tensor], then: Sequence[torch.Tensor]
                 ) -> tuple[torch.Tensor, ...] | None:
        """Per bucket, the indices where `now` differs from `then` and the values `now`
        holds there; None if more than `most` of all elements differ. After GIVE_UP such
        versions in a row (an optimizer that moves every element), None at once: the
        comparison would only cost time."""
        if self._misses >= GIVE_UP:
            return None
        changed = 0
        for new, old, differs in zip(now, then, self._differs, strict=True):
            bits = _BITS[new.element_size()]
            np.not_equal(new.view(bits).numpy(), old.view(bits).numpy(), out=differs)
            changed += int(np.count_nonzero(differs))  # counting is cheaper than listing
        if changed > self._limit:
            self._misses += 1
            return None
        self._misses = 0
        tensors: list[torch.Tensor] = []
        for new, differs in zip(now, self._differs, strict=True):
            at = torch.from_numpy(np.flatnonzero(differs))
            tensors += [at, new[at]]
        return tuple(tensors)


class Touched:
    """The elements sparse steps wrote from version `since` to version `until`, per bucket."""

    def __init__(self, buckets: Sequence[Bucket], *, most: float = 0.25) -> None:
        self._limit = int(most * sum(b.numel for b in buckets))
        self._written: list[list[torch.Tensor]] = [[] for _ in buckets]
        self._count = 0
        self.since: int | None = None  # None: not known (nothing was counted from a version)
        self.until: int | None = None

    def start(self, version: int) -> None:
        """Count from `version` (the one just published): nothing written since."""
        for written in self._written:
            written.clear()
        self._count = 0
        self.since = self.until = version

    def add(self, bucket: int, indices: torch.Tensor) -> None:
        """A sparse step wrote the weights of `bucket` at `indices` (copied: the frames they
        arrived in are let go after the step)."""
        if self.since is not None:
            self._count += indices.numel()
            if self._count > self._limit:  # too many to be worth listing: forget them
                self.since = self.until = None
                for written in self._written:
                    written.clear()
            else:
                self._written[bucket].append(indices.clone())

    def made(self, version: int) -> None:
        """Version `version` was made by sparse steps that were all `add`ed."""
        if self.until is not None and version == self.until + 1:
            self.until = version

    def changes(self, now: Sequence[torch.Tensor], base: int, version: int
                ) -> tuple[torch.Tensor, ...] | None:
        """Per bucket, the elements written from `base` to `version` and the values `now`
        holds there; None unless exactly those versions were counted."""
        if self.since != base or self.until != version:
            return None
        tensors: list[torch.Tensor] = []
        for new, written in zip(now, self._written, strict=True):
            at = (torch.cat(written).unique() if written
                  else torch.zeros(0, dtype=torch.int64))
            tensors += [at, new[at]]
        return tuple(tensors)


def plain_sgd_lr(optimizer: torch.optim.Optimizer | None, params: Sequence[torch.Tensor]
                 ) -> float | None:
    """The learning rate where a step of `optimizer` is `w -= lr * grad` over `params`
    and nothing else (torch.optim.SGD in one group without momentum, weight decay,
    maximize or step hooks): then the coordinator can take the step itself, without
    filling the gradient buffers (and a gradient that is zero but at k elements changes
    only those). None for any other optimizer."""
    if type(optimizer) is not torch.optim.SGD or len(optimizer.param_groups) != 1:
        return None
    group = optimizer.param_groups[0]
    hooks = (getattr(optimizer, "_optimizer_step_pre_hooks", None),
             getattr(optimizer, "_optimizer_step_post_hooks", None),
             getattr(_optimizer_module, "_global_optimizer_pre_hooks", None),
             getattr(_optimizer_module, "_global_optimizer_post_hooks", None))
    if (group["momentum"] or group["weight_decay"] or group["maximize"] or any(hooks)
            or len(group["params"]) != len(params)
            or any(a is not b for a, b in zip(group["params"], params, strict=True))):
        return None
    lr = group["lr"]
    return float(lr) if isinstance(lr, (int, float)) else None


def out_of_range(layout: Layout, tensors: Sequence[Received]) -> str | None:
    """What is wrong with the indices of index and value tensors per bucket (Changes, or
    a top-k push) for this layout: one outside its bucket; or None. Their dtypes and
    lengths are the codec's to check."""
    for b, bucket in enumerate(layout.buckets):
        indices = whole(tensors[2 * b])
        if indices.numel():
            low, high = int(indices.min()), int(indices.max())
            if low < 0 or high >= bucket.numel:
                return f"bucket {b}: indices from {low} to {high}, the bucket has {bucket.numel} elements"
    return None


def apply(weights: Sequence[torch.Tensor], tensors: Sequence[Received]) -> None:
    """Write Changes' values at their indices into `weights` (one buffer per bucket)."""
    with torch.no_grad():
        for b, dst in enumerate(weights):
            dst.index_copy_(0, whole(tensors[2 * b]), whole(tensors[2 * b + 1]))
