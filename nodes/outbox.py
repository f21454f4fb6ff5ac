"""What a worker's pushes carry: made once, filled range by range as backward finishes.

A worker pushes each coordinator shard its range of the model (the whole model when there
is one coordinator). The `Outbox` holds, per gradient set and per shard, the tensors that
go on the wire, made once, and `fill(shard, set)` makes one shard's part ready to send,
on the thread that runs backward, as soon as backward has finished that range:

- as they are: the flat gradient itself (on the CPU nothing is done; on a GPU its range
  is copied to the pinned host mirror);
- `--compress bf16|fp16`: converted into buffers of the narrower dtype (one copy), made
  by `allocate` where one is given (shared memory, so that they go by reference:
  bus.shared);
- `--compress topk:R`: the k = ceil(R * n) elements of largest magnitude of each range
  (found by `nodes.largest`), as int64 indices and their values, with error feedback
  (Stich et al. 2018, "Sparsified SGD with memory"): what is not sent stays in a
  residual and is added to the next gradient, so every element's gradient is sent
  eventually. What a push carried is no longer owed once it is sent: if the coordinator
  then drops the push (late, under backups), it is lost, as a dense push's gradient would
  be; so is the residual of a worker that leaves (a rejoining worker starts a new one).

Weights (periodic averaging) travel as they are, from the flat weights (or their mirror),
or with `--compress int8|int4` as the change since the version the local steps started
from (`anchor`), plus what earlier pushes left out (error feedback), block-quantized
(bus.quantize, in `fill_weights`). The coordinator holds that version, and takes the
change from it.

Nothing here allocates a gradient-sized buffer after construction, except the quantizing
of weights, once a push (every H local steps).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from tensorbus.bus import quantize
from tensorbus.bus.layout import Compression, Shard
from tensorbus.nodes.flat import Allocate, FlatModel
from tensorbus.nodes.largest import Largest


class Outbox:
    def __init__(self, flat: FlatModel, shards: list[Shard], compression: Compression, *,
                 weights: bool, allocate: Allocate | None = None) -> None:
        self._flat, self._shards, self._compression = flat, shards, compression
        self._narrow = compression.dtype is not None and not weights
        self._topk = compression.topk is not None and not weights
        self._bits = compression.bits if weights else None
        self.parts: list[list[tuple[torch.Tensor, ...]]]  # [gradient set][shard] -> tensors
        if self._bits is not None:
            # Made where the weights are; on a GPU, copied to the host parts to be sent.
            self._quantized = [self._quantized_part(shard, flat.device) for shard in shards]
            self.parts = [[self._quantized_part(shard, torch.device("cpu")) for shard in shards]
                          if flat.device.type != "cpu" else self._quantized]
            self._anchor = tuple(w.detach().clone() for w in flat.weights)
            self._residual = tuple(torch.zeros_like(w, dtype=torch.float32) for w in flat.weights)
        elif weights:
            self.parts = [[shard.take(flat.host_weights) for shard in shards]]
        elif self._topk:
            self.parts = [[self._sparse(shard) for shard in shards] for _ in range(flat.grad_sets)]
            device = flat.device
            # What was not sent yet, and a scratch buffer for magnitudes (no allocation later).
            self._residual = tuple(torch.zeros_like(g, device=device) for g in flat.grads)
            self._magnitude = tuple(torch.zeros_like(g, device=device) for g in flat.grads)
            self._largest = [[Largest(s.numel, compression.keep(s.numel), dtype=b.dtype, device=device)
                              for s, b in zip(shard.spans, shard.layout.buckets, strict=True)]
                             for shard in shards]
        elif self._narrow:
            wire = flat.layout.on_wire(compression.dtype)
            wires = [allocate([(b.numel, b.dtype) for b in wire.buckets]) if allocate
                     else wire.allocate() for _ in range(flat.grad_sets)]
            self.parts = [[shard.take(wire) for shard in shards] for wire in wires]
        else:
            self.parts = [[shard.take(grads) for shard in shards] for grads in flat.host_grad_sets]

    def _sparse(self, shard: Shard) -> tuple[torch.Tensor, ...]:
        """Per span of the shard: an index tensor and a value tensor of k elements."""
        tensors: list[torch.Tensor] = []
        for span, bucket in zip(shard.spans, shard.layout.buckets, strict=True):
            k = self._compression.keep(span.numel)
            tensors += [torch.zeros(k, dtype=torch.int64), torch.zeros(k, dtype=bucket.dtype)]
        return tuple(tensors)

    def _quantized_part(self, shard: Shard, device: torch.device) -> tuple[torch.Tensor, ...]:
        assert self._bits is not None
        return quantized_part(shard, self._bits, device)

    def anchor(self) -> None:
        """Before local steps whose weights are pushed quantized: the weights they start
        from (the version loaded, which the coordinator holds). Nothing otherwise."""
        if self._bits is None:
            return
        with torch.no_grad():
            for kept, weights in zip(self._anchor, self._flat.weights, strict=True):
                kept.copy_(weights)

    def fill_weights(self) -> None:
        """After local steps whose weights are pushed: on a GPU, the weights copied to
        their host mirror, which the parts are views of; quantized, each shard's change
        since `anchor`, plus the residual, quantized into its parts, and what the integers
        leave out becomes the residual. A change that is not finite is sent as it is (its
        scales are not finite: the coordinator drops it) and leaves the residual as it was."""
        bits = self._bits
        if bits is None:
            self._flat.stage(weights=True)
            return
        weights = self._flat.weights
        with torch.no_grad():
            for index, shard in enumerate(self._shards):
                made, part = self._quantized[index], self.parts[0][index]
                for n, s in enumerate(shard.spans):
                    quantize_change(self._anchor[s.bucket][s.start:s.stop],
                                    weights[s.bucket][s.start:s.stop],
                                    self._residual[s.bucket][s.start:s.stop],
                                    made[2 * n], made[2 * n + 1], bits)
                if part is not made:
                    for host, device in zip(part, made, strict=True):
                        host.copy_(device)

    def fill(self, index: int, current: int) -> None:
        """Make shard `index`'s part of gradient set `current` ready to send."""
        spans = self._shards[index].spans
        grads = self._flat.grads
        if self._topk:
            part = self.parts[current][index]
            with torch.no_grad():
                for n, s in enumerate(spans):
                    grad = grads[s.bucket][s.start:s.stop]
                    residual = self._residual[s.bucket][s.start:s.stop]
                    magnitude = self._magnitude[s.bucket][s.start:s.stop]
                    # A NaN or inf added to the residual would stay there, k elements
                    # sent (and dropped) a push, for about 1/R pushes: a non-finite
                    # gradient is sent as it is (the coordinator drops it, as it would a
                    # dense one) and the residual is left as it was. (A NaN anywhere
                    # makes both extremes NaN; one pass finds both.)
                    low, high = torch.aminmax(grad)
                    finite = math.isfinite(low) and math.isfinite(high)
                    if finite:
                        residual.add_(grad)  # gradient + what was left
                    source = residual if finite else grad
                    torch.abs(source, out=magnitude)
                    indices, values = part[2 * n], part[2 * n + 1]
                    chosen = (self._largest[index][n](magnitude) if finite  # NaN: topk keeps it
                              else torch.topk(magnitude, indices.numel(), sorted=False).indices)
                    indices.copy_(chosen)
                    values.copy_(source[chosen])
                    if finite:
                        residual.index_fill_(0, chosen, 0)  # sent: no longer owed
        elif self._narrow:
            part = self.parts[current][index]
            with torch.no_grad():
                for wire, s in zip(part, spans, strict=True):
                    wire.copy_(grads[s.bucket][s.start:s.stop])
        else:
            self._flat.stage(weights=False, spans=spans)


