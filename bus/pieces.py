"""A flat tensor that arrived in several frames, read where it lies.

Large tensors travel as chunks (see `bus.codec.CHUNK_BYTES`): ZeroMQ moves a 128 MB tensor
about three times faster as 1 MB frames than as one frame, because the receiver allocates
each frame afresh and a huge allocation page-faults all the way through. A received tensor
of more than one chunk is a `Pieces`: consecutive 1-D tensors over the frames' own memory.

The consumers on the hot path (loading weights, reducing gradients, checking that they are
finite) walk any received tensor with `spans` and never join the pieces, so the bytes are
read once, straight from the frames. `whole` joins them (a copy) for cold paths and tests.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch


class Pieces:
    """One tensor as consecutive 1-D parts; `shape` and `dtype` are the whole tensor's."""

    __slots__ = ("dtype", "parts", "shape")

    def __init__(self, parts: Sequence[torch.Tensor], shape: tuple[int, ...]) -> None:
        if not parts:
            raise ValueError("a tensor in pieces needs at least one piece")
        if sum(p.numel() for p in parts) != math.prod(shape):
            raise ValueError(f"pieces of {sum(p.numel() for p in parts)} elements for shape {shape}")
        self.parts = tuple(parts)
        self.shape = shape
        self.dtype = parts[0].dtype

    def numel(self) -> int:
        return math.prod(self.shape)

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def __repr__(self) -> str:
        return f"Pieces({self.dtype}, {list(self.shape)}, {len(self.parts)} parts)"


Received = torch.Tensor | Pieces


def spans(tensor: Received) -> Iterator[tuple[int, torch.Tensor]]:
    """(offset in elements, 1-D part) pairs that cover the tensor in order, without copying."""
    if isinstance(tensor, torch.Tensor):
        yield 0, tensor.reshape(-1)
        return
    offset = 0
    for part in tensor.parts:
        yield offset, part
        offset += part.numel()


def whole(tensor: Received) -> torch.Tensor:
    """The tensor in one piece: itself, or its parts joined (a copy)."""
    if isinstance(tensor, torch.Tensor):
        return tensor
    return torch.cat(tensor.parts).view(tensor.shape)


def copy_into(flat: torch.Tensor, tensor: Received) -> None:
    """flat[:] = tensor, where `flat` is 1-D with the tensor's number of elements."""
    for offset, part in spans(tensor):
        flat[offset : offset + part.numel()].copy_(part)


def add_into(flat: torch.Tensor, tensor: Received) -> None:
    """flat += tensor, in place (the part's dtype may be narrower: bf16 adds into fp32)."""
    for offset, part in spans(tensor):
        flat[offset : offset + part.numel()].add_(part)


def all_finite(tensor: Received) -> bool:
    """True unless some element is NaN or infinite; allocates nothing the tensor's size.

    A finite sum proves every element finite (one NaN or inf makes the sum NaN or inf); only
    a sum that overflowed is checked element by element, a part at a time.
    """
    if not tensor.is_floating_point():
        return True
    for _, part in spans(tensor):
        overflowed = part.numel() and not math.isfinite(float(part.sum()))
        if overflowed and not bool(torch.isfinite(part).all()):
            return False
    return True
