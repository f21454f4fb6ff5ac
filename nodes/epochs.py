"""A worker's data: its rank's shard of the SPEC's data(), read epoch after epoch.

`RankData` keeps a rank's batches across sessions and makes them anew only where a
Welcome names another shard or another position (a rejoin on another rank, or a
coordinator restarted from a checkpoint, whose records rewind the data with the weights).
`Epochs` reads the batches, checked for shape, a new iter() an epoch. `seed_generators`
makes a run's shuffles and dropout masks the same from run to run.
"""

from __future__ import annotations

import asyncio
import functools
import random
from collections.abc import Callable, Iterable, Iterator, Sized
from typing import Any

import numpy
import torch

from tensorbus.bus.messages import Welcome
from tensorbus.nodes.compute import OffLoop, iter_on_loop

Data = Callable[[int, int, int], Iterable[Any]]


class DataError(Exception):
    """The SPEC's data() failed or yielded something unusable; the message says what."""


def seed_generators(seed: int, rank: int) -> None:
    """Seed torch's, numpy's and random's generators from (seed, rank), so that a run's
    dropout masks and shuffles are the same from run to run (each rank's its own)."""
    derived = int(numpy.random.SeedSequence([seed, rank]).generate_state(1, numpy.uint64)[0])
    torch.manual_seed(derived)
    numpy.random.seed(derived % 2**32)
    random.seed(derived)


def describe(rank: int, welcome: Welcome) -> str:
    """The data() call a rank makes, as errors name it."""
    return f"data(rank={rank}, world_size={welcome.world_size}, batch_size={welcome.batch_size})"


