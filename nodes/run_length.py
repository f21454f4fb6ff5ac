"""How long a run is, and how far it has got: `--steps` versions, or `--epochs` passes of
samples over every worker's shard; and where each rank's data has got to (its position,
in batches of its shard: where a restarted run's worker goes on from).

An epoch is a pass of samples, not of versions: under async a version is one worker's
batch, under sync every worker's. Its size is the sum of the shards' lengths (in batches,
as each worker says in its Ready, or with its push once its first pass ends where data()
has no len()) times the batch size, fixed once known. The target in samples is fixed when
training starts, or once every length is known.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from tensorbus.nodes.failures import TrainingError

log = logging.getLogger("tensorbus.coordinator")

RELAY = -2  # a member's batches when it is a relay: its workers' data is theirs


class RunLength:
    def __init__(self, *, steps: int | None, epochs: int | None, batch_size: int,
                 version: Callable[[], int], samples: Callable[[], int],
                 ready: Callable[[], list[int]]) -> None:
        """`version`, `samples`: the run's newest version and samples applied so far;
        `ready`: the shard lengths of the workers ready, in batches (-1: not known yet)."""
        self._version = version
        self._samples = samples
        self._ready = ready
        self.steps = steps  # the target in versions, if given so
        self.epochs = epochs
        self.batch_size = batch_size
        self.target_samples: int | None = None  # from --epochs, once fixed
        self._epoch_samples: int | None = None  # samples in a pass over every shard
        self.positions: dict[int, int] = {}  # rank -> batches of its shard used so far

    def used(self, rank: int, batches: int) -> None:
        """A push of `rank`'s standing for `batches` was applied or dropped: those batches
        of its shard are used. (Not before: a push held for the next version when a
        checkpoint is written is not in it, and its worker computes it again after a
        resume, as it would have been.)"""
        self.positions[rank] = self.positions.get(rank, 0) + batches

    def past_its_epochs(self, rank: int, batches: int) -> bool:
        """Under --epochs, while the run's length is not known yet (a shard without len()
        whose first pass is not over): whether `rank`, whose shard has `batches`, has had
        --epochs passes of it used. Its updates are dropped then, until the length is
        known: under async a worker far ahead would otherwise take the run past it."""
        if self.known or batches < 1:
            return False
        assert self.epochs is not None
        return self.positions.get(rank, 0) >= self.epochs * batches

    def samples_per_epoch(self, batches: Sequence[int]) -> int | None:
        """Samples in one pass over the shards of `batches` (the ready workers'), fixed once
        known; None while a shard's length is not known, or never is (a relay's)."""
        if self._epoch_samples is None:
            if not batches or min(batches) < 1:
                return None
            self._epoch_samples = sum(batches) * self.batch_size
        return self._epoch_samples

    def epochs_done(self) -> int | None:
        """Passes of samples over every worker's shard so far (None: not known yet)."""
        per_epoch = self.samples_per_epoch(self._ready())
        return None if per_epoch is None else self._samples() // per_epoch

    @property
    def known(self) -> bool:
        """Whether the run's length is known (always, under --steps)."""
        return (self.steps is not None or self.target_samples is not None
                or self.epochs is None)  # (neither: until its workers leave)

    def fix_target(self) -> bool:
        """Under --epochs, fix the target in samples if the shards' lengths are known;
        whether it was fixed now."""
        if self.known:
            return False
        batches = self._ready()
        assert self.epochs is not None  # config guarantees steps or epochs
        if not batches or min(batches) == RELAY:
            raise TrainingError(
                "--epochs counts passes over every member's batches, and a relay never says "
                "how many its workers have (their data is theirs): use --steps")
        per_epoch = self.samples_per_epoch(batches)
        if per_epoch is None:
            return False
        self.target_samples = self.epochs * per_epoch
        log.info("%d epoch(s) over %d workers' %d batches: %d samples",
                 self.epochs, len(batches), sum(batches), self.target_samples)
        return True

    def done_share(self) -> float | None:
        """The share of the run done, 0..1 (None: not known yet)."""
        if self.steps is not None:
            return self._version() / self.steps
        if self.target_samples is not None:
            return self._samples() / self.target_samples
        return None

    @property
    def reached_target(self) -> bool:
        done = self.done_share()
        return done is not None and done >= 1.0

    def progress_words(self) -> str:
        """What the run has reached, in the terms of its target."""
        return f"version {self._version()}" if self.steps is not None else f"{self._samples()} samples"
