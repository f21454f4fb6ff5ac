"""A link's chain of versions: the weights and Changes received, and loading them.

A `VersionChain` is one part of a `Link` (nodes.link). It owns the version of the link's
range of the model (its `Shard`: the whole model when there is one coordinator), the newest
whole weights received and not loaded yet, and the unbroken chain of Changes
(nodes.changes) after them, or of Fragments (streaming averaging: one fragment of the
model a version); the worker loads both, in order, between computes (`latest`, then `load`
off the loop and `forget_loaded` on it, or `load_latest`).

Changes that do not follow on from the newest version kept (one was missed: a subscriber
that connected late, or a full queue) are kept aside, and the whole version is pulled
(`resyncs`); those that follow on from it are then taken. A waiter for a version pulls it
when the broadcast was missed (`await_version`). Weights that came by reference, from the
coordinator's shared memory (bus.shared), are loaded on the loop (`load_shared`), or computed
on where they lie (`take_shared`, `give_back`). Once stopped, `load_final` loads the version
the coordinator stopped at.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from tensorbus.bus.deadline import at_most
from tensorbus.bus.errors import PeerTimeoutError, RejectedError
from tensorbus.bus.layout import Layout, Shard
from tensorbus.bus.messages import Changes, Fragment, Message, Pull, Weights, Welcome
from tensorbus.bus.shared import SegmentCache
from tensorbus.nodes import changes as changed
from tensorbus.nodes.flat import HostStaging
from tensorbus.nodes.liveness import Liveness, Owner, Stopped
from tensorbus.nodes.model_buffers import ModelBuffers

log = logging.getLogger("tensorbus.worker")
_ASIDE = 64  # Changes kept aside while a missed one is made up for; older ones are let go


@dataclass(frozen=True)
class PendingVersion:
    """A version newer than the one loaded: whole weights (or none), then Changes on top."""

    weights: Weights | Welcome | None
    changes: tuple[Changes | Fragment, ...]

    @property
    def version(self) -> int:
        return self.changes[-1].version if self.changes else self.weights.version  # type: ignore[union-attr]


class Requester(Protocol):
    """What the chain needs of its link: to pull a version it missed."""

    request_timeout_s: float

    async def request(
        self, message: Message, *, timeout: float | None = None, patient: bool = False
    ) -> Message: ...


class VersionChain:
    def __init__(
        self,
        layout: Layout,
        weights: tuple[torch.Tensor, ...],
        owner: Owner,
        peer: str,
        liveness: Liveness,
        link: Requester,
        model_buffers: ModelBuffers | None,
    ) -> None:
        """`weights`: this shard's views of the worker's flat weights. `model_buffers`: where
        the buffers published with the weights are loaded (None: not by this link)."""
        self.layout = layout
        self._weights = weights
        self._staging = HostStaging()  # (on a GPU: what loads go through)
        self._owner = owner
        self.peer = peer
        self._liveness = liveness
        self._link = link
        self.model_buffers = model_buffers
        self._published_buffers: tuple[torch.Tensor, ...] = ()  # the last loaded, kept
        self.version = 0  # the version of this shard's weights in the model now
        self._whole: Weights | None = None  # newest whole weights received, not yet loaded
        self._whole_shared = False  # they came by reference: loaded by load_shared only
        self._changes: list[Changes | Fragment] = []  # each on top of the last, the first on _whole
        self._aside: dict[int, Changes | Fragment] = {}  # base -> those that do not follow on (yet)
        # Streaming averaging: the model's fragments, which Fragment broadcasts are written
        # into (set from each Welcome).
        self.fragments: tuple[Shard, ...] = ()
        self._missed = asyncio.Event()  # set: a version was missed; pull the whole one
        self._arrived = asyncio.Event()  # set: something newer came, or the run stopped
        self.by_reference = 0  # versions loaded from the coordinator's shared memory
        self.torn = 0  # of those, copies thrown away: the set was being written meanwhile

    def welcomed(self, welcome: Welcome) -> None:
        """Load a join's weights; what was received before it belongs to another membership."""
        self.load(welcome)
        self._whole, self._changes, self._aside = None, [], {}
        self._missed.clear()

    def wake_waiter(self) -> None:
        """Have `await_version` look again (a heartbeat announced a version, or a Stop came)."""
        self._arrived.set()

    # Loading -------------------------------------------------------------------------------

    def load(self, weights: Weights | Welcome | PendingVersion) -> None:
        """Copy received weights into this shard's part of the model (on the CPU one copy,
        straight from the frames; on a GPU through pinned memory: nodes.flat.HostStaging),
        then write the Changes after them, and take their version."""
        if isinstance(weights, PendingVersion):
            if weights.weights is not None:
                self.load(weights.weights)
            for change in weights.changes:
                if isinstance(change, Fragment):
                    spans = self.fragments[change.fragment].take(self._weights)
                    with torch.no_grad():
                        self._staging.load(spans, change.tensors)
                else:
                    changed.apply(self._weights, change.tensors)
                self._load_buffers(change)
                self.version = change.version
            return
        self.layout.check([(t.dtype, tuple(t.shape)) for t in weights.tensors])
        with torch.no_grad():
            self._staging.load(self._weights, weights.tensors)
        self._load_buffers(weights)
        self.version = weights.version

    def _load_buffers(self, message: Message) -> None:
        """The model's buffers published with these weights, if they came with them."""
        if message.state and self.model_buffers is not None:
            self.model_buffers.load(message.state)
            if not self._published_buffers:  # (made once, then written over)
                self._published_buffers = self.model_buffers.copy()
            else:
                for kept, loaded in zip(self._published_buffers, self.model_buffers.flat,
                                        strict=True):
                    kept.copy_(loaded)

    async def load_shared(self) -> None:
        """Load, here on the loop, the newest whole weights if they came by reference (from
        the coordinator's shared memory: bus.shared.SharedWeightPool), so that nothing loads them
        off the loop; then `latest` holds none. A copy made while the coordinator wrote the
        set again (its generation moved) is thrown away, and the version's bytes pulled."""
        while self.shared_pending():
            weights = self._whole
            assert weights is not None
            first = weights.tensors[0]
            assert isinstance(first, torch.Tensor)  # (by reference: one view a tensor)
            had = self.version
            self.load(weights)
            whole = SegmentCache.generation(first) == weights.generation
            self._whole, self._whole_shared = None, False
            del weights, first  # (the references, not the set: it stays mapped)
            if whole:
                self.by_reference += 1
            else:
                self.torn += 1
                log.info("worker %d: the %s rewrote the weights of version %d while they "
                         "were copied: pulling them", self._owner.rank, self.peer, self.version)
                self.version = had  # what the model holds now is nobody's version
                # Changes on top of the torn version wait aside for the version pulled.
                self._aside.update((c.base, c) for c in self._changes)
                self._changes = []
                reply = await self._link.request(Pull(sender=self._owner.rank, version=had),
                                                 patient=True)
                if not (isinstance(reply, Weights) and reply.tensors):
                    raise RejectedError("unexpected", f"a pull of a version past {had} "
                                                      "answered without weights")
                self.load(reply)
                # Changes that follow on from it are taken; the others pulled again.
                self._follow_on()
                if self._aside:
                    self._missed.set()
            # (Newer weights by reference may have come while a pull was awaited.)

    def take_shared(self) -> Weights | None:
        """The newest whole weights, if they came by reference with nothing chained on
        them and their set is not being written again yet: taken as loaded (their
        version), for a worker that computes on them where they lie (nodes.in_place,
        `InPlace.follow_set`) instead of copying them in (load_shared). None otherwise."""
        weights = self._whole
        if not self.shared_pending() or self._changes or weights is None:
            return None
        first = weights.tensors[0]
        assert isinstance(first, torch.Tensor)  # (by reference: one view a tensor)
        if SegmentCache.generation(first) != weights.generation:
            return None  # rewritten already: load_shared copies, finds it torn, and pulls
        self._whole, self._whole_shared = None, False
        self._load_buffers(weights)
        self.version = weights.version
        self.by_reference += 1
        return weights

    def give_back(self, weights: Weights) -> None:
        """The model no longer computes on `weights` where they lie (taken with
        take_shared), and its own buffers hold them no more: unless a newer version is
        waiting to be loaded, have load_shared copy them in (or pull their version, if
        their set was written again meanwhile)."""
        if self.newest() > weights.version:
            return  # loaded whole before the next compute
        self._whole, self._whole_shared, self._changes = weights, True, []
        self.by_reference -= 1  # counted again when copied
        # What the model holds now is nobody's version: the one before, so that the
        # version is loaded again (and a Pull asks for it).
        self.version = weights.version - 1

    def shared_pending(self) -> bool:
        """Whether the newest whole weights came by reference and are not loaded yet."""
        return (self._whole_shared and self._whole is not None
                and self._whole.version > self.version)

    def rebind(self, weights: tuple[torch.Tensor, ...]) -> None:
        """This shard's views of the worker's flat weights, where the model now has them
        (a colocated worker moves between weight sets: nodes.colocated_sets)."""
        self.layout.check([(t.dtype, tuple(t.shape)) for t in weights])
        self._weights = weights

    def load_latest(self) -> None:
        newer = self.latest()
        if newer is not None:
            self.load(newer)
        self.forget_loaded()  # drop the frames as soon as they are copied

    def latest(self) -> PendingVersion | None:
        """What is newer than the loaded version, if anything: for a worker that loads
        it off the loop (`load` it, then `forget_loaded` on the loop)."""
        if self.newest() <= self.version or self.shared_pending():
            return None  # (weights by reference are for load_shared, on the loop)
        whole = self._whole if self._whole is not None and self._whole.version > self.version else None
        return PendingVersion(whole, tuple(self._changes))

    def forget_loaded(self) -> None:
        """Let go of received weights that are loaded by now: their frames may be the
        sender's own memory (in-process links), which it may not reuse while we hold them."""
        if self._whole is not None and self._whole.version <= self.version:
            self._whole = None
        while self._changes and self._changes[0].version <= self.version:
            del self._changes[0]

    async def load_final(self, *, changed: bool = False) -> None:
        """Once stopped: load the weights of the version the coordinator stopped at, pulling
        them if their broadcast was missed (a stopping coordinator still answers a Pull),
        or if the worker has `changed` the loaded ones since (local optimizer steps)."""
        have = 0 if changed else self.newest()  # (version 0 is never changed: none newer)
        if have < self._liveness.coordinator_version:
            try:
                reply = await self._link.request(Pull(sender=self._owner.rank, version=have),
                                                 timeout=min(self._link.request_timeout_s, 2.0))
                if isinstance(reply, Weights) and reply.tensors:
                    self.load(reply)
            except (PeerTimeoutError, RejectedError, Stopped) as e:
                log.warning("worker %d: could not fetch the final weights of version %d from "
                            "the %s: %s", self._owner.rank, self._liveness.coordinator_version,
                            self.peer, e)
        try:
            await self.load_shared()
        except (PeerTimeoutError, RejectedError, Stopped) as e:
            log.warning("worker %d: could not load the final weights from the %s (its "
                        "model holds a torn copy of that range): %s", self._owner.rank,
                        self.peer, e)
        self.load_latest()
        if self._published_buffers and self.model_buffers is not None:
            # A forward begun on the last version before the stop came moved them on.
            self.model_buffers.load(self._published_buffers)

    # Receiving and waiting -----------------------------------------------------------------

    def newest(self) -> int:
        if self._changes:
            return self._changes[-1].version
        return max(self.version, self._whole.version if self._whole else -1)

    async def await_version(self, *, newer_than: int) -> None:
        """Wait for a version past `newer_than`, pulling it if the broadcast was missed."""
        liveness = self._liveness
        while self.newest() <= newer_than:
            if liveness.stopped:
                raise Stopped
            self._arrived.clear()
            try:
                await at_most(self._arrived.wait(), liveness.heartbeat_s * 2)
                quiet = False
            except TimeoutError:
                quiet = True
            silent = liveness.silent_s()
            if silent > liveness.timeout_s:
                raise PeerTimeoutError(self.peer, f"version {newer_than + 1}", silent)
            have = self.newest()
            # Two quiet heartbeat periods, or a heartbeat announcing a version we lack: ask.
            # A Pull for what we have is answered without tensors, so asking is cheap.
            if quiet or liveness.coordinator_version > have:
                # Patient: a coordinator that beats is there, busy (a step, a replica for its
                # standby) rather than gone; the watchdog ends the session if it goes silent.
                reply = await self._link.request(Pull(sender=self._owner.rank, version=have),
                                                 patient=True)
                if isinstance(reply, Weights) and reply.tensors:
                    self.keep_newest(reply)

    def keep_newest(self, weights: Weights, *, shared: bool = False) -> None:
        """`shared`: its tensors lie in the coordinator's shared memory (see load_shared)."""
        if weights.version > self.newest():
            self._whole, self._changes = weights, []
            self._whole_shared = shared
            self._follow_on()
            self._arrived.set()

    def take_changes(self, change: Changes | Fragment) -> None:
        """Chain Changes (or a Fragment) on if they follow on from the newest version;
        else keep them aside and have the whole version pulled (unless they are old)."""
        if change.version <= self.newest():
            return
        wrong = (changed.out_of_range(self.layout, change.tensors) if isinstance(change, Changes)
                 else None if change.fragment < len(self.fragments)
                 else f"fragment {change.fragment} of {len(self.fragments)}")
        if wrong is not None:
            log.warning("worker %d: the %s broadcast changes out of range (%s); ignored",
                        self._owner.rank, self.peer, wrong)
            return
        if change.base != self.newest():
            self._aside[change.base] = change
            while len(self._aside) > _ASIDE:
                del self._aside[min(self._aside)]
            self._missed.set()
            return
        self._changes.append(change)
        self._follow_on()
        self._arrived.set()

    def _follow_on(self) -> None:
        """Chain on what was kept aside and now follows on; let go of what is older."""
        while (change := self._aside.pop(self.newest(), None)) is not None:
            self._changes.append(change)
        for base in [b for b in self._aside if b < self.newest()]:
            del self._aside[base]

    async def resyncs(self) -> None:
        """Pull the whole version when Changes were missed (they no longer follow on)."""
        while True:
            await self._missed.wait()
            self._missed.clear()
            log.debug("worker %d missed a version after %d: pulling the whole one",
                      self._owner.rank, self.newest())
            try:
                reply = await self._link.request(Pull(sender=self._owner.rank, version=self.newest()),
                                                 patient=True)
            except (PeerTimeoutError, RejectedError) as e:
                # The watchdog ends the session if the coordinator is gone; the next
                # Changes that do not follow on ask again.
                log.warning("worker %d: could not pull the weights it missed from the %s: %s",
                            self._owner.rank, self.peer, e)
                continue
            except Stopped:
                return
            if isinstance(reply, Weights) and reply.tensors:
                self.keep_newest(reply)
            if not self._aside:  # what did not follow on while we asked does now
                self._missed.clear()
