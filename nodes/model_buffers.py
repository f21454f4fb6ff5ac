"""A model's buffers (BatchNorm's running statistics, say) as they travel with its weights.

Buffers are not trained by gradients, so they are not in the weights' layout; but a model
evaluated with the statistics it started with is scored wrongly, so they travel beside the
weights (`Message.state`):

- a worker sends its buffers with every push (`ModelBuffers.copy`), its gradients' or its
  weights' (average);
- the coordinator keeps the newest buffers of each worker and publishes their combination
  (`BufferMean`) with every version, in checkpoints too;
- a worker loads the published buffers with the weights, as DDP's ranks take rank 0's at
  every forward (`broadcast_buffers`).

The combination averages the floating-point buffers over the workers, each worker's
newest equally, and takes the largest of the others (BatchNorm's `num_batches_tracked`: the
count of the worker that has seen the most batches).

The buffers that travel are those a state_dict holds (persistent ones), in the model's
order, laid out flat by dtype like the weights (`bus.layout`): the module's buffers become
views into those flat tensors, which its forward updates in place. A model without buffers
sends nothing more.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tensorbus.bus.layout import Layout
from tensorbus.bus.pieces import Received, copy_into

Flat = tuple[torch.Tensor, ...]


def carried(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers of `module` that travel: the persistent ones, as its state_dict names
    them. A module may say its own (`carried_buffers`: a coordinator shard, which carries
    the whole model's on shard 0 and none on the others)."""
    own = getattr(module, "carried_buffers", None)
    if own is not None:
        return list(own)
    persistent = set(module.state_dict(keep_vars=True))
    return [(name, b) for name, b in module.named_buffers() if name in persistent]


class ModelBuffers:
    """A module's carried buffers, bound as views into flat tensors, one per dtype."""

    def __init__(self, named: Sequence[tuple[str, torch.Tensor]], device: torch.device) -> None:
        self.layout = Layout.of(named)
        self.flat: Flat = tuple(torch.zeros(b.numel, dtype=b.dtype, device=device)
                                for b in self.layout.buckets)
        with torch.no_grad():
            for (_, buffer), view in zip(named, self.layout.views(self.flat), strict=True):
                view.copy_(buffer)
                buffer.data = view  # (the module's own tensor, now a view: updated in place)

    def __bool__(self) -> bool:
        return bool(self.layout.entries)

    def copy(self) -> Flat:
        """The buffers as they are now, in fresh CPU tensors (what a push carries: the
        forward that follows writes the module's own again)."""
        return tuple(t.detach().to("cpu", copy=True) for t in self.flat)

    def load(self, received: Sequence[Received]) -> None:
        """Overwrite the buffers with received ones (LayoutError if they do not fit)."""
        self.layout.check([(t.dtype, tuple(t.shape)) for t in received])
        with torch.no_grad():
            for dst, src in zip(self.flat, received, strict=True):
                copy_into(dst, src)


class BufferMean:
    """The newest buffers of each worker, and their combination (see the module's doc)."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self._newest: dict[int, Flat] = {}
        self._changed = False

    def take(self, rank: int, received: Sequence[Received]) -> None:
        """Keep `rank`'s buffers (copied out of the frames); LayoutError if they do not fit."""
        self.layout.check([(t.dtype, tuple(t.shape)) for t in received])
        kept = []
        for bucket, tensor in zip(self.layout.buckets, received, strict=True):
            own = torch.empty(bucket.numel, dtype=bucket.dtype)
            copy_into(own, tensor)
            kept.append(own)
        self._newest[rank] = tuple(kept)
        self._changed = True

    def forget(self, rank: int) -> None:
        """Leave `rank` out from now on (it was removed: its statistics are of the past)."""
        if self._newest.pop(rank, None) is not None and self._newest:
            self._changed = True

    def combine(self) -> Flat | None:
        """The combination of the newest buffers, in fresh tensors, if any came since the
        last call; else None (nothing new to publish)."""
        if not self._changed or not self._newest:
            return None
        self._changed = False
        sets = [self._newest[rank] for rank in sorted(self._newest)]
        combined = []
        for b, bucket in enumerate(self.layout.buckets):
            stacked = torch.stack([s[b] for s in sets])
            if bucket.dtype.is_floating_point:
                # (Summed in float64: the same mean whatever the order of ranks.)
                combined.append(stacked.double().mean(0).to(bucket.dtype))
            elif bucket.dtype == torch.bool:
                combined.append(stacked.any(0))
            else:
                combined.append(stacked.amax(0))
        return tuple(combined)


class ServedBuffers:
    """A coordinator's side of the buffers: its workers' newest (`BufferMean`), and what
    goes out with its weights.

    At the root that is the workers' combination, which the model's own buffers then hold
    (for evaluate() and checkpoints). A relay (`relay=True`) publishes the root's instead,
    which its upstream link loads into its model, and sends its own workers' combination
    up with its updates (`upstream`).
    """

    def __init__(self, model: ModelBuffers, *, relay: bool = False) -> None:
        self.model = model
        self.relay = relay
        self._mean = BufferMean(model.layout)
        self._out = model.copy()  # the root's published buffers (never written again)
        self._up: Flat = ()  # a relay's workers' combination, as last made

    def take(self, rank: int, received: Sequence[Received]) -> None:
        """Keep `rank`'s buffers, sent with an update that was taken (LayoutError if they
        are not the model's)."""
        self._mean.take(rank, received)

    def forget(self, rank: int) -> None:
        self._mean.forget(rank)

    def refresh(self) -> None:
        """At the root: the model's buffers become the workers' combination, if any came
        since."""
        if self.relay:
            return
        combined = self._mean.combine()
        if combined is not None:
            self.model.load(combined)
            self._out = combined

    def loaded(self) -> None:
        """The model's buffers were loaded from elsewhere (a checkpoint): publish those."""
        self._out = self.model.copy()

    def published(self) -> Flat:
        """What goes out with the weights now."""
        if not self.model:
            return ()
        if self.relay:
            return self.model.copy()
        self.refresh()
        return self._out

    def upstream(self) -> Flat:
        """A relay's: its workers' combination, to go up with its update."""
        combined = self._mean.combine()
        if combined is not None:
            self._up = combined
        return self._up
