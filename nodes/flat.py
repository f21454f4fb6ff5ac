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
with one device-to-host copy per bucket. The gradients' mirrors move into shared memory
where a coordinator on this host reads pushes by reference (`share_grads`), page-locked
there too where CUDA allows. Received weights (frames, or a coordinator's shared memory:
pageable memory, which CUDA copies from in small synchronous pieces, several times slower
than from pinned memory) are copied into a pinned buffer, then to the device in one copy a
bucket (`HostStaging`). On the CPU the mirrors are the buffers themselves and `stage` does
nothing.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from tensorbus.bus.layout import Layout, Span
from tensorbus.bus.pieces import Received, copy_into
from tensorbus.nodes.model_buffers import ModelBuffers, carried

log = logging.getLogger("tensorbus.worker")
_PORTABLE = 1  # cudaHostRegisterPortable: locked for every CUDA context, not only the caller's
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
        self._staging = HostStaging(pinned=pinned)  # what load copies through, on a GPU
        self.use_grad_sets(1)
        self.current = 0  # the gradient set the next backward fills
        with torch.no_grad():
            for param, view in zip(self._params, self.layout.views(self.weights), strict=True):
                view.copy_(param)
                param.data = view
        # Backward-time bookkeeping (see begin_backward): written by the hooks, which run
        # on the thread that runs backward, and read there or after backward returned.
        self._fired = [False] * len(self._params)
        self._adding = False  # between backwards of one step: fresh gradients are added (see accumulate)
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
            first = not self._grad_sets
            if self.device.type == "cpu":
                grads = host = self._new_host_set(first=first)
            else:
                grads, host = self._allocate(self.device), self._new_host_set(first=first)
            self._grad_sets.append(grads)
            self.host_grad_sets.append(host)
            self._grad_views.append(self.layout.views(grads))

    def _new_host_set(self, *, first: bool) -> tuple[torch.Tensor, ...]:
        """A set of the buffers pushes are sent from: `share_grads`'s where it was called,
        else private ones (the gradient set itself on the CPU, a pinned mirror on a GPU)."""
        if self._allocate_grads is None:
            return self._allocate(None, pin=self._pinned and self.device.type != "cpu")
        try:
            made = self._allocate_grads([(b.numel, b.dtype) for b in self.layout.buckets])
        except OSError:
            if first:
                raise  # (share_grads then leaves the sets as they were)
            # A second set is async's: pushes from a private one carry their bytes.
            return self._allocate(None, pin=self._pinned and self.device.type != "cpu")
        if self.device.type != "cpu" and self._pinned:
            _page_lock(made)
        return made

    def share_grads(self, allocate: Allocate) -> None:
        """Keep the buffers that pushes are sent from (the gradient sets on the CPU, their
        host mirrors on a GPU) in buffers that `allocate` makes from (numel, dtype) pairs
        (shared memory: bus.shared), these and any made later. Raises what `allocate`
        raises (OSError), and then the sets are as they were."""
        if self.device.type != "cpu":
            kept_hosts = self.host_grad_sets
            self._allocate_grads = allocate
            try:
                self.host_grad_sets = [self._new_host_set(first=i == 0)
                                       for i in range(len(self._grad_sets))]
            except BaseException:
                self.host_grad_sets, self._allocate_grads = kept_hosts, None
                raise
            return
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

    @contextlib.contextmanager
    def grads_of(self, indices: Sequence[int]) -> Iterator[None]:
        """Within it, only the parameters at `indices` have a `.grad`: an optimizer steps
        them alone (torch's skip a parameter without one, and leave its state as it was)."""
        kept = set(indices)
        for index, param in enumerate(self._params):
            if index not in kept:
                param.grad = None
        try:
            yield
        finally:
            self._bind_grads()

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
        self._adding = False
        if self._on_ready is not None:
            self._left = [0] * self._ranges
            for index, param in enumerate(self._params):
                for r in self._touches[index] if param.requires_grad else ():
                    self._left[r] += 1
            # A range with nothing to wait for (no trainable parameter) is ready now.
            for r, left in enumerate(self._left):
                if left == 0:
                    self._on_ready(r)

    def accumulate(self) -> None:
        """Before another backward of the same step (a pipeline stage's next micro-batch:
        nodes.stage_steps): its fresh gradients are added into the flat set by the hooks,
        in place. (Left to autograd, a gradient that is a view of the flat set is summed
        out of place, a model's worth of memory more at each backward, then copied home.)"""
        for param in self._params:
            param.grad = None
        self._adding = True

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            view = self._grad_views[self.current][index]
            grad = param.grad
            if grad is not None and grad.data_ptr() != view.data_ptr():
                with torch.no_grad():
                    if self._adding and self._fired[index]:
                        view.add_(grad)
                    else:
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
        `.grad` is its view: a parameter that got no gradient gets zeros (one that got one
        from an earlier backward of the step keeps it: see accumulate), and a gradient
        that autograd left somewhere else (a hook that did not run) is copied home."""
        views = self._grad_views[self.current]
        with torch.no_grad():
            for index, (param, view) in enumerate(zip(self._params, views, strict=True)):
                grad = param.grad
                if grad is None and self._adding and self._fired[index]:
                    pass  # (its gradient is in the view already)
                elif grad is None:
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
        """Overwrite the weights with received buffers: on the CPU one copy, straight from
        the frames; on a GPU through pinned memory (HostStaging)."""
        self.layout.check([(t.dtype, tuple(t.shape)) for t in weights])
        with torch.no_grad():
            self._staging.load(self.weights, weights)

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


class HostStaging:
    """Received tensors copied onto the device through pinned host buffers.

    What arrives lies in pageable memory (ZeroMQ's frames, or a coordinator's shared
    memory), which CUDA copies from in small synchronous pieces, several times slower than
    from pinned memory (benchmarks/gpu.py measures both): gathered into pinned buffers
    first, the bytes then go to the device in one copy a buffer. On the CPU it is one copy,
    straight from where they lie.
    """

    def __init__(self, *, pinned: bool = True) -> None:
        self._pinned = pinned
        self._buffers: tuple[torch.Tensor, ...] = ()  # made at the first load onto a device

    def load(self, destinations: Sequence[torch.Tensor], received: Sequence[Received]) -> None:
        """destinations[i][:] = received[i], for 1-D destinations of the same sizes."""
        if not destinations or destinations[0].device.type == "cpu":
            for dst, src in zip(destinations, received, strict=True):
                copy_into(dst, src)
            return
        if [(b.dtype, b.numel()) for b in self._buffers] != [(d.dtype, d.numel()) for d in destinations]:
            self._buffers = tuple(torch.empty(d.numel(), dtype=d.dtype, pin_memory=self._pinned)
                                  for d in destinations)
        for staging, src in zip(self._buffers, received, strict=True):
            copy_into(staging, src)
        for dst, staging in zip(destinations, self._buffers, strict=True):
            dst.copy_(staging, non_blocking=True)
        # (The buffers are written again by the next load.)
        torch.cuda.current_stream(destinations[0].device).synchronize()


def _page_lock(buffers: Sequence[torch.Tensor]) -> None:
    """Page-lock host buffers that were made elsewhere (shared memory: one segment a set,
    so the span from the first to the end of the last, in one registration), so that copies
    from the device reach them at the speed of pinned memory, from every GPU (portable).
    Where CUDA refuses, they stay pageable: slower, and as correct. They stay locked while
    the process lives (the shared memory they lie in stays mapped that long: bus.shared)."""
    spans = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in buffers]
    first, end = min(s for s, _ in spans), max(e for _, e in spans)
    if end <= first:
        return
    cudart = torch.cuda.cudart()
    locked: list[bool] = []
    # In a thread of its own: a refusal leaves CUDA's last error set in the thread that
    # asked, where torch's next check of a kernel launch would raise it. That thread ends.
    asker = threading.Thread(target=lambda: locked.append(
        cudart.cudaHostRegister(first, end - first, _PORTABLE) == cudart.cudaError.success),
        name="tensorbus-page-lock")
    asker.start()
    asker.join()
    if not (locked and locked[0]):
        log.info("gradient mirrors in shared memory stay pageable: CUDA would not lock them")
