"""Unit: FlatModel.clip_grads is torch.nn.utils.clip_grad_norm_ over the flat gradient
buffers, whatever their float dtypes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tensorbus.nodes.flat import FlatModel

pytestmark = pytest.mark.timeout(10)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 3).double())


@pytest.mark.parametrize("max_norm", [0.05, 1e6], ids=["clipped", "left alone"])
def test_clip_grads_is_clip_grad_norm_over_mixed_dtypes(max_norm: float) -> None:
    inputs = torch.randn(5, 6)

    def backward(model: nn.Module) -> None:  # float32 first layer, float64 second
        model[1](model[0](inputs).double()).sum().backward()

    reference = _model()
    backward(reference)
    want_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
    flat = FlatModel(_model())
    backward(flat.module)
    flat.gather_grads()
    assert flat.clip_grads(max_norm) == pytest.approx(float(want_norm))
    for got, want in zip(flat.module.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad)
