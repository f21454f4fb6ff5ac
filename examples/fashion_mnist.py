"""Fashion-MNIST with a small MLP: a tensorbus SPEC file.

Trains a 784-256-128-10 MLP on the 60k Fashion-MNIST training images and
evaluates on the 10k test images. The data comes from Debian's
dataset-fashion-mnist package, read locally; nothing is downloaded.

Run it with, for example:

    tensorbus local examples/fashion_mnist.py --workers 4 --strategy sync --epochs 1 --lr 0.1

A SPEC defines model(), data(), loss() and evaluate(); optimizer() is left
out so the trainer's default (plain SGD with --lr) is used.
"""

from __future__ import annotations

import functools
import gzip
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tensorbus.run.shards import Shards

# Where Debian's dataset-fashion-mnist installs the files. Change this constant
# to read a copy from elsewhere.
DATA_DIR = Path("/usr/share/datasets/fashion-mnist")

# Base seed for the per-epoch shuffles; epoch e uses SEED + e.
SEED = 0

# Mean and std of the training pixels after scaling to [0, 1].
MEAN = 0.2860
STD = 0.3530

IMAGE_MAGIC = 0x00000803  # IDX: unsigned bytes, 3 dimensions
LABEL_MAGIC = 0x00000801  # IDX: unsigned bytes, 1 dimension
ROWS = COLS = 28
NUM_CLASSES = 10


def _read_idx(path: Path, magic: int, ndim: int) -> np.ndarray:
    """Parse one gzip'd IDX file, checking its magic number and sizes."""
    with gzip.open(path, "rb") as f:
        raw = f.read()
    header = np.frombuffer(raw, dtype=">u4", count=1 + ndim)
    if int(header[0]) != magic:
        raise ValueError(f"{path}: bad magic number {int(header[0]):#010x}, expected {magic:#010x}")
    shape = tuple(int(d) for d in header[1:])
    body = np.frombuffer(raw, dtype=np.uint8, offset=4 * (1 + ndim))
    if body.size != int(np.prod(shape)):
        raise ValueError(f"{path}: header says shape {shape} but file holds {body.size} bytes of data")
    return body.reshape(shape)


@functools.cache
def _load(split: str) -> tuple[Tensor, Tensor]:
    """Load one split ("train" or "t10k") as (N x 784 float32, N int64), cached."""
    images_path = DATA_DIR / f"{split}-images-idx3-ubyte.gz"
    labels_path = DATA_DIR / f"{split}-labels-idx1-ubyte.gz"
    if not (images_path.is_file() and labels_path.is_file()):
        raise FileNotFoundError(
            f"Fashion-MNIST not found at {DATA_DIR}: install Debian's "
            "dataset-fashion-mnist (apt-get install dataset-fashion-mnist)"
        )
    images = _read_idx(images_path, IMAGE_MAGIC, 3)
    labels = _read_idx(labels_path, LABEL_MAGIC, 1)
    if images.shape[1:] != (ROWS, COLS):
        raise ValueError(f"{images_path}: expected {ROWS}x{COLS} images, got {images.shape[1:]}")
    if images.shape[0] != labels.shape[0]:
        raise ValueError(f"{split}: {images.shape[0]} images but {labels.shape[0]} labels")

    x = torch.from_numpy(images.reshape(len(images), ROWS * COLS).astype(np.float32))
    # In place: each worker loads its own copy, and every temporary of 188 MB costs it page
    # faults for all of its pages.
    x.div_(255.0).sub_(MEAN).div_(STD)
    y = torch.from_numpy(labels.astype(np.int64))
    return x.contiguous(), y.contiguous()


def model() -> nn.Module:
    # About 235k parameters; initialised from torch's global RNG, which the caller seeds.
    return nn.Sequential(
        nn.Linear(ROWS * COLS, 256),
        nn.ReLU(),
        nn.Linear(256, 128),
        nn.ReLU(),
        nn.Linear(128, NUM_CLASSES),
    )


def data(rank: int, world_size: int, batch_size: int) -> Shards:
    x, y = _load("train")
    return Shards(x, y, rank, world_size, batch_size, seed=SEED)


def loss(output: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(output, target)


def evaluate(model: nn.Module) -> dict[str, float]:
    """Accuracy and mean cross-entropy on the 10k test images."""
    x, y = _load("t10k")
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
