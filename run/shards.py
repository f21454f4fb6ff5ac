"""A helper for SPEC authors: sharded, re-iterable epochs over in-memory tensors.

`data(rank, world_size, batch_size)` can return `Shards(x, y, rank, world_size, batch_size)`:
sized (batches per epoch, which `--epochs` needs) and re-iterable (each `iter()` is the next
epoch), with the sample order that makes sync training equal single-process training.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor


class Shards:
    """One rank's batches; each iter() is the next epoch (0, 1, 2, ...).

    Every rank draws the same permutation for an epoch (it depends only on
    `seed` and the epoch) and takes its own slice of each global batch, so sync
    training on world_size ranks matches one process using batch
    world_size*batch_size. The last partial global batch is dropped.
    """

    def __init__(
        self, x: Tensor, y: Tensor, rank: int, world_size: int, batch_size: int, *, seed: int = 0
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.global_batch = world_size * batch_size
        self.num_batches = len(x) // self.global_batch  # last partial global batch is dropped
        if self.num_batches == 0:
            raise ValueError(
                f"batch_size {batch_size} gives no batches: {len(x)} samples but "
                f"global batch G = world_size*batch_size = {self.global_batch}"
            )
        self.x, self.y = x, y
        self.rank, self.batch_size = rank, batch_size
        self.seed = seed
        self.epoch = 0

    def __len__(self) -> int:
        return self.num_batches

    @property
    def unused(self) -> int:
        """Samples each epoch leaves out, of every rank's: the last partial global batch."""
        return len(self.x) - self.num_batches * self.global_batch

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        epoch, self.epoch = self.epoch, self.epoch + 1
        return self._batches(epoch)

    def _batches(self, epoch: int) -> Iterator[tuple[Tensor, Tensor]]:
        perm = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(self.seed + epoch))
        start = self.rank * self.batch_size
        for t in range(self.num_batches):
            lo = t * self.global_batch + start
            idx = perm[lo : lo + self.batch_size]
            # Advanced indexing copies, so each batch is a fresh contiguous tensor.
            yield self.x[idx], self.y[idx]
