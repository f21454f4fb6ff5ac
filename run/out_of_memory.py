"""Saying, in one line, that a worker ran out of memory, and what would make its model fit.

PyTorch's own words for a failed allocation on the CPU ("DefaultCPUAllocator: not enough
memory: you tried to allocate 67108864 bytes") say nothing of why a model needs that much,
and come wrapped in whatever was running (building the model, a forward). A worker that
fails so is named with what its model holds: its parameters, and with their gradients
twice that (and under average its optimizer's state too), which is what must fit on one
worker; and with what makes it fit: a pipeline, which puts a stage on each worker.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# How a failed allocation reads, on the CPU and on CUDA (and a thread whose stack could
# not be had).
_SAID = ("can't allocate memory", "not enough memory", "DefaultCPUAllocator", "out of memory",
         "Cannot allocate memory", "can't start new thread")


class WorkerOutOfMemory(Exception):  # noqa: N818 - an outcome, said as it happened
    """A worker could not allocate what its model needs; the message says what to do."""


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error`, or what it was raised from, is a failed allocation."""
    seen: BaseException | None = error
    for _ in range(8):  # (a chain of causes is short: a bound all the same)
        if seen is None:
            return False
        if isinstance(seen, MemoryError) or (
                isinstance(seen, RuntimeError) and any(s in str(seen) for s in _SAID)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def explain(*, who: str, build: Callable[[], Any], pipelined: bool) -> WorkerOutOfMemory:
    """The error for worker `who` out of memory: `build` makes its model on the meta
    device (no memory), to tell its size; `pipelined`: it holds a pipeline stage."""
    size = _parameter_bytes(build)
    held = (f": its parameters take {_mb(size)}, and {_mb(2 * size)} with their gradients "
            "(under average, its optimizer's state besides)" if size else "")
    if pipelined:
        return WorkerOutOfMemory(
            f"{who} ran out of memory{held}: more stages (--pipeline) put fewer parameters "
            "on each worker, and fewer --micro-batches, or --schedule 1f1b, hold fewer "
            "activations")
    return WorkerOutOfMemory(
        f"{who} ran out of memory{held}, more than this worker may hold: cut the model into "
        "stages (stages() in the SPEC) and run with --pipeline P, which puts one stage on "
        "each of P workers")


def _parameter_bytes(build: Callable[[], Any]) -> int:
    try:
        with torch.device("meta"):
            model = build()
    except Exception:  # noqa: BLE001 - the size is a help: the error is said without it
        return 0
    if not isinstance(model, nn.Module):
        return 0
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _mb(size: int) -> str:
    return f"{size / 2**20:.1f} MB"
