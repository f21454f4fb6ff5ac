"""A SPEC for tests: examples/digits.py with a BatchNorm layer, whose running statistics
travel with the weights (nodes.model_buffers)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from torch import nn

_path = Path(__file__).resolve().parents[1] / "examples" / "digits.py"
_spec = importlib.util.spec_from_file_location("_bn_digits_base", _path)
assert _spec is not None and _spec.loader is not None
digits = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(digits)

data, loss, evaluate = digits.data, digits.loss, digits.evaluate


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))