class RankData:
    """One rank's batches, on the worker's device, kept across sessions."""

    def __init__(self, data: Data, device: torch.device) -> None:
        self._data = data
        self._device = device
        self.epochs: Epochs | None = None
        self.unused = 0  # samples an epoch leaves out, as its data says (Ready.unused)
        self._shard: tuple[int, int, int] | None = None  # (rank, world size, batch size)

    def current(self, rank: int, welcome: Welcome) -> bool:
        """Whether the batches kept go on where the Welcome says this rank's data is."""
        return (self.epochs is not None
                and self._shard == (rank, welcome.world_size, welcome.batch_size)
                and self.epochs.position == welcome.position)

    async def load(self, rank: int, welcome: Welcome, off_loop: OffLoop) -> None:
        """Call data() for the Welcome's shard (in a thread: it may read files for long)
        and skip to the Welcome's position."""
        seed_generators(welcome.seed, rank)  # before data(), which may shuffle
        shards = await off_loop(self._call, rank, welcome)
        unused = getattr(shards, "unused", 0)
        self.unused = unused if isinstance(unused, int) and unused > 0 else 0
        self.epochs = Epochs(shards, describe(rank, welcome),
                             anew=iter_on_loop(asyncio.get_running_loop()),
                             again=functools.partial(self._call, rank, welcome))
        await off_loop(self.epochs.skip, welcome.position)
        self._shard = (rank, welcome.world_size, welcome.batch_size)

    def _call(self, rank: int, welcome: Welcome) -> Iterable[Any]:
        try:
            return self._data(rank, welcome.world_size, welcome.batch_size)
        except Exception as e:
            raise DataError(f"{describe(rank, welcome)} raised {type(e).__name__}: {e}") from e

    @property
    def length(self) -> int:
        """Batches an epoch, -1 while unknown (a shard without len(), in its first pass)."""
        assert self.epochs is not None
        return self.epochs.length

    def passed(self, length: int) -> None:
        """A batch of this shard was used elsewhere (a pipeline's first stage draws the
        batches its other stages work on): counted as taken, not read; `length`: the
        shard's batches an epoch as the drawer knows them (-1: not yet), learnt here where
        this shard's is not known (a data() without len(), never read here)."""
        assert self.epochs is not None
        self.epochs.position += 1
        if self.epochs.length < 0 < length:
            self.epochs.length = length

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next batch, moved to the device (on the compute thread)."""
        assert self.epochs is not None
        inputs, targets = self.epochs.next()
        if self._device.type != "cpu":
            inputs = inputs.to(self._device, non_blocking=True)
            targets = targets.to(self._device, non_blocking=True)
        return inputs, targets


class Epochs:
    """Batches of this rank's shard, epoch after epoch, checked for shape.

    Each epoch is a new iter() of what data() returned (made by `anew`: see
    nodes.compute.iter_on_loop), or, where that was an iterator read only once (a
    generator), of what data() returns when called again (`again`). A shard without len()
    learns its length when its first pass ends: the batch after the last is read ahead,
    so that the push of the last one says it.
    """

    def __init__(self, shards: Iterable[Any], described: str,
                 anew: Callable[[Iterable[Any]], Iterator[Any]] = iter,
                 again: Callable[[], Iterable[Any]] | None = None) -> None:
        self._shards = shards
        self._described = described
        self._anew = anew
        self._again = again
        self._once = isinstance(shards, Iterator)  # read once: a generator, say
        self._it = self._begin(shards)
        self._taken = False  # whether a pass has yielded a batch yet
        self.length = len(shards) if isinstance(shards, Sized) else -1  # -1: unknown yet
        self.position = 0  # batches taken since the first
        self._in_pass = 0  # batches taken of the pass under way
        self._ahead: tuple[torch.Tensor, torch.Tensor] | None = None  # read ahead, not taken

    def _begin(self, shards: Iterable[Any]) -> Iterator[Any]:
        try:
            return self._anew(shards)
        except TypeError:
            raise DataError(f"{self._described} returned {type(shards).__name__}, not an iterable "
                            "of (input, target) batches: return a list of them, or a DataLoader"
                            ) from None

    def skip(self, batches: int) -> None:
        """Move `batches` on from the start: where a restarted run left this shard. Whole
        epochs of a sized shard are skipped by starting the next one (each iter() of a
        SPEC's data may be a new epoch order) without reading their batches."""
        if self.length > 0 and not self._once:
            for _ in range(batches // self.length):
                self._it = self._anew(self._shards)
            self.position = batches - batches % self.length
        while self.position < batches:
            self.next()

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self._ahead if self._ahead is not None else self._read()
        assert batch is not None  # (only a read `or_end` gives None)
        self._ahead = None
        self.position += 1
        self._in_pass += 1
        if self.length < 0:  # read ahead: is this the last batch of its pass?
            self._ahead = self._read(or_end=True)
            if self._ahead is None:  # it is: the pass's length is known now
                self.length = self._in_pass
        return batch

    def _read(self, *, or_end: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The next batch, the next pass begun if this one is over; with `or_end`, None
        where this pass is over (the next one is begun when its first batch is read)."""
        try:
            try:
                batch = next(self._it)
            except StopIteration:
                if or_end:
                    return None
                self._new_pass()
                batch = next(self._it)
        except StopIteration:
            if self._taken:  # its first pass had batches, and the next none
                raise DataError(
                    f"{self._described} yielded no batches on its second pass: a generator "
                    "or an iterator is read only once, and each epoch reads the data again: "
                    "return something that iterates anew (a list, a DataLoader, or a class "
                    "with __iter__), or make data() a generator function") from None
            raise DataError(f"{self._described} yielded no batches: every rank needs at least "
                            "one; use fewer workers, a smaller --batch-size, or more data") from None
        except DataError:
            raise
        except Exception as e:
            raise DataError(f"iterating {self._described} raised {type(e).__name__}: {e}") from e
        self._taken = True
        if not (isinstance(batch, tuple | list) and len(batch) == 2
                and all(isinstance(t, torch.Tensor) for t in batch)):
            raise DataError(f"{self._described} must yield (input, target) tensor pairs, "
                            f"got {type(batch).__name__}")
        return batch[0], batch[1]

    def _new_pass(self) -> None:
        """Begin the next epoch: a new iter() of the shard, or of what data() returns when
        called again, where the shard was an iterator that is read once."""
        if self.length < 0:
            self.length = self._in_pass
        self._in_pass = 0
        if self._once and self._again is not None:
            self._shards = self._again()
        self._it = self._begin(self._shards)
