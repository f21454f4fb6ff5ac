"""A model and its optimizer described in plain data, for a coordinator that has no SPEC.

A script that brings its own training loop (nodes.own_loop) runs a model the coordinator has
never seen. Its first rank describes it in a Describe message: the name, shape and dtype of
every parameter and carried buffer, and the optimizer's class and hyperparameters, as JSON,
with the initial weights as frames (never pickle: the coordinator builds nothing it is not
told to in these terms). The coordinator builds from it a `ModelShell`, a module that holds
tensors of those names and shapes and computes nothing, whose layout digest equals the
script's model's; and the same torch optimizer over the shell's parameters.

Only the classes of torch.optim are built, with hyperparameters that are numbers, booleans,
None or lists of numbers: a description is data, and names nothing else to import.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from tensorbus.bus.codec import DTYPE_NAMES, DTYPES
from tensorbus.nodes.model_buffers import carried

# Hyperparameters that are a tensor in some torch releases (lr) go as floats; these keys
# say how torch runs the step, not what it computes, and are left to the coordinator.
_HOW = frozenset({"foreach", "fused", "capturable", "differentiable"})


class DescriptionError(ValueError):
    """The model or optimizer cannot be described, or a description cannot be built: the
    message says what and what to do."""


def describe(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> str:
    """The JSON description of `model` (its parameters and carried buffers) and of
    `optimizer` (None: the coordinator steps nothing, as under periodic averaging)."""
    params = list(model.named_parameters())
    index = {id(p): i for i, (_, p) in enumerate(params)}
    described: dict[str, Any] = {
        "params": [[name, list(p.shape), _dtype(p), p.requires_grad] for name, p in params],
        "buffers": [[name, list(b.shape), _dtype(b)] for name, b in carried(model)],
    }
    if optimizer is not None:
        cls = type(optimizer)
        if getattr(torch.optim, cls.__name__, None) is not cls:
            raise DescriptionError(
                f"{cls.__module__}.{cls.__name__} is not one of torch.optim's optimizers, which "
                "a coordinator builds from their description: use one of them, or --strategy "
                "average, under which each rank steps its own optimizer")
        groups = []
        for group in optimizer.param_groups:
            missing = [p for p in group["params"] if id(p) not in index]
            if missing:
                raise DescriptionError(
                    f"the optimizer holds a tensor of shape {tuple(missing[0].shape)} that is no "
                    "parameter of the model: give it the model's parameters")
            settings = {k: _plain(k, v) for k, v in group.items() if k != "params" and k not in _HOW}
            groups.append({"params": [index[id(p)] for p in group["params"]], **settings})
        described["optimizer"] = {"class": cls.__name__, "groups": groups}
    return json.dumps(described)


def _dtype(tensor: torch.Tensor) -> str:
    name = DTYPE_NAMES.get(tensor.dtype)
    if name is None:
        raise DescriptionError(f"a tensor of dtype {tensor.dtype} cannot go on the wire")
    return name


def _plain(key: str, value: Any) -> Any:
    """A hyperparameter as JSON takes it: numbers, booleans, None, lists of them."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(v, (bool, int, float)) for v in value):
        return list(value)
    raise DescriptionError(f"the optimizer's {key}={value!r} cannot be described: give it a "
                           "number, a boolean or a tuple of numbers")


class ModelShell(nn.Module):
    """Tensors of the described names, shapes and dtypes, in the described order; no
    forward. Dotted names become submodules, as the model's own are."""

    def __init__(self, params: Iterable[list[Any]], buffers: Iterable[list[Any]]) -> None:
        super().__init__()
        for name, shape, dtype, requires_grad in params:
            owner, leaf = self._owner(name)
            owner.register_parameter(leaf, nn.Parameter(
                torch.zeros(shape, dtype=_torch_dtype(dtype)), requires_grad=requires_grad))
        for name, shape, dtype in buffers:
            owner, leaf = self._owner(name)
            owner.register_buffer(leaf, torch.zeros(shape, dtype=_torch_dtype(dtype)))

    def _owner(self, name: str) -> tuple[nn.Module, str]:
        *path, leaf = name.split(".")
        owner: nn.Module = self
        for part in path:
            child = owner._modules.get(part)
            if child is None:
                child = nn.Module()
                owner.add_module(part, child)
            owner = child
        return owner, leaf

    def forward(self, *args: Any) -> Any:  # noqa: ARG002
        raise RuntimeError("a ModelShell holds a described model's tensors and computes nothing")


def _torch_dtype(name: str) -> torch.dtype:
    dtype = DTYPES.get(name)
    if dtype is None:
        raise DescriptionError(f"unknown dtype {name!r} in a model description")
    return dtype


def build(text: str) -> tuple[ModelShell, dict[str, Any] | None]:
    """The shell of a described model, and its optimizer's description (None: none)."""
    try:
        described = json.loads(text)
        shell = ModelShell(described["params"], described["buffers"])
    except (ValueError, KeyError, TypeError) as e:
        raise DescriptionError(f"a model description that cannot be read: {e}") from None
    return shell, described.get("optimizer")


def build_optimizer(described: dict[str, Any], params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The described torch.optim optimizer over `params` (the shell's, in order)."""
    cls = getattr(torch.optim, str(described.get("class")), None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise DescriptionError(f"{described.get('class')!r} is not one of torch.optim's optimizers")
    try:
        groups = [{**{k: tuple(v) if isinstance(v, list) else v for k, v in group.items()},
                   "params": [params[i] for i in group["params"]]}
                  for group in described["groups"]]
        make: Callable[[list[dict[str, Any]]], torch.optim.Optimizer] = cls  # (groups alone)
        return make(groups)
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise DescriptionError(f"the described optimizer cannot be built: {e}") from None
