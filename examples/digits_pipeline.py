"""scikit-learn's 8x8 digits with a deeper MLP cut into 4 pipeline stages: a SPEC with stages().

The data, the loss and the evaluation are examples/digits.py's; the model is 4 stages that
run in sequence, each a module that takes what the one before returned. `--pipeline P`
puts consecutive stages on P workers (P of 1, 2 or 4; with 2, two stages each):

    tensorbus local examples/digits_pipeline.py --workers 4 --pipeline 4 --micro-batches 4 --steps 50
    tensorbus local examples/digits_pipeline.py --workers 4 --pipeline 2 --micro-batches 4 --steps 50

The second is data x pipeline: 2 pipelines of 2 stages, each stage's parameters averaged
over the 2 pipelines under sync. `model()` is the same modules in one `nn.Sequential`, for
runs without --pipeline: a `--save` of a pipelined run loads into it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from torch import Tensor, nn

from tensorbus.run.shards import Shards

WIDTH = 128


def _digits() -> ModuleType:
    """examples/digits.py, for its data, loss and evaluation."""
    path = Path(__file__).with_name("digits.py")
    spec = importlib.util.spec_from_file_location("_tensorbus_digits", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_DIGITS = _digits()


def stages() -> list[nn.Module]:
    # Initialised from torch's global RNG, which the caller seeds.
    return [
        nn.Sequential(nn.Linear(_DIGITS.NUM_FEATURES, WIDTH), nn.ReLU()),
        nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()),
        nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()),
        nn.Linear(WIDTH, _DIGITS.NUM_CLASSES),
    ]


def model() -> nn.Module:
    return nn.Sequential(*stages())


def data(rank: int, world_size: int, batch_size: int) -> Shards:
    shards: Shards = _DIGITS.data(rank, world_size, batch_size)
    return shards


def loss(output: Tensor, target: Tensor) -> Tensor:
    value: Tensor = _DIGITS.loss(output, target)
    return value


def evaluate(model: nn.Module) -> dict[str, float]:
    figures: dict[str, float] = _DIGITS.evaluate(model)
    return figures
