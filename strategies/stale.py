"""Stale synchronous parallel (bounded staleness) and fully asynchronous SGD.

Every gradient is applied as it arrives, one version each. A worker's clock is the number
of its gradients taken. In ssp with staleness S, a worker whose clock is more than S ahead
of the slowest live member's is held after its push (its Push is not answered) until the
slowest catches up (Ho et al. 2013): clocks then never differ by more than S + 1, and S = 0
is lockstep. Async is the same with no bound: nobody is ever held, and a worker goes on with the newest
weights it has instead of catching up first.

Stale gradients need a remedy with the optimizers people use (SGD with momentum 0.9 diverges
at the learning rate sync takes). Both carry two:

- Momentum correction, on by default (Mitliagkas, Zhang, Hadjis and Ré, "Asynchrony begets
  momentum, with an application to deep learning", 2016): W workers pushing in turn add
  an implicit momentum of about 1 - 1/W, so the optimizer's own momentum is lowered by as
  much (`corrected_momentum`, which the coordinator applies to its optimizer), and each
  gradient is scaled by 1/W, so that W of them move the weights as sync's one average of W
  does. Chosen by measurement: benchmarks/async_remedy.py.
- The staleness-aware rate, off by default (Zhang, Gupta, Lian and Liu, IJCAI 2016): each
  gradient damped by 1 / (1 + staleness), staleness counted in versions.
"""

from __future__ import annotations

from typing import ClassVar

from tensorbus.strategies.base import (
    Apply,
    Arrived,
    Decision,
    Drop,
    DropReason,
    Event,
    Hold,
    Joined,
    Keep,
    Left,
    PushKind,
    Release,
    Rhythm,
    Stall,
    Strategy,
    Tick,
    Wait,
)

# ssp: a released worker first catches up to the version its answer names, which holds
# every update of clocks up to the slowest's: the read side of the staleness bound.
_SSP = Rhythm(push=PushKind.GRADIENT, local_steps=1, wait=Wait.ANSWERED)
_ASYNC = Rhythm(push=PushKind.GRADIENT, local_steps=1, wait=Wait.NOTHING)


class StaleSync(Strategy):
    name: ClassVar[str] = "ssp"
    options: ClassVar[frozenset[str]] = frozenset({"staleness", "staleness_lr",
                                                   "momentum_correction"})

    def __init__(
        self,
        *,
        workers: int,
        staleness: int | None = 2,
        staleness_lr: bool = False,
        momentum_correction: bool = True,
        stall_after_s: float = 30.0,
    ) -> None:
        super().__init__(workers=workers, rhythm=_SSP if staleness is not None else _ASYNC,
                         stall_after_s=stall_after_s)
        if staleness is not None and staleness < 0:
            raise ValueError(f"staleness must be at least 0, got {staleness}")
        self.staleness = staleness  # None: no bound (async)
        self.staleness_lr = staleness_lr
        self.momentum_correction = momentum_correction
        self._held: dict[int, float] = {}  # held worker -> since when
        self._stall_reported: dict[int, float] = {}

    def remedies(self) -> tuple[str, ...]:
        return tuple(name for name, on in (("momentum correction", self.momentum_correction),
                                           ("--staleness-lr", self.staleness_lr)) if on)

    def corrected_momentum(self, momentum: float) -> float:
        """The optimizer's momentum to use for `momentum` given: lowered by the implicit
        momentum of this many workers' pushes, 1 - 1/workers (see the module's docstring)."""
        if not self.momentum_correction:
            return momentum
        return max(0.0, momentum - (1.0 - 1.0 / self.workers))

    def handle(self, event: Event) -> list[Decision]:
        match event:
            case Joined(worker, _):
                return self._join(worker)
            case Left(worker, _):
                self._leave(worker)
                self._held.pop(worker, None)
                self._stall_reported.pop(worker, None)
                return self._release()
            case Arrived(worker, version, now):
                if (drop := self._early(event)) is not None:
                    return drop
                if worker in self._held:  # told to wait, pushed anyway
                    return [Drop(worker, version, DropReason.DUPLICATE)]
                self.clocks[worker] += 1
                staleness = self.version - version
                scale = 1.0 / (1 + staleness) if self.staleness_lr else 1.0
                if self.momentum_correction:
                    scale *= self._share()
                decisions: list[Decision] = [
                    Keep(worker, version), Apply(version, (worker,), scale), *self._release()
                ]
                self.version += 1
                if self._too_far(worker):
                    self._held[worker] = now
                    decisions.append(Hold(worker))
                return decisions
            case Tick(now):
                return self._stall(now)
        raise TypeError(f"not a strategy event: {event!r}")

    def holds_back(self, worker: int) -> bool:
        return worker in self._held

    def _share(self) -> float:
        """What one update counts for under momentum correction: 1/W, so that W of them move
        the weights as one average of W does."""
        return 1.0 / self.workers

    def _too_far(self, worker: int) -> bool:
        if self.staleness is None:
            return False
        slowest = min(self.clocks[m] for m in self.members)
        return self.clocks[worker] - slowest > self.staleness

    def _release(self) -> list[Decision]:
        free = tuple(sorted(w for w in self._held if w not in self.members or not self._too_far(w)))
        for w in free:
            del self._held[w]
            self._stall_reported.pop(w, None)
        return [Release(free)] if free else []

    def _stall(self, now: float) -> list[Decision]:
        if not self._held or not self.members:
            return []
        slowest = min(self.clocks[m] for m in self.members)
        behind = tuple(sorted(m for m in self.members if self.clocks[m] == slowest))
        decisions: list[Decision] = []
        for worker, since in self._held.items():
            waited = now - since
            if waited - self._stall_reported.get(worker, 0.0) >= self.stall_after_s:
                self._stall_reported[worker] = waited
                stall = Stall(self.version, behind, waited)
                if stall not in decisions:  # held since the same moment: one line says it
                    decisions.append(stall)
        return decisions


class Async(StaleSync):
    """Asynchronous SGD (Downpour-style): ssp without a bound; no worker ever waits."""

    name: ClassVar[str] = "async"
    options: ClassVar[frozenset[str]] = frozenset({"staleness_lr", "momentum_correction"})

    def __init__(self, *, workers: int, staleness_lr: bool = False,
                 momentum_correction: bool = True, stall_after_s: float = 30.0) -> None:
        super().__init__(workers=workers, staleness=None, staleness_lr=staleness_lr,
                         momentum_correction=momentum_correction, stall_after_s=stall_after_s)
