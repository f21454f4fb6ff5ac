"""A model whose parameters and gradients live in flat per-dtype buffers.

Both nodes keep a model this way: parameters are views into `weights` and gradients views
into `grads`, so that a whole model goes on the wire as one buffer per dtype and arrives
into place with one copy per bucket, with no per-parameter frames or concatenation.
Only parameters take part: a model's buffers (running statistics) stay local to each node.

On a GPU the flat buffers live on the device, and what goes on the wire comes from host
mirrors in pinned memory (`host_grads`, `host_weights`), made once and filled by `stage`
with one device-to-host copy per bucket. Received weights are copied from the frames
straight into the device buffers (host to device, no staging copy of ours). On the CPU
the mirrors are the buffers themselves and `stage` does nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from bus.layout import Layout
from bus.pieces import Received, copy_into


class FlatModel:
    def __init__(self, module: nn.Module, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        module.to(self.device)
        self.module = module
        self._params = [p for _, p in module.named_parameters()]
        self.layout = Layout.of(module.named_parameters())
        self.weights = self._allocate(self.device)
        self.grads = self._allocate(self.device)
        on_cpu = self.device.type == "cpu"
        # What travels: the buffers themselves on the CPU, pinned mirrors of them on a GPU.
        self.host_weights = self.weights if on_cpu else self._allocate(None, pin=True)
        self.host_grads = self.grads if on_cpu else self._allocate(None, pin=True)
        self._grad_views = self.layout.views(self.grads)
        with torch.no_grad():
            for param, view in zip(self._params, self.layout.views(self.weights), strict=True):
                view.copy_(param)
                param.data = view
        self._bind_grads()

    def _allocate(self, device: torch.device | None, *, pin: bool = False) -> tuple[torch.Tensor, ...]:
        return tuple(torch.zeros(b.numel, dtype=b.dtype, device=device or "cpu", pin_memory=pin)
                     for b in self.layout.buckets)

    def _bind_grads(self) -> None:
        for param, view in zip(self._params, self._grad_views, strict=True):
            param.grad = view

    def load(self, weights: Sequence[Received]) -> None:
        """Overwrite the weights with received buffers (one copy, straight from the frames)."""
        self.layout.check([(t.dtype, tuple(t.shape)) for t in weights])
        with torch.no_grad():
            for dst, src in zip(self.weights, weights, strict=True):
                copy_into(dst, src)

    def stage(self, *, weights: bool) -> None:
        """Copy the gradients (or, with `weights`, the weights) to their host mirrors, to be
        sent; returns once the copies are done. Nothing to do on the CPU."""
        if self.device.type == "cpu":
            return
        source, mirror = (self.weights, self.host_weights) if weights else (self.grads, self.host_grads)
        with torch.no_grad():
            for dst, src in zip(mirror, source, strict=True):
                dst.copy_(src, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()

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
