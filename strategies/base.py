"""The strategy interface: events in, decisions out, no I/O and no clock of its own.

A strategy decides what the coordinator does with each update and when workers may go on.
The coordinator feeds it events (a worker joined or left, an update arrived, time passed,
with `now` supplied by the caller) and carries out the decisions it returns. It also states
the rhythm its workers follow (`Rhythm`), which the coordinator hands each worker on join,
so that no node branches on the strategy's name.

Holding workers back is one mechanism for every model: the coordinator answers a worker's
request (its Ready, or its Push) only when the strategy releases it. The start gate (no
one trains until the configured number of workers is ready) lives here, in the base class;
ssp uses the same Hold and Release to bound clock gaps.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar


class PushKind(str, enum.Enum):
    GRADIENT = "gradient"  # workers push gradients; the coordinator owns the optimizer
    WEIGHTS = "weights"  # workers own optimizers and push weights to be averaged


class Wait(str, enum.Enum):
    """What a worker waits for once its push is answered, before it computes again."""

    NEWER = "newer"  # a version newer than the one it computed on (sync, average)
    ANSWERED = "answered"  # the version named in the answer: all updates taken before it (ssp)
    NOTHING = "nothing"  # goes on with the newest weights it has (async)
    # Computes its next local steps at once, and waits for a version newer than the one it
    # computed on only before its next push (streaming averaging)
    OVERLAPPED = "overlapped"


@dataclass(frozen=True, kw_only=True)
class Rhythm:
    """What a worker does between pushes."""

    push: PushKind
    local_steps: int = 1  # optimizer steps (or gradients) between pushes
    wait: Wait = Wait.NEWER
    # Streaming averaging: each push is one of this many fragments of the model, in turn
    # (0: the whole model); `mix` is the share of its own weights a worker keeps of a
    # fragment when that fragment's average comes back.
    fragments: int = 0
    mix: float = 0.0

    def fragment(self, version: int) -> int:
        """The fragment pushes computed on `version` carry (-1: the whole model): one after
        the other, so that each is averaged every `fragments` versions."""
        return version % self.fragments if self.fragments else -1


@dataclass(frozen=True, kw_only=True)
class OuterOptimizer:
    """SGD on the averaged change; lr 1 and no momentum is plain averaging. With `every` N
    above 1, Nesterov momentum taken every N steps, on the sum of their changes (delayed
    Nesterov: nodes.outer)."""

    lr: float
    momentum: float = 0.0
    nesterov: bool = False
    every: int = 1

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"outer_lr must be positive, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.momentum}")
        if self.nesterov and self.momentum == 0:
            raise ValueError("nesterov needs outer_momentum above 0")
        if self.every < 1:
            raise ValueError(f"momentum_every must be at least 1, got {self.every}")
        if self.every > 1 and not self.nesterov:
            raise ValueError("momentum_every delays Nesterov momentum: it needs outer_momentum")


class DropReason(str, enum.Enum):
    """Why an update was not used; counted in the summary under these names."""

    LATE = "late"  # computed on the version just built without it (a backup's late gradient)
    STALE = "stale"  # computed on a version older than that
    AHEAD = "ahead"  # claims a version the coordinator has not published
    DUPLICATE = "duplicate"  # a second update from the same worker for the same version
    EARLY = "early"  # pushed before training started (before the start gate opened)
    NOT_MEMBER = "not_member"  # the sender is not (or no longer) a training member
    NOT_FINITE = "not_finite"  # holds NaN or infinity
    OUT_OF_RANGE = "out_of_range"  # a sparse (top-k) update names elements the model lacks
    # --epochs: the worker's own passes are done, and the run's length is not known yet
    # (a shard without len() whose first pass is not over: nodes.run_length)
    PAST_EPOCHS = "past_epochs"


# Events -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Joined:
    """The worker is ready to train (it has its weights and its data)."""

    worker: int
    now: float


@dataclass(frozen=True)
class Left:
    worker: int
    now: float


@dataclass(frozen=True)
class Arrived:
    worker: int
    version: int  # the version the update was computed on
    now: float
    # Samples a second of computing behind it, as its worker measured them (0: not known):
    # what dynamic local steps are scaled by (strategies.async_average).
    speed: float = 0.0


@dataclass(frozen=True)
class Tick:
    now: float


Event = Joined | Left | Arrived | Tick


# Decisions ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Keep:
    """Hold this update; a later Apply names it."""

    worker: int
    version: int


@dataclass(frozen=True)
class Drop:
    """Discard this update, and count it under `reason`."""

    worker: int
    version: int
    reason: DropReason


@dataclass(frozen=True)
class Apply:
    """Average the kept updates of `workers` (computed on `version`), take one step, publish.

    `scale` multiplies the averaged gradient before the step (staleness damping); the new
    version is always the coordinator's version plus one.
    """

    version: int
    workers: tuple[int, ...]
    scale: float = 1.0


@dataclass(frozen=True)
class Hold:
    """Do not answer this worker's pending request (its Ready or Push) until released."""

    worker: int


