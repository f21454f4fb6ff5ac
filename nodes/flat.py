"""A model whose parameters and gradients live in flat per-dtype buffers.

Both nodes keep a model this way: parameters are views into `weights` and gradients views
into `grads`, so that a whole model goes on the wire as one buffer per dtype and arrives
into place with one copy per bucket, with no per-parameter frames or concatenation.
Only parameters take part: a model's buffers (running statistics) stay local to each node.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from bus.layout import Layout
from bus.pieces import Received, copy_into


class FlatModel:
    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._params = [p for _, p in module.named_parameters()]
        self.layout = Layout.of(module.named_parameters())
        self.weights = self.layout.allocate()
        self.grads = self.layout.allocate()
        self._grad_views = self.layout.views(self.grads)
        with torch.no_grad():
            for param, view in zip(self._params, self.layout.views(self.weights), strict=True):
                view.copy_(param)
                param.data = view
        self._bind_grads()

    def _bind_grads(self) -> None:
        for param, view in zip(self._params, self._grad_views, strict=True):
            param.grad = view

    def load(self, weights: Sequence[Received]) -> None:
        """Overwrite the weights with received buffers (one copy, straight from the frames)."""
        self.layout.check([(t.dtype, tuple(t.shape)) for t in weights])
        with torch.no_grad():
            for dst, src in zip(self.weights, weights, strict=True):
                copy_into(dst, src)

    def zero_grad(self) -> None:
        for g in self.grads:
            g.zero_()

    def gather_grads(self) -> None:
        """After backward, make sure every gradient sits in the flat buffer.

        Autograd accumulates into an existing `.grad` in place, but may replace it (for a
        parameter that got no gradient it stays as it was; some ops hand back new tensors):
        copy any stray gradient home and bind the view again.
        """
        with torch.no_grad():
            for param, view in zip(self._params, self._grad_views, strict=True):
                grad = param.grad
                if grad is None or grad.data_ptr() != view.data_ptr():
                    if grad is not None:
                        view.copy_(grad)
                    param.grad = view
