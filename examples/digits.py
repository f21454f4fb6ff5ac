"""scikit-learn's 8x8 digits with a tiny MLP: a tensorbus SPEC file.

1797 handwritten digits bundled with scikit-learn (no download): a fixed
split puts 1500 in the training set and 297 in the test set. Small enough
that an epoch takes well under a second, which is why the fast tests use it.

Run it with, for example:

    tensorbus local examples/digits.py --workers 4 --strategy sync --epochs 1 --lr 0.1

A SPEC defines model(), data(), loss() and evaluate(); optimizer() is left
out so the trainer's default (plain SGD with --lr) is used.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import Tensor, nn

# Base seed for the per-epoch shuffles; epoch e uses SEED + e.
SEED = 0

# Seed of the one-off permutation that fixes the train/test split.
SPLIT_SEED = 1234
NUM_TRAIN = 1500  # the remaining 297 samples are the test set

NUM_FEATURES = 64  # 8x8 pixels
NUM_CLASSES = 10


@functools.lru_cache(maxsize=None)
def _load() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(x_train, y_train, x_test, y_test), pixels scaled from 0..16 to [0, 1]; cached."""
    digits = load_digits()
    x = torch.from_numpy(digits.data).to(torch.float32) / 16.0
    y = torch.from_numpy(digits.target).to(torch.int64)
    # A dedicated generator, so the split never depends on the global seed.
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(SPLIT_SEED))
    train, test = perm[:NUM_TRAIN], perm[NUM_TRAIN:]
    return x[train], y[train], x[test], y[test]


class Shards:
    """One rank's batches; each iter() is the next epoch (0, 1, 2, ...).

    Every rank draws the same permutation for an epoch (it depends only on
    the epoch) and takes its own slice of each global batch, so sync training
    on world_size ranks matches one process using batch world_size*batch_size.
    """

    def __init__(self, x: Tensor, y: Tensor, rank: int, world_size: int, batch_size: int) -> None:
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
        self.epoch = 0

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        epoch, self.epoch = self.epoch, self.epoch + 1
        return self._batches(epoch)

    def _batches(self, epoch: int) -> Iterator[tuple[Tensor, Tensor]]:
        perm = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(SEED + epoch))
        start = self.rank * self.batch_size
        for t in range(self.num_batches):
            lo = t * self.global_batch + start
            idx = perm[lo : lo + self.batch_size]
            # Advanced indexing copies, so each batch is a fresh contiguous tensor.
            yield self.x[idx], self.y[idx]


def model() -> nn.Module:
    # Initialised from torch's global RNG, which the caller seeds.
    return nn.Sequential(
        nn.Linear(NUM_FEATURES, 32),
        nn.ReLU(),
        nn.Linear(32, NUM_CLASSES),
    )


def data(rank: int, world_size: int, batch_size: int) -> Shards:
    x, y, _, _ = _load()
    return Shards(x, y, rank, world_size, batch_size)


def loss(output: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(output, target)


def evaluate(model: nn.Module) -> dict[str, float]:
    """Accuracy and mean cross-entropy on the 297 held-out digits."""
    _, _, x, y = _load()
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(x)
            test_loss = F.cross_entropy(logits, y).item()
            accuracy = (logits.argmax(dim=1) == y).float().mean().item()
    finally:
        model.train(was_training)
    return {"accuracy": accuracy, "test_loss": test_loss}