@dataclass(frozen=True)
class Release:
    """Answer the held requests of these workers now: they may go on."""

    workers: tuple[int, ...]


@dataclass(frozen=True)
class Stall:
    """Version `version` has waited `waited_s` seconds for `waiting_for`; worth a log line."""

    version: int
    waiting_for: tuple[int, ...]
    waited_s: float


Decision = Keep | Drop | Apply | Hold | Release | Stall


class Strategy(ABC):
    """A consistency model. Subclasses are small: state, `handle`, and their rhythm.

    The base class keeps what every model needs: the live members, their clocks (updates
    counted per member) and the start gate. `options` names the keyword arguments a
    subclass takes beyond `workers`, so that launchers can tell a user which flag belongs
    to which strategy without knowing any of them.
    """

    name: ClassVar[str]
    options: ClassVar[frozenset[str]] = frozenset()
    outer: OuterOptimizer | None = None  # for weight pushes: None averages plainly
    # Weight pushes that are changes since the version loaded, quantized (async-average).
    changes_pushed: ClassVar[bool] = False

    def __init__(self, *, workers: int, rhythm: Rhythm, stall_after_s: float = 30.0) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        if not stall_after_s > 0:  # also refuses NaN
            raise ValueError(f"stall_after_s must be positive, got {stall_after_s}")
        self.workers = workers  # how many the run starts with
        # How many must be ready before anyone trains: `workers`, unless the run went on
        # smaller before a standby took it over (`open_gate_at`).
        self.gate = workers
        self.rhythm = rhythm
        self.stall_after_s = stall_after_s
        self.version = 0  # updates applied so far, as the coordinator counts them
        self.members: set[int] = set()
        self.clocks: dict[int, int] = {}  # member -> updates it has pushed since it joined
        self.started = False  # the start gate has opened
        self._gated: list[int] = []  # members held at the start gate, in arrival order

    @abstractmethod
    def handle(self, event: Event) -> list[Decision]:
        """Take one event, return what the coordinator must do, in order."""

    def corrected_momentum(self, momentum: float) -> float:
        """The momentum the coordinator's optimizer should use where the SPEC asks for
        `momentum`: as asked, unless stale updates add momentum of their own (stale.py)."""
        return momentum

    def remedies(self) -> tuple[str, ...] | None:
        """The remedies for stale updates that are on, for an error to name; None: this
        strategy has no stale updates."""
        return None

    def state(self) -> dict[str, int]:
        """What a checkpoint keeps of this strategy: its version, and how many members it
        had. Members, clocks and held updates are not kept: after a restart, workers join
        again (level with each other) and compute anew on the restored version."""
        return {"version": self.version, "members": len(self.members)}

    def restore(self, state: dict[str, int]) -> None:
        """Go on from a checkpoint's `state()`. Called on a fresh strategy, whose start gate
        is closed: the restarted run waits for `workers` to be ready as a new one does."""
        self.version = state["version"]

    def open_gate_at(self, members: int) -> None:
        """Let training start once `members` are ready (at least one, at most `workers`):
        a standby that takes over a run that had gone on smaller waits for those alone."""
        self.gate = max(1, min(self.workers, members))

    def clock_gap(self) -> int:
        """The largest difference between two live members' clocks."""
        live = [self.clocks[m] for m in self.members]
        return max(live) - min(live) if live else 0

    def holds_back(self, worker: int) -> bool:
        """Whether `worker`'s answer is being held back now (ssp's bound)."""
        return False

    def local_steps(self, worker: int) -> int | None:
        """The local steps `worker` is to take before its next push, said in the answer to
        its push, where they are its own (async-average's dynamic local steps); None: the
        rhythm's, for every worker."""
        return None

    def quorum(self) -> int | None:
        """How many updates the next step averages, where that is known before they come
        (a coordinator then folds them in as they come: nodes.fold); None where it is not."""
        return None

    # For subclasses ------------------------------------------------------------------------

    def _join(self, worker: int) -> list[Decision]:
        """Count a member in; hold it at the start gate, or open the gate for everyone."""
        if worker in self.members:
            return []
        # A late joiner starts level with the slowest, so that it holds nobody back.
        self.clocks[worker] = min((self.clocks[m] for m in self.members), default=0)
        self.members.add(worker)
        if self.started:
            return []
        self._gated.append(worker)
        if len(self.members) < self.gate:
            return [Hold(worker)]
        self.started = True
        gated, self._gated = tuple(w for w in self._gated if w in self.members), []
        return [Release(gated)]

    def _leave(self, worker: int) -> None:
        self.members.discard(worker)
        self.clocks.pop(worker, None)
        if worker in self._gated:  # its Ready will not be answered: it may come back anew
            self._gated.remove(worker)

    def _early(self, event: Arrived) -> list[Decision] | None:
        """The drop for an update that no model may take, or None if it may be looked at."""
        if event.worker not in self.members:
            return [Drop(event.worker, event.version, DropReason.NOT_MEMBER)]
        if not self.started:
            return [Drop(event.worker, event.version, DropReason.EARLY)]
        if event.version > self.version:
            return [Drop(event.worker, event.version, DropReason.AHEAD)]
        return None
