"""The shared memory a worker's pushes lie in, for a coordinator on this host (bus.shared).

A coordinator on the same host reads a push by reference where it lies instead of taking
its bytes off the wire. `PushMemory` owns the worker's side of that: its host token (which
such a coordinator reads, to know it shares the host), the shared allocator that the gradient sets
are moved into, and the kept narrow copies that `--compress bf16|fp16` pushes. Where
there is no shared memory, or no room in it, pushes carry their bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from tensorbus.bus.layout import Compression, Shard
from tensorbus.bus.shared import HostToken, Ref, SharedAllocator, sweep
from tensorbus.nodes.flat import FlatModel
from tensorbus.nodes.outbox import Outbox, ReusingAllocator

log = logging.getLogger("tensorbus.worker")


class PushMemory:
    def __init__(self, *, enabled: bool) -> None:
        """`enabled`: shared memory asked for (on a GPU, the gradients' host mirrors go
        there: nodes.flat)."""
        self._host_token = _host_token() if enabled else None
        # The gradient sets in shared memory, once a coordinator on this host takes them by
        # reference; None: not yet, or not possible here (`gradients`).
        self._shm: SharedAllocator | None = None
        self._reusing: ReusingAllocator | None = None  # over the same shm, for the outbox's narrow buffers
        self._no_shm = self._host_token is None

    @property
    def offer(self) -> str:
        """The host token's offer, named in each Join ("": none, the pushes carry their bytes)."""
        return self._host_token.offer if self._host_token is not None else ""

    def gradients(self, flat: FlatModel, rank: int, *, dense: bool = True
                  ) -> Callable[[torch.Tensor], Ref | None] | None:
        """Where the tensors pushed by reference lie in shared memory, or None if there is
        no room there: pushes then carry the bytes. `dense`: the gradient sets themselves
        (moved there on first use); else only what the Outbox makes there (narrow copies:
        a later join that pushes the sets as they are then sends their bytes)."""
        if self._shm is None and not self._no_shm:
            shm = SharedAllocator()
            try:
                if dense:
                    flat.share_grads(shm.allocate)
            except OSError as e:
                shm.close()
                self._no_shm = True
                log.warning("worker %d: pushes carry their bytes: no room for the gradients "
                            "in shared memory (%s)", rank, e)
            else:
                self._shm = shm
                self._reusing = ReusingAllocator(shm.allocate)
        return self._shm.locate if self._shm is not None else None

    def outbox(self, flat: FlatModel, shards: list[Shard], compression: Compression, rank: int,
               *, weights: bool, shared: bool) -> Outbox:
        """The Outbox, its narrow copies (--compress bf16|fp16) in shared memory if
        `shared` and there is room (else private: their pushes carry the bytes)."""
        if shared and self._reusing is not None and compression.dtype is not None:
            try:
                return Outbox(flat, shards, compression, weights=weights,
                              allocate=self._reusing.round())
            except OSError as e:
                log.warning("worker %d: pushes carry their bytes: no room for their %s copies "
                            "in shared memory (%s)", rank, compression.dtype, e)
        return Outbox(flat, shards, compression, weights=weights)

    def close(self) -> None:
        """As the worker ends: the files go; the buffers stay mapped while used."""
        for shared in (self._shm, self._host_token):
            if shared is not None:
                shared.close()
        if self._host_token is not None:
            sweep()  # a coordinator killed (which we may have outlived) left its own


def _host_token() -> HostToken | None:
    """Our bus.shared.HostToken, or None where there is no shared memory to push from."""
    try:
        sweep()  # segments of killed processes: nobody else would unlink them
        return HostToken()
    except OSError as e:
        log.info("pushes carry their bytes: no shared memory here (%s)", e)
        return None
