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
from collections.abc import Iterable, Iterator, Sequence

import torch

BLOCK = 1 << 18  # elements summed while in cache (about a megabyte of float32)


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
    """flat[:] = tensor, where `flat` is 1-D with the tensor's number of elements. A part
    that already lies where it would be copied to is left as it is (see nodes.colocated_sets)."""
    for offset, part in spans(tensor):
        place = flat[offset : offset + part.numel()]
        if place.data_ptr() != part.data_ptr():
            place.copy_(part)


def sum_into(flat: torch.Tensor, tensors: Sequence[Received], scale: float = 1.0,
             *, block: int = BLOCK) -> None:
    """flat[:] = scale * (the sum of `tensors`, in the given order), in place.

    Block by block (`block` elements, about a megabyte): each block of `flat` is written
    from the first tensor, added into from the others and scaled while it is in cache,
    instead of one pass over the whole buffer per tensor and one more for the scale. The
    tensors may arrive cut at different places (and in a narrower dtype).
    """
    walkers = _walkers(flat.numel(), tensors)
    for start in range(0, flat.numel(), block):
        stop = min(flat.numel(), start + block)
        _sum_block(flat[start:stop], walkers, start, stop, scale)


def fold(out: torch.Tensor, base: torch.Tensor | None, tensors: Sequence[Received], alpha: float,
         *, stop: int | None = None, block: int = BLOCK) -> None:
    """out = base + alpha * t0 + alpha * t1 + ..., element by element in that order (each
    addition rounded on its own), over out[:stop]; `base` None: out's own elements.

    A plain SGD step over pushed gradients (alpha = -lr / n), made as the pushes come
    (`fold_checked`, one at a time, each on what the last left) or all at once at the end:
    the same bits either way, because every block is cut alike (at multiples of `block`
    from the start, and where each tensor's parts begin), so each element goes through the
    same kernels in the same order."""
    if stop is None:
        stop = out.numel()
    walkers = _walkers(out.numel(), tensors) if tensors else []
    for start in range(0, stop, block):
        end = min(stop, start + block)
        place = out[start:end]
        first = base[start:end] if base is not None else place
        if not walkers:
            place.copy_(first)
        for i, walker in enumerate(walkers):
            _fold_block(place, first if i == 0 else place, walker.cover(start, end), start, alpha)


def fold_checked(out: torch.Tensor, base: torch.Tensor | None, tensor: Received, alpha: float,
                 *, block: int = BLOCK) -> int | None:
    """`fold` one tensor (out = base + alpha * tensor; `base` None: out += ...), checking
    each block of it finite just before it is added, while it is in cache: the check and
    the step read the bytes once between them. None if every element was finite; else the
    start of the first block with a NaN or an infinity, where it stopped: the blocks before
    it hold the tensor already, and the caller builds them again without it (`fold` with
    `stop`). A finite sum proves a block finite; one that overflowed is looked at element
    by element (see all_finite)."""
    (walker,) = _walkers(out.numel(), [tensor])
    for start in range(0, out.numel(), block):
        end = min(out.numel(), start + block)
        cover = list(walker.cover(start, end))
        if tensor.is_floating_point() and not all(_finite(part) for _, part in cover):
            return start
        place = out[start:end]
        _fold_block(place, base[start:end] if base is not None else place, cover, start, alpha)
    return None


def _fold_block(place: torch.Tensor, first: torch.Tensor, cover: Iterable[tuple[int, torch.Tensor]],
                start: int, alpha: float) -> None:
    """place = first + alpha * the tensor's parts over this block (`cover`, from `start`),
    one kernel call per part: `fold` and `fold_checked` cut alike through here."""
    for lo, part in cover:
        at = slice(lo - start, lo - start + part.numel())
        torch.add(first[at], part, alpha=alpha, out=place[at])


def _finite(part: torch.Tensor) -> bool:
    """A finite sum proves every element finite (one NaN or inf makes the sum NaN or inf);
    only a sum that overflowed is checked element by element."""
    return math.isfinite(float(part.sum())) or bool(torch.isfinite(part).all())


def _walkers(count: int, tensors: Sequence[Received]) -> list[_Walker]:
    if not tensors:
        raise ValueError("sum_into needs at least one tensor")
    for t in tensors:
        if t.numel() != count:
            raise ValueError(f"a tensor of {t.numel()} elements for a buffer of {count}")
    return [_Walker(t) for t in tensors]


def _sum_block(out: torch.Tensor, walkers: list[_Walker], start: int, stop: int, scale: float) -> None:
    """out[:] = scale * (the sum of the walkers' elements start to stop).

    The first two are added in one pass (`torch.add(a, b, out=...)`: the same sums as a copy
    then an add, with one pass less over the block) where both are cut alike there and of
    out's dtype; otherwise the first is copied in (a narrower dtype is widened) and the
    others added."""
    covers = [list(walker.cover(start, stop)) for walker in walkers]
    if len(covers) > 1 and _alike(covers[0], covers[1], out.dtype):
        for (lo, a), (_, b) in zip(covers[0], covers[1], strict=True):
            torch.add(a, b, out=out[lo - start : lo - start + a.numel()])
        rest = covers[2:]
    else:
        for lo, part in covers[0]:
            out[lo - start : lo - start + part.numel()].copy_(part)
        rest = covers[1:]
    for cover in rest:
        for lo, part in cover:
            out[lo - start : lo - start + part.numel()].add_(part)
    if scale != 1.0:
        out.mul_(scale)


def _alike(a: list[tuple[int, torch.Tensor]], b: list[tuple[int, torch.Tensor]],
           dtype: torch.dtype) -> bool:
    """Whether two covers of a block are cut at the same places, both in `dtype`."""
    return len(a) == len(b) and all(
        lo_a == lo_b and pa.numel() == pb.numel() and pa.dtype == pb.dtype == dtype
        for (lo_a, pa), (lo_b, pb) in zip(a, b, strict=True))


class _Walker:
    """The parts of a received tensor that cover [start, stop), for ascending ranges."""

    def __init__(self, tensor: Received) -> None:
        self._spans = list(spans(tensor))
        self._at = 0  # the first part that may still overlap

    def cover(self, start: int, stop: int) -> Iterator[tuple[int, torch.Tensor]]:
        spans_ = self._spans
        while spans_[self._at][0] + spans_[self._at][1].numel() <= start:
            self._at += 1
        i = self._at
        while i < len(spans_) and spans_[i][0] < stop:
            offset, part = spans_[i]
            lo, hi = max(start, offset), min(stop, offset + part.numel())
            yield lo, part[lo - offset : hi - offset]
            i += 1


def all_finite(tensor: Received) -> bool:
    """True unless some element is NaN or infinite; allocates nothing the tensor's size
    (a part at a time, see `_finite`)."""
    return not tensor.is_floating_point() or all(_finite(part) for _, part in spans(tensor))
