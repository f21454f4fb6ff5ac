"""nodes.description: a model and its optimizer as plain data, and what is built from it."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from tensorbus.nodes.description import (
    DescriptionError,
    ModelShell,
    build,
    build_optimizer,
    describe,
)
from tensorbus.nodes.flat import FlatModel


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(),
                         nn.Linear(4 * 6 * 6, 10, bias=False))


def test_the_shell_of_a_described_model_has_its_layout_and_buffers() -> None:
    model = _model()
    shell, _ = build(describe(model, None))
    assert FlatModel(shell).layout.digest == FlatModel(_model()).layout.digest
    assert [(n, p.shape, p.dtype) for n, p in shell.named_parameters()] == \
        [(n, p.shape, p.dtype) for n, p in model.named_parameters()]
    assert list(shell.state_dict()) == list(model.state_dict())  # running stats included
    with pytest.raises(RuntimeError, match="computes nothing"):
        shell(torch.zeros(1))


def test_a_frozen_parameter_stays_frozen() -> None:
    model = _model()
    model[0].bias.requires_grad_(False)
    shell, _ = build(describe(model, None))
    assert [p.requires_grad for p in shell.parameters()] == [True, False, True, True, True]


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4),
    lambda ps: torch.optim.Adam(ps, lr=3e-4, betas=(0.8, 0.95), eps=1e-7),
    lambda ps: torch.optim.AdamW([{"params": ps[:2], "lr": 0.01}, {"params": ps[2:]}], lr=0.02),
], ids=["sgd", "adam", "adamw-groups"])
def test_the_built_optimizer_steps_as_the_described_one(make) -> None:  # noqa: ANN001
    model, twin = _model(), _model()
    ours = make(list(model.parameters()))
    shell, described = build(describe(model, ours))
    assert described is not None
    theirs = build_optimizer(described, list(twin.parameters()))
    assert type(theirs) is type(ours)
    for _ in range(3):
        for m, o in ((model, ours), (twin, theirs)):
            o.zero_grad()
            m(torch.ones(2, 1, 8, 8)).square().sum().backward()
            o.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


def test_an_optimizer_torch_optim_does_not_have_is_refused_in_words() -> None:
    class Mine(torch.optim.SGD):
        pass

    model = _model()
    with pytest.raises(DescriptionError, match="not one of torch.optim's optimizers.*average"):
        describe(model, Mine(model.parameters(), lr=0.1))


def test_an_optimizer_over_other_tensors_is_refused() -> None:
    with pytest.raises(DescriptionError, match="no parameter of the model"):
        describe(_model(), torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1))


def test_a_description_names_only_torch_optim_classes() -> None:
    shell, _ = build(describe(_model(), None))
    with pytest.raises(DescriptionError, match="not one of torch.optim's"):
        build_optimizer({"class": "Module", "groups": []}, list(shell.parameters()))
    with pytest.raises(DescriptionError, match="cannot be read"):
        build(json.dumps({"params": [["w", [2], "no-such-dtype", True]], "buffers": []}))
    assert isinstance(shell, ModelShell)
