"""A model cut into pipeline stages: the SPEC's `stages()`, grouped and built one at a time.

A SPEC's `stages()` returns the model as modules that run in sequence, each taking what the
one before returned (a tensor, or a tuple of tensors spread into its arguments). A pipeline
of P stages puts consecutive modules on each of P workers (`group`): one each where there
are P of them, else consecutive groups whose largest holds as few parameters as may be.
Each group is a `Stage`, and the whole model is one `Stage` of every module in order
(`whole`), whose state_dict names its parameters as `nn.Sequential(*stages())` does.

A stage's worker must hold only its stage (`build_stage`): it builds the stages on the
meta device, where a parameter takes no memory, and gives real (uninitialised) memory to
its own group alone; its weights and buffers then come from its coordinator, as every
worker's do. A module whose non-persistent buffers hold values made in its constructor (a
causal mask, say), which no coordinator sends, cannot be made this way: such a stage is
built in full, every stage once, and the others let go.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

log = logging.getLogger("tensorbus.worker")
Stages = Callable[[], Sequence[nn.Module]]


class StagesError(Exception):
    """The SPEC's stages() cannot be cut as asked; the message says why."""


class Stage(nn.Sequential):
    """Consecutive modules of a model: each is called with what the one before returned,
    a tuple spread into its arguments."""

    def forward(self, *inputs: Any) -> Any:  # type: ignore[override]
        values: Any = inputs
        for module in self:
            values = module(*values) if isinstance(values, tuple) else module(values)
        return values


def parameters_of(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def group(sizes: Sequence[int], count: int) -> list[range]:
    """Cut modules of `sizes` parameters into `count` consecutive non-empty groups whose
    largest total is as small as may be; of such cuts, the one whose earlier groups are
    longest (a module without parameters, a ReLU say, stays with the one before it)."""
    n = len(sizes)
    if not 1 <= count <= n:
        raise StagesError(f"{n} module(s) cannot be cut into {count} pipeline stages: stages() "
                          "must return at least as many modules as --pipeline")
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    # best[k][i]: the smallest largest group of the first i modules in k groups.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(count + 1)]
    cut = [[0] * (n + 1) for _ in range(count + 1)]
    best[0][0] = 0
    for k in range(1, count + 1):
        for i in range(k, n - (count - k) + 1):
            for j in range(k - 1, i):
                worst = max(best[k - 1][j], prefix[i] - prefix[j])
                if worst <= best[k][i]:
                    best[k][i], cut[k][i] = worst, j
    ends = [n]
    for k in range(count, 0, -1):
        ends.append(cut[k][ends[-1]])
    ends.reverse()
    return [range(a, b) for a, b in zip(ends, ends[1:], strict=False)]


def cut(modules: Sequence[nn.Module], count: int, source: str = "the SPEC") -> list[Stage]:
    """The modules as `count` stages (checked: modules, with parameters somewhere)."""
    for i, module in enumerate(modules):
        if not isinstance(module, nn.Module):
            raise StagesError(f"{source}: stages() item {i} is a {type(module).__name__}, not "
                              "a torch.nn.Module")
    try:
        groups = group([parameters_of(m) for m in modules], count)
    except StagesError as e:
        raise StagesError(f"{source}: {e}") from None
    return [Stage(*(modules[i] for i in g)) for g in groups]


def whole(stages: Sequence[nn.Module]) -> Stage:
    """The model the stages make, as one Stage of their modules in order (the same
    module objects, not copies)."""
    return Stage(*(module for stage in stages for module in stage.children()))


def call_stages(stages: Stages, source: str) -> list[nn.Module]:
    try:
        modules = stages()
    except Exception as e:
        raise StagesError(f"{source}: stages() raised {type(e).__name__}: {e}") from e
    if not isinstance(modules, Sequence) or isinstance(modules, nn.Module):
        raise StagesError(f"{source}: stages() returned {type(modules).__name__}, not a list "
                          "of torch.nn.Module")
    return list(modules)


def build_stage(stages: Stages, index: int, count: int, source: str = "the SPEC") -> Stage:
    """Stage `index` of `count`, holding memory for its own parameters and buffers only
    (uninitialised: they are loaded from the coordinator), where its modules allow."""
    with torch.device("meta"):
        shells = cut(call_stages(stages, source), count, source)
    stage = shells[index]
    if not _all_in_state(stage):
        log.info("stage %d of %d has buffers that are not in its state_dict (made by its "
                 "constructor): built in full, every stage once", index, count)
        return cut(call_stages(stages, source), count, source)[index]
    return stage.to_empty(device="cpu")


def _all_in_state(stage: nn.Module) -> bool:
    """Whether every buffer of `stage` is in its state_dict, as every parameter is: what
    the coordinator sends it, whatever to_empty leaves there."""
    persistent = set(stage.state_dict(keep_vars=True))
    return all(name in persistent for name, _ in stage.named_buffers())
