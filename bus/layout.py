"""The flat layout of a model's tensors: one contiguous buffer per dtype, views for each tensor.

Gradients and weights travel as one buffer per dtype bucket, not one frame per parameter.
A `Layout` says which named tensor sits where in which bucket; both ends derive it from the
same model, and its digest lets the coordinator refuse a worker built from another model.

A model served by S coordinator shards is split by range (Li et al., OSDI 2014): the
buckets laid end to end and cut into S nearly equal runs of elements. `Layout.shard` says
which ranges of which buckets shard i owns (`Span`s) and the layout those ranges travel as,
one bucket per span, whose digest names the model, i and S: a worker that connects to the
wrong shard, or with another model, is refused at its join like any other layout mismatch.

Streaming averaging (average with fragments) cuts the model into P fragments instead, at
tensor boundaries (`Layout.fragments`), so that a fragment is whole tensors, which an
optimizer can step on alone; each travels as a shard's range does.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

import torch

from tensorbus.bus import quantize
from tensorbus.bus.errors import LayoutError

# --compress bf16|fp16: the dtype float gradients travel in (added into fp32 on arrival).
NARROW: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOPK: Final = "topk:"  # --compress topk:R: the largest R of each range's elements, by magnitude
# --compress int8|int4: average's pushes as block-quantized differences (bus.quantize)
QUANTIZED: dict[str, int] = {"int8": 8, "int4": 4}


@dataclass(frozen=True)
class Compression:
    """How pushes travel (`--compress`). Gradients: as they are, in a narrower float
    dtype, or sparse: the k = ceil(R * n) elements of largest magnitude of each of the
    n-element buckets, as an int64 index tensor and a value tensor (the worker keeps what it
    did not send and adds it to its next gradient: error feedback). Weights (average):
    as they are, or quantized to `bits`: each bucket's difference from the version the
    worker started from, as block-quantized values and their scales (bus.quantize), with
    error feedback too."""

    dtype: torch.dtype | None = None
    topk: float | None = None
    bits: int | None = None

    @classmethod
    def parse(cls, text: str) -> Compression:
        """"" (none), "bf16", "fp16", "int8", "int4" or "topk:R" with 0 < R < 1;
        ValueError otherwise."""
        if not text:
            return cls()
        if text in NARROW:
            return cls(dtype=NARROW[text])
        if text in QUANTIZED:
            return cls(bits=QUANTIZED[text])
        if text.startswith(TOPK):
            try:
                ratio = float(text[len(TOPK):])
            except ValueError:
                ratio = math.nan
            if 0 < ratio < 1:
                return cls(topk=ratio)
        raise ValueError(f"compress {text!r}: choose bf16, fp16 or topk:R with 0 < R < 1 "
                         "(topk:0.01 sends the largest 1% of each gradient), or for average, "
                         "int8 or int4")

    def check(self, weights_pushed: bool, strategy: str) -> None:
        """Refuse, in one line, a compression the strategy's pushes cannot take: int8 and
        int4 are for pushed weights (average), the others for pushed gradients."""
        if weights_pushed and (self.dtype is not None or self.topk is not None):
            raise ValueError(f"under {strategy} workers push weights, which --compress sends "
                             "as int8 or int4 only: choose one of those, or sync, ssp or async")
        if not weights_pushed and self.bits is not None:
            raise ValueError(f"--compress int8 and int4 quantize the weights average pushes, "
                             f"and {strategy} pushes gradients: choose bf16, fp16 or topk:R")

    def keep(self, numel: int) -> int:
        """How many of `numel` elements a top-k push sends."""
        assert self.topk is not None
        return min(numel, max(1, math.ceil(self.topk * numel)))

    def wire(self, layout: Layout) -> Layout:
        """The layout pushes travel as: the model's (or a shard's) layout, in the narrower
        dtype, or per bucket an index bucket and a value bucket of k elements each."""
        if self.topk is not None:
            buckets = []
            for b in layout.buckets:
                k = self.keep(b.numel)
                buckets += [Bucket(torch.int64, k), Bucket(b.dtype, k)]
            return Layout(layout.entries, tuple(buckets))
        if self.bits is not None:
            buckets = []
            for b in layout.buckets:
                values, scales = quantize.sizes(b.numel, self.bits)
                buckets += [Bucket(quantize.VALUE_DTYPE[self.bits], values),
                            Bucket(torch.float32, scales)]
            return Layout(layout.entries, tuple(buckets))
        return layout.on_wire(self.dtype)


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    bucket: int  # index into Layout.buckets
    offset: int  # in elements, inside the bucket
    numel: int


@dataclass(frozen=True)
class Bucket:
    dtype: torch.dtype
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class Span:
    """Elements [start, stop) of bucket `bucket`: one shard's part of it."""

    bucket: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Layout:
    entries: tuple[Entry, ...]
    buckets: tuple[Bucket, ...]

    @classmethod
    def of(cls, named: Iterable[tuple[str, torch.Tensor]]) -> Layout:
        """Lay out tensors in the given order, grouped by dtype in order of first appearance."""
        sizes: dict[torch.dtype, int] = {}
        entries = []
        for name, tensor in named:
            offset = sizes.setdefault(tensor.dtype, 0)
            bucket = list(sizes).index(tensor.dtype)
            entries.append(
                Entry(name, tensor.dtype, tuple(tensor.shape), bucket, offset, tensor.numel())
            )
            sizes[tensor.dtype] = offset + tensor.numel()
        return cls(tuple(entries), tuple(Bucket(d, n) for d, n in sizes.items()))

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def digest(self) -> str:
        text = ";".join(f"{e.name}:{e.dtype}:{list(e.shape)}" for e in self.entries)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def on_wire(self, dtype: torch.dtype | None) -> Layout:
        """This layout as it travels when float buckets are sent as `dtype` (None: as is).
        Same entries and digest: only what the codec checks the frames against changes."""
        if dtype is None:
            return self
        return Layout(self.entries, tuple(
            Bucket(dtype if b.dtype.is_floating_point else b.dtype, b.numel) for b in self.buckets))

    def shard(self, index: int, count: int) -> Shard:
        """The part of this layout that shard `index` of `count` owns. With one shard, the
        whole layout, as it is (same digest: an unsharded coordinator serves it)."""
        if not 0 <= index < count:
            raise ValueError(f"shard {index} of {count}: the index must be in 0..{count - 1}")
        if count == 1:
            return Shard(self, tuple(Span(b, 0, bucket.numel) for b, bucket in enumerate(self.buckets)))
        total = sum(b.numel for b in self.buckets)
        if total < count:
            raise ValueError(f"{count} shards for a model of {total} parameters: use at most {total}")
        # Cut the buckets, laid end to end, at i * total // count.
        first, last = index * total // count, (index + 1) * total // count
        spans, start = [], 0
        for b, bucket in enumerate(self.buckets):
            lo, hi = max(first, start), min(last, start + bucket.numel)
            if lo < hi:
                spans.append(Span(b, lo - start, hi - start))
            start += bucket.numel
        return self._part(spans, f"shard_{index}_of_{count}")

    def fragments(self, count: int) -> tuple[Shard, ...]:
        """This layout cut into `count` fragments for streaming averaging: runs of whole
        tensors, in layout order, each of about 1/count of the elements (each cut at the
        tensor boundary nearest its share). A fragment's tensors of one bucket lie side by
        side in it, so it is one span a bucket, and travels as one bucket a span."""
        entries = self.entries
        if not 1 <= count <= len(entries):
            raise ValueError(f"{count} fragments for a model of {len(entries)} tensors: use "
                             f"1 to {len(entries)}")
        ends = [0]  # elements before entry i, laid end to end in layout order
        for e in entries:
            ends.append(ends[-1] + e.numel)
        cuts = [0]  # the first entry of each fragment
        for i in range(1, count):
            # At least one tensor a fragment: after the last cut, and room for the rest.
            choices = range(cuts[-1] + 1, len(entries) - (count - i) + 1)
            cuts.append(min(choices, key=lambda j: (abs(ends[j] - i * ends[-1] / count), j)))
        cuts.append(len(entries))
        made = []
        for index, (first, last) in enumerate(itertools.pairwise(cuts)):
            spans = []
            for b in range(len(self.buckets)):
                mine = [e for e in entries[first:last] if e.bucket == b]
                if mine:
                    spans.append(Span(b, mine[0].offset, mine[-1].offset + mine[-1].numel))
            made.append(self._part(spans, f"fragment_{index}_of_{count}"))
        return tuple(made)

    def _part(self, spans: Sequence[Span], name: str) -> Shard:
        """The shard of these spans, traveling as one bucket a span, named by `name`."""
        entries, buckets = [], []
        for i, span in enumerate(spans):
            dtype = self.buckets[span.bucket].dtype
            entries.append(Entry(f"{name}_of_{self.digest}_bucket_{span.bucket}_{span.start}",
                                 dtype, (span.numel,), i, 0, span.numel))
            buckets.append(Bucket(dtype, span.numel))
        return Shard(Layout(tuple(entries), tuple(buckets)), tuple(spans))

    def sizes(self) -> list[tuple[int, torch.dtype]]:
        """(numel, dtype) of each bucket's flat buffer."""
        return [(b.numel, b.dtype) for b in self.buckets]

    def allocate(self) -> tuple[torch.Tensor, ...]:
        """Fresh zeroed flat buffers, one per bucket."""
        return tuple(torch.zeros(b.numel, dtype=b.dtype) for b in self.buckets)

    def views(self, flat: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each entry's tensor as a shaped view into the flat buffers (no copy)."""
        return [
            flat[e.bucket][e.offset : e.offset + e.numel].view(e.shape) for e in self.entries
        ]

    def check(self, specs: Sequence[tuple[torch.dtype, tuple[int, ...]]]) -> None:
        """Raise LayoutError unless (dtype, shape) pairs are exactly this layout's buffers.

        Takes descriptions, not tensors, so that the codec can check before it builds any.
        """
        if len(specs) != len(self.buckets):
            raise LayoutError(f"{len(specs)} buffers, the model has {len(self.buckets)}")
        for i, ((dtype, shape), b) in enumerate(zip(specs, self.buckets, strict=True)):
            if dtype != b.dtype or tuple(shape) != (b.numel,):
                raise LayoutError(
                    f"buffer {i} is {dtype}{list(shape)}, expected {b.dtype}[{b.numel}]"
                )

    def check_sparse(self, specs: Sequence[tuple[torch.dtype, tuple[int, ...]]]) -> None:
        """Raise LayoutError unless (dtype, shape) pairs are, per bucket, an int64 index
        tensor and a value tensor of the bucket's dtype, of the same length, at most the
        bucket's (bus.messages.Changes). Whether the indices are in range is for the
        receiver to check, on the tensors."""
        if len(specs) != 2 * len(self.buckets):
            raise LayoutError(f"{len(specs)} buffers, want an index and a value buffer for each "
                              f"of the model's {len(self.buckets)}")
        for b, bucket in enumerate(self.buckets):
            (index_dtype, index_shape), (dtype, shape) = specs[2 * b], specs[2 * b + 1]
            if (index_dtype != torch.int64 or dtype != bucket.dtype or len(shape) != 1
                    or tuple(index_shape) != tuple(shape) or shape[0] > bucket.numel):
                raise LayoutError(
                    f"bucket {b}: indices {index_dtype}{list(index_shape)} and values "
                    f"{dtype}{list(shape)}, expected int64[m] and {bucket.dtype}[m], "
                    f"m <= {bucket.numel}")


@dataclass(frozen=True)
class Shard:
    """What one coordinator shard owns: its ranges of the model's buckets (`spans`) and the
    layout they travel as (one bucket per span, in the same order)."""

    layout: Layout
    spans: tuple[Span, ...]

    def take(self, flat: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The spans of the model's flat buffers, as views (no copy): this shard's buffers."""
        return tuple(flat[s.bucket][s.start : s.stop] for s in self.spans)
