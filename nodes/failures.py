"""Why a run failed: one exception class a cause, with the facts as fields.

A coordinator that cannot go on ends the run with one of these (`Coordinator.run` raises
it); its `str()` is the one line the command prints, said from the fields, so that tests
assert the fields and the wording lives here alone. Each class's `examples()` are the
instances docs/errors.md shows (tests/unit/test_failures.py keeps the two in step).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


class TrainingError(Exception):
    """The run cannot go on; the message says why and what was waited for."""

    def __init__(self, message: str = "") -> None:
        super().__init__(message or self.describe())

    def describe(self) -> str:
        return ""


def _listed(ranks: Sequence[int]) -> str:
    """0 / 0 and 1 / 0, 1 and 2."""
    words = [str(r) for r in ranks]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"


@dataclass(eq=False)
class Diverged(TrainingError):
    """`ranks`' last `window` updates were not finite (NaN or inf), and no version can come
    of the rest: the others (`waiting`) wait on them, or there are none."""

    ranks: tuple[int, ...]
    window: int
    version: int | None  # None: before any step, on the initial weights
    waiting: tuple[int, ...] = ()
    lr: str = "--lr"  # what sets the learning rate: --lr, or the SPEC's optimizer()
    # async and ssp: the stale-update remedies on ("momentum correction", "--staleness-lr");
    # None: a strategy without stale updates (sync, average)
    remedies: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        TrainingError.__init__(self)

    @classmethod
    def examples(cls) -> tuple[Diverged, ...]:
        return (cls(ranks=(1,), window=8, version=None, waiting=(0, 2)),
                cls(ranks=(0, 1), window=8, version=None),
                cls(ranks=(0, 1), window=8, version=1),
                cls(ranks=(0, 1), window=8, version=40, lr="the lr of the SPEC's optimizer()",
                    remedies=()),
                cls(ranks=(0, 1), window=8, version=40, remedies=("momentum correction",)))

    def _lower(self) -> str:
        """What to change: the lr where it is set, and for stale updates the remedies."""
        if self.remedies is None:
            return f"lower {self.lr}"
        on = f"with {' and '.join(self.remedies)} on" if self.remedies else "with no remedy on"
        return (f"lower {self.lr} ({on}: the stale-update remedies are momentum correction, "
                "the default, and --staleness-lr)")

    def describe(self) -> str:
        started = self.version is not None
        which = "last" if started else "first"
        where = f"at version {self.version}" if started else "on the initial weights, before any step"
        if self.waiting:
            ones, others = len(self.ranks) > 1, len(self.waiting) > 1
            return (f"the {which} {self.window} updates of worker{'s' * ones} "
                    f"{_listed(self.ranks)} were not finite (NaN or inf), {where}, while worker"
                    f"{'s' * others} {_listed(self.waiting)} wait{'' if others else 's'} for "
                    f"{'them' if ones else 'it'} with finite ones: the SPEC's data() for "
                    f"{'those ranks' if ones else 'that rank'} (or the model or loss on its "
                    "batches) gives them: check it on one batch"
                    + (f"; or training is diverging: {self._lower()}" if started else ""))
        if not started:  # no step taken: the lr is not the cause
            return (f"every worker's first {self.window} updates were not finite (NaN or inf), "
                    "on the initial weights, before any step: the SPEC's model(), loss() or "
                    "data() gives them: check them on one batch")
        return (f"training diverged: every worker's last {self.window} updates were not finite "
                f"(NaN or inf), at version {self.version}: {self._lower()}, or use a larger "
                "--batch-size")


@dataclass(eq=False)
class TooFewWorkers(TrainingError):
    """Fewer than `minimum` workers are left (`live`), at `version`."""

    live: int
    minimum: int
    version: int
    why: str = "the others left or went silent"  # their errors, where they said any
    lost: tuple[str, ...] = ()  # each lost worker: "RANK (at version V, PHASE)"

    def __post_init__(self) -> None:
        TrainingError.__init__(self)

    @classmethod
    def examples(cls) -> tuple[TooFewWorkers, ...]:
        return (cls(live=2, minimum=3, version=8, lost=("2 (at version 6, computing)",)),)

    def describe(self) -> str:
        left = (f"no worker is left at version {self.version}" if not self.live else
                f"{self.live} worker(s) left at version {self.version}, fewer than the "
                f"minimum of {self.minimum}")
        return f"{left}: {self.why}" + (f"; lost: {', '.join(self.lost)}" if self.lost else "")


@dataclass(eq=False)
class JoinTimedOut(TrainingError):
    """Only `joined` of `wanted` workers joined within `waited_s`."""

    joined: int
    wanted: int
    waited_s: float
    endpoint: str
    lost_early: tuple[int, ...] = ()  # ranks that joined and were lost before training
    refused: int = 0  # connections refused for their keys

    def __post_init__(self) -> None:
        TrainingError.__init__(self)

    @classmethod
    def examples(cls) -> tuple[JoinTimedOut, ...]:
        return (cls(joined=0, wanted=2, waited_s=1.0, endpoint="tcp://127.0.0.1:5555"),
                cls(joined=0, wanted=1, waited_s=6.0, endpoint="tcp://0.0.0.0:5555", refused=1))

    def describe(self) -> str:
        gone = (f"; {len(self.lost_early)} joined and were lost before training began (ranks "
                f"{', '.join(map(str, self.lost_early))})" if self.lost_early else "")
        if self.refused:
            gone += (f"; {self.refused} connection(s) were refused for their keys: start "
                     "workers with --keys DIR and a key pair in DIR/authorized")
        return (f"only {self.joined} of {self.wanted} workers joined within "
                f"{self.waited_s:.0f} s{gone}: are they started, and pointed at "
                f"{self.endpoint}? (--join-timeout waits longer)")


@dataclass(eq=False)
class NoVersionMade(TrainingError):
    """Every worker joined, and no version was made within `waited_s`."""

    waited_s: float
    dropped: Mapping[str, int] = field(default_factory=dict)  # pushes dropped, by reason

    def __post_init__(self) -> None:
        TrainingError.__init__(self)

    @classmethod
    def examples(cls) -> tuple[NoVersionMade, ...]:
        return (cls(waited_s=3.0),)

    def describe(self) -> str:
        dropped = ", ".join(f"{n} {why}" for why, n in self.dropped.items() if n)
        return (f"every worker joined, but no version was made within {self.waited_s:.0f} s: "
                + (f"their pushes were dropped ({dropped})" if dropped else
                   "no push came (still loading data? --join-timeout waits longer)"))


@dataclass(eq=False)
class SteppedDown(TrainingError):
    """A standby took the run over (`term`) while this coordinator lived on apart from it
    (a network partition, say): this one steps down and its workers move to `endpoint`.
    Said by that standby, or (`by`) by a worker that had been its: a message of the newer
    term."""

    endpoint: str  # where the run goes on ("": not known here; the workers stop)
    term: int
    version: int  # this coordinator's, as it steps down
    by: str = ""  # who spoke for the newer term, where not the standby ("worker 3")

    def __post_init__(self) -> None:
        TrainingError.__init__(self)

    @classmethod
    def examples(cls) -> tuple[SteppedDown, ...]:
        return (cls(endpoint="tcp://10.0.0.2:5555", term=1, version=412),
                cls(endpoint="tcp://10.0.0.2:5555", term=1, version=412, by="worker 3"))

    def describe(self) -> str:
        if not self.by:
            return (f"stepped down at version {self.version}: the standby at {self.endpoint} "
                    f"took the run over (term {self.term}) while this coordinator was cut off "
                    "from it; the workers move there, and the run goes on at that coordinator")
        where = (f"the workers move to the standby at {self.endpoint}" if self.endpoint else
                 "the workers stop (this coordinator knows no standby to send them to)")
        return (f"stepped down at version {self.version}: {self.by} spoke for term {self.term}, "
                "a coordinator that took the run over while this one was cut off from it; "
                f"{where}")


FAILURES: tuple[type[TrainingError], ...] = (Diverged, TooFewWorkers, JoinTimedOut, NoVersionMade,
                                             SteppedDown)
