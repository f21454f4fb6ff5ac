"""Unit: --precision's parsing, where it may run, its autocast, and fp16's loss scale."""

from __future__ import annotations

import pytest
import torch

from tensorbus.nodes.config import CoordinatorConfig
from tensorbus.nodes.precision import LossScale, Precision

pytestmark = pytest.mark.timeout(30)


def test_the_choices_and_a_one_line_error_for_anything_else() -> None:
    assert Precision.parse("") is Precision.FULL
    assert Precision.parse("bf16-mixed") is Precision.BF16
    with pytest.raises(ValueError, match="^--precision 'fp8': choose bf16-mixed or fp16-mixed$"):
        Precision.parse("fp8")
    with pytest.raises(ValueError, match="choose bf16-mixed"):
        CoordinatorConfig(batch_size=8, steps=1, precision="half")


def test_fp16_is_refused_on_the_cpu_and_bf16_runs_there() -> None:
    with pytest.raises(ValueError, match="^--precision fp16-mixed needs CUDA, and this worker "
                                         "computes on cpu: use bf16-mixed there$"):
        Precision.FP16.check(torch.device("cpu"))
    Precision.BF16.check(torch.device("cpu"))
    layer = torch.nn.Linear(4, 3)
    with Precision.BF16.autocast(torch.device("cpu")):
        assert layer(torch.randn(2, 4)).dtype == torch.bfloat16
    with Precision.FULL.autocast(torch.device("cpu")):
        assert layer(torch.randn(2, 4)).dtype == torch.float32
    assert layer.weight.dtype == torch.float32  # (the weights stay as they are)


def test_the_loss_scale_unscales_skips_overflows_and_grows_back() -> None:
    scale = LossScale(8.0, growth_interval=2)
    grads = (torch.full((3,), 16.0), torch.tensor([1, 2]))  # (an integer bucket: left alone)
    assert scale.unscale(grads)
    assert grads[0].tolist() == [2.0, 2.0, 2.0] and grads[1].tolist() == [1, 2]
    assert (scale.scale, scale.skipped) == (8.0, 0)
    assert not scale.unscale((torch.tensor([1.0, float("inf")]),))
    assert (scale.scale, scale.skipped) == (4.0, 1)
    assert not scale.unscale((torch.tensor([float("nan")]),))
    assert (scale.scale, scale.skipped) == (2.0, 2)
    assert scale.unscale((torch.ones(1),)) and scale.scale == 2.0
    assert scale.unscale((torch.ones(1),)) and scale.scale == 4.0  # 2 good steps in a row