def quantized_part(shard: Shard, bits: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """What a shard's (or a fragment's) quantized change travels as: per span, its values
    and its scales (bus.quantize.sizes)."""
    tensors: list[torch.Tensor] = []
    for span in shard.spans:
        values, scales = quantize.sizes(span.numel, bits)
        tensors += [torch.zeros(values, dtype=quantize.VALUE_DTYPE[bits], device=device),
                    torch.zeros(scales, dtype=torch.float32, device=device)]
    return tuple(tensors)


def quantize_change(start: torch.Tensor, end: torch.Tensor, residual: torch.Tensor,
                    values: torch.Tensor, scales: torch.Tensor, bits: int) -> None:
    """(start - end) + residual, quantized into `values` and `scales` (bus.quantize); what
    the integers leave out becomes the residual (error feedback). A change that is not
    finite is sent as it is (its scales are not finite: the coordinator drops it) and
    leaves the residual as it was."""
    change = start.float() - end.float()
    finite = bool(torch.isfinite(change).all())
    if finite:
        change.add_(residual)
    quantize.quantize(change, bits, values, scales)
    if finite:
        residual.copy_(change)
        quantize.dequantize_add(residual, values, scales, bits, alpha=-1.0)


class ReusingAllocator:
    """An allocator that keeps what it makes: each `round()` hands out, in order, the sets
    made in the rounds before (for the same buckets), then new ones. A worker makes a new
    Outbox at every join; its narrow buffers in shared memory are the same segments again,
    not new ones piling up in /dev/shm for as long as the worker lives."""

    def __init__(self, allocate: Allocate) -> None:
        self._allocate = allocate
        self._made: dict[tuple[tuple[int, torch.dtype], ...], list[tuple[torch.Tensor, ...]]] = {}
        self._taken: dict[tuple[tuple[int, torch.dtype], ...], int] = {}

    def round(self) -> Allocate:
        self._taken.clear()
        return self._take

    def _take(self, buckets: Sequence[tuple[int, torch.dtype]]) -> tuple[torch.Tensor, ...]:
        key = tuple(buckets)
        made, taken = self._made.setdefault(key, []), self._taken.get(key, 0)
        if taken == len(made):
            made.append(self._allocate(key))
        self._taken[key] = taken + 1
        return made[taken]
