"""A model whose parameters and gradients live in flat per-dtype buffers.

Both nodes keep a model this way: parameters are views into `weights` and gradients are
gathered into `grads`, so that a whole model goes on the wire as one buffer per dtype and
arrives into place with one copy per bucket, with no per-parameter frames or concatenation.
Parameters take part; the model's buffers (running statistics) are laid out flat beside
them (`model_buffers`: nodes.model_buffers), and travel beside them.

Gradients are captured by hooks as backward produces them (`begin_backward`): each
parameter starts the backward pass without a `.grad`, so autograd hands it its fresh
gradient without adding it into anything, and a post-accumulate hook copies it into its
place in the flat buffer at once (one pass over the bytes, where zeroing the buffer and
accumulating into it would take three). The hook also counts down the parameters of each
range a caller watches (a coordinator shard's part of the model) and reports a range
complete while backward is still running: its part can go on the wire while the rest of
the gradient is being computed.

A worker that pipelines its pushes (async: compute the next gradient while the last one is
on the wire) keeps two sets of gradient buffers and alternates (`use_grad_sets(2)`, `swap`).

On a GPU the flat buffers live on the device, and what goes on the wire comes from host
mirrors in pinned memory (`host_grads`, `host_weights`), made once and filled by `stage`
with one device-to-host copy per bucket. Received weights are copied from the frames
straight into the device buffers (host to device, no staging copy of ours). On the CPU
the mirrors are the buffers themselves and `stage` does nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch
from torch import nn

from tensorbus.bus.layout import Layout, Span
from tensorbus.bus.pieces import Received, copy_into
from tensorbus.nodes.model_buffers import ModelBuffers, carried

OnReady = Callable[[int], None]
Allocate = Callable[[Sequence[tuple[int, torch.dtype]]], tuple[torch.Tensor, ...]]


class FlatModel:
    def __init__(self, module: nn.Module, device: str | torch.device = "cpu", *,
                 pinned: bool = True) -> None:
        self.device = torch.device(device)
        self._pinned = pinned  # host mirrors in page-locked memory (benchmarks/gpu.py: off)
        module.to(self.device)
        self.module = module
        self.model_buffers = ModelBuffers(carried(module), self.device)
        self._params = [p for _, p in module.named_parameters()]
        self.layout = Layout.of(module.named_parameters())
        self.weights = self._allocate(self.device)
        on_cpu = self.device.type == "cpu"
        # What travels: the buffers themselves on the CPU, pinned mirrors of them on a GPU.
        self.host_weights = self.weights if on_cpu else self._allocate(None, pin=pinned)
        self._grad_sets: list[tuple[torch.Tensor, ...]] = []
        self.host_grad_sets: list[tuple[torch.Tensor, ...]] = []
        self._grad_views: list[list[torch.Tensor]] = []
        self._allocate_grads: Allocate | None = None  # see share_grads
        self.use_grad_sets(1)
        self.current = 0  # the gradient set the next backward fills
        with torch.no_grad():
            for param, view in zip(self._params, self.layout.views(self.weights), strict=True):
                view.copy_(param)
                param.data = view
        # Backward-time bookkeeping (see begin_backward): written by the hooks, which run
        # on the thread that runs backward, and read there or after backward returned.
        self._fired = [False] * len(self._params)
        self._touches: list[tuple[int, ...]] = [() for _ in self._params]  # param -> ranges
        self._left: list[int] = []  # parameters each watched range still waits for
        self._on_ready: OnReady | None = None
        self._ranges = 0
        self._lock = threading.Lock()  # hooks of one backward may run on several threads
        for index, param in enumerate(self._params):
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._hook(index))
        self._bind_grads()

    @property
    def grads(self) -> tuple[torch.Tensor, ...]:
        """The gradient buffers the next backward fills (the current set)."""
        return self._grad_sets[self.current]

    @property
    def host_grads(self) -> tuple[torch.Tensor, ...]:
        return self.host_grad_sets[self.current]

    @property
    def grad_sets(self) -> int:
        return len(self._grad_sets)

    def use_grad_sets(self, count: int) -> None:
        """Keep `count` (1 or 2) sets of gradient buffers, making what is missing."""
        if count not in (1, 2):
            raise ValueError(f"1 or 2 gradient sets, not {count}")
        while len(self._grad_sets) < count:
            grads = self._new_grad_set(first=not self._grad_sets)
            self._grad_sets.append(grads)
            on_cpu = self.device.type == "cpu"
            self.host_grad_sets.append(grads if on_cpu else self._allocate(None, pin=self._pinned))
            self._grad_views.append(self.layout.views(grads))

    def _new_grad_set(self, *, first: bool) -> tuple[torch.Tensor, ...]:
        if self._allocate_grads is None:
            return self._allocate(self.device)
        try:
            return self._allocate_grads([(b.numel, b.dtype) for b in self.layout.buckets])
        except OSError:
            if first:
                raise  # (share_grads then leaves the sets as they were)
            # A second set is async's: pushes from a private one carry their bytes.
            return self._allocate(self.device)

    def share_grads(self, allocate: Allocate) -> None:
        """Keep the gradient sets in buffers that `allocate` makes from (numel, dtype) pairs
        (shared memory: bus.shared), these and any made later; on the CPU only. Raises what
        `allocate` raises (OSError), and then the sets are as they were."""
        if self.device.type != "cpu":
            raise ValueError("shared gradient buffers are for a model on the CPU")
        count, kept = len(self._grad_sets), (self._grad_sets, self.host_grad_sets, self._grad_views)
        self._grad_sets, self.host_grad_sets, self._grad_views = [], [], []
        self._allocate_grads = allocate
        try:
            self.use_grad_sets(count)
        except BaseException:
            self._grad_sets, self.host_grad_sets, self._grad_views = kept
            self._allocate_grads = None
            raise
        self._bind_grads()

    def swap(self) -> None:
        """Make the next gradient set current: the last one may still be on the wire while
        the next backward fills this one."""
        self.current = (self.current + 1) % len(self._grad_sets)
        self._bind_grads()

    def _allocate(self, device: torch.device | None, *, pin: bool = False) -> tuple[torch.Tensor, ...]:
        return tuple(torch.zeros(b.numel, dtype=b.dtype, device=device or "cpu", pin_memory=pin)
                     for b in self.layout.buckets)

    def _bind_grads(self) -> None:
        for param, view in zip(self._params, self._grad_views[self.current], strict=True):
            param.grad = view

    def watch(self, ranges: Sequence[Sequence[Span]], on_ready: OnReady) -> None:
        """From now on, report (on the backward thread) each range of `ranges` whose
        parameters all have their gradients in place: `on_ready(i)` for range i."""
        entries = self.layout.entries
        self._touches = [
            tuple(i for i, spans in enumerate(ranges) for s in spans
                  if s.bucket == e.bucket and s.start < e.offset + e.numel and e.offset < s.stop)
            for e in entries]
        self._ranges = len(ranges)
        self._on_ready = on_ready

    def begin_backward(self) -> None:
        """Before backward: let every parameter take its fresh gradient (no .grad yet), to
        be copied into the current flat set by the hooks."""
        for param in self._params:
            param.grad = None
        self._fired = [False] * len(self._params)
        if self._on_ready is not None:
            self._left = [0] * self._ranges
            for index, param in enumerate(self._params):
                for r in self._touches[index] if param.requires_grad else ():
                    self._left[r] += 1
            # A range with nothing to wait for (no trainable parameter) is ready now.
            for r, left in enumerate(self._left):
                if left == 0:
                    self._on_ready(r)

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            view = self._grad_views[self.current][index]
            grad = param.grad
            if grad is not None and grad.data_ptr() != view.data_ptr():
                with torch.no_grad():
                    view.copy_(grad)
                param.grad = view  # the fresh gradient is freed now, not after backward
            ready = []
            with self._lock:
                if self._fired[index] or self._on_ready is None or not self._left:
                    self._fired[index] = True
                    return
                self._fired[index] = True
                for r in self._touches[index]:
                    self._left[r] -= 1
                    if self._left[r] == 0:
                        ready.append(r)
            for r in ready:
                self._on_ready(r)  # type: ignore[misc]
        return hook

    def clip_grads(self, max_norm: float) -> float:
        """Scale the current gradients so that their norm (the 2-norm over every element
        of every parameter, as torch.nn.utils.clip_grad_norm_ takes it) is at most
        `max_norm`; the norm they had."""
        with torch.no_grad():
            # (torch's own total norm: over buckets of any float dtypes, fp64 included)
            total = float(torch.nn.utils.get_total_norm(self.grads)) if self.grads else 0.0
            coefficient = max_norm / (total + 1e-6)  # (clip_grad_norm_'s epsilon)
            if coefficient < 1.0:
                for g in self.grads:
                    g.mul_(coefficient)
        return total

    def gather_grads(self) -> None:
        """After backward, make sure every gradient sits in the current flat set and every
        `.grad` is its view: a parameter that got no gradient gets zeros, and a gradient
        that autograd left somewhere else (a hook that did not run) is copied home."""
        views = self._grad_views[self.current]
        with torch.no_grad():
            for param, view in zip(self._params, views, strict=True):
                grad = param.grad
                if grad is None:
                    view.zero_()
                elif grad.data_ptr() != view.data_ptr():
                    view.copy_(grad)
                param.grad = view

    def rebind(self, weights: tuple[torch.Tensor, ...]) -> None:
        """Make `weights` (buffers of this layout, on the CPU) the model's weights: every
        parameter becomes a view into them, without a copy. The old buffers are no longer
        the model's (the coordinator publishes them, see nodes.master.Master.adopt)."""
        if self.device.type != "cpu":
            raise ValueError("rebind is for a model on the CPU, whose weights are sent as they are")
        if [(w.dtype, w.numel()) for w in weights] != [(b.dtype, b.numel) for b in self.layout.buckets]:
            raise ValueError("rebind needs one buffer per bucket of this layout")
        for param, view in zip(self._params, self.layout.views(weights), strict=True):
            param.data = view
        self.weights = self.host_weights = weights

    def load(self, weights: Sequence[Received]) -> None:
        """Overwrite the weights with received buffers (one copy, straight from the frames)."""
        self.layout.check([(t.dtype, tuple(t.shape)) for t in weights])
        with torch.no_grad():
            for dst, src in zip(self.weights, weights, strict=True):
                copy_into(dst, src)

    def stage(self, *, weights: bool, spans: Sequence[Span] | None = None) -> None:
        """Copy the gradients (or, with `weights`, the weights) to their host mirrors, to be
        sent, all of them or only `spans`; returns once the copies are done. Nothing to do
        on the CPU."""
        if self.device.type == "cpu":
            return
        source, mirror = (self.weights, self.host_weights) if weights else (self.grads, self.host_grads)
        with torch.no_grad():
            if spans is None:
                for dst, src in zip(mirror, source, strict=True):
                    dst.copy_(src, non_blocking=True)
            else:
                for s in spans:
                    mirror[s.bucket][s.start:s.stop].copy_(source[s.bucket][s.start:s.stop],
                                                           non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
