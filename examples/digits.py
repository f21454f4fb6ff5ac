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
import importlib.util
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tensorbus.run.shards import Shards

# Base seed for the per-epoch shuffles; epoch e uses SEED + e.
SEED = 0

# Seed of the one-off permutation that fixes the train/test split.
SPLIT_SEED = 1234
NUM_TRAIN = 1500  # the remaining 297 samples are the test set

NUM_FEATURES = 64  # 8x8 pixels
NUM_CLASSES = 10


def _digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits, (pixels, labels), as `load_digits()` gives them.

    Read from the file scikit-learn bundles them in, the one `load_digits` reads, without
    importing scikit-learn: that import costs about a second of CPU in every process of a
    run (the launcher's and each worker's), far more than training on the digits does.
    `load_digits()` itself where that file is not found.
    """
    found = importlib.util.find_spec("sklearn")  # (finds the package, imports nothing)
    if found is not None and found.origin is not None:
        bundled = Path(found.origin).parent / "datasets" / "data" / "digits.csv.gz"
        if bundled.is_file():
            table = np.loadtxt(bundled, delimiter=",")  # 64 pixels, then the label
            return table[:, :-1], table[:, -1].astype(int)
    from sklearn.datasets import load_digits

    digits = load_digits()
    return digits.data, digits.target


@functools.cache
def _load() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(x_train, y_train, x_test, y_test), pixels scaled from 0..16 to [0, 1]; cached."""
    pixels, labels = _digits()
    x = torch.from_numpy(pixels).to(torch.float32) / 16.0
    y = torch.from_numpy(labels).to(torch.int64)
    # A dedicated generator, so the split never depends on the global seed.
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(SPLIT_SEED))
    train, test = perm[:NUM_TRAIN], perm[NUM_TRAIN:]
    return x[train], y[train], x[test], y[test]


def model() -> nn.Module:
    # Initialised from torch's global RNG, which the caller seeds.
    return nn.Sequential(
        nn.Linear(NUM_FEATURES, 32),
        nn.ReLU(),
        nn.Linear(32, NUM_CLASSES),
    )


def data(rank: int, world_size: int, batch_size: int) -> Shards:
    x, y, _, _ = _load()
    return Shards(x, y, rank, world_size, batch_size, seed=SEED)


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
