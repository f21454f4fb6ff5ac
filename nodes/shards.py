"""A sharded parameter server: shard i of S owns a range of the model's flat parameters.

The model's buckets, laid end to end, are cut into S nearly equal ranges (Li et al., OSDI
2014; see `bus.layout.Layout.shard`). Each shard is an ordinary `Coordinator` over a
`ShardModel`: a module whose parameters are its ranges, one flat parameter per range, so
the coordinator's strategy, optimizer, checkpoints and membership work unchanged on them.
A worker connects to every shard (`WorkerConfig(connect=[shard 0, shard 1, ...])`), pushes
each its range and loads each one's weights into its range, all at once.

An optimizer that works element by element (SGD, momentum, Adam, AdamW, RMSprop, ...)
steps a shard's range exactly as it would step the same elements of the whole model; one
that looks at a whole parameter (LARS, LAMB, a per-layer norm) sees flat ranges instead,
and would not.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tensorbus.bus.layout import Layout
from tensorbus.nodes.model_buffers import carried


class ShardModel(nn.Module):
    """Shard `index` of `count` of `model`'s parameters, as flat parameters (copies)."""

    def __init__(self, model: nn.Module, index: int, count: int) -> None:
        super().__init__()
        if count < 2:
            raise ValueError(f"a sharded parameter server has at least 2 shards, got {count}: "
                             "with one, serve the model itself")
        layout = Layout.of(model.named_parameters())
        self.index, self.count = index, count
        self.shard = layout.shard(index, count)
        self._layout = layout
        flat = layout.allocate()
        with torch.no_grad():
            for view, param in zip(layout.views(flat), model.parameters(), strict=True):
                view.copy_(param)
        for entry, part in zip(self.shard.layout.entries, self.shard.take(flat), strict=True):
            self.register_parameter(entry.name, nn.Parameter(part.clone()))
        # The model's buffers travel to and from shard 0 only (nodes.model_buffers).
        self.carried_buffers = ([(name, b.detach().clone()) for name, b in carried(model)]
                                if index == 0 else [])

    def forward(self, *_: object) -> torch.Tensor:
        raise TypeError("a ShardModel holds a range of a model's parameters and computes "
                        "nothing: evaluate the model that `put_into` fills")

    def put_into(self, model: nn.Module) -> None:
        """Write this shard's weights into their place in `model` (the same architecture),
        and, for shard 0, the model's buffers."""
        if Layout.of(model.named_parameters()).digest != self._layout.digest:
            raise ValueError("put_into needs a model of the layout this shard was cut from")
        flat = self._layout.allocate()
        params = list(model.parameters())
        with torch.no_grad():
            for view, param in zip(self._layout.views(flat), params, strict=True):
                view.copy_(param)
            for part, mine in zip(self.shard.take(flat), self.parameters(), strict=True):
                part.copy_(mine)
            for view, param in zip(self._layout.views(flat), params, strict=True):
                param.copy_(view)
            kept = dict(self.carried_buffers)
            for name, buffer in carried(model):
                if name in kept:
                    buffer.copy_(kept[name])


def assemble(model: nn.Module, shards: Iterable[ShardModel]) -> nn.Module:
    """`model` with every shard's weights put into it: the whole model a sharded server trains."""
    for shard in shards:
        shard.put_into(model)
    return model
