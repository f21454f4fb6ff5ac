"""Where a coordinator's run is, and how it ends: one state machine for stops and failures.

    STARTING --first version--> TRAINING --end reached, stop asked, failure--> STOPPING
    STOPPING --every worker left, or the stop timeout--> STOPPED (run() returns or raises)

A stop is asked for (a signal, a launcher: `ask`), now or at a version (shards that must
end together); the run's end is reached (`--steps`, `--epochs`); or the run fails
(`fail`), which a stop then says to every worker and `run()` raises. This part decides
and remembers; the coordinator does the sending (its `_stop`).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable

from tensorbus.bus.clock import Clock
from tensorbus.bus.messages import Stop
from tensorbus.nodes.failures import SteppedDown, TrainingError
from tensorbus.nodes.metrics import Metrics

log = logging.getLogger("tensorbus.coordinator")


class State(str, enum.Enum):
    STARTING = "starting"  # waiting for the first workers
    TRAINING = "training"
    STOPPING = "stopping"  # target reached or failed: telling workers to leave
    STOPPED = "stopped"


class Ending:
    def __init__(self, *, clock: Clock, stop_timeout_s: float, metrics: Metrics) -> None:
        self.state = State.STARTING
        self._clock = clock
        self._stop_timeout_s = stop_timeout_s
        self._metrics = metrics
        self.done: asyncio.Future[None] | None = None  # run()'s: set once STOPPED
        self.deadline = 0.0  # when STOPPING gives up on workers that have not left
        self.requested: str | None = None  # why a stop was asked for
        self.quiet = False  # the asked stop is the run's normal end (said at info level)
        self.at_version: int | None = None  # the version an asked stop waits for
        self._timer: asyncio.TimerHandle | None = None  # stops anyway if it never comes
        self.failure: TrainingError | None = None  # raised by run() once workers are told

    def begin(self) -> asyncio.Future[None]:
        self.done = asyncio.get_running_loop().create_future()
        return self.done

    @property
    def running(self) -> bool:
        """Whether run() is under way and not over."""
        return self.done is not None and not self.done.done()

    @property
    def stopping(self) -> bool:
        return self.state in (State.STOPPING, State.STOPPED)

    def enter(self, state: State, why: str) -> None:
        log.info("%s -> %s: %s", self.state.value, state.value, why)
        self.state = state
        if state is State.STOPPING:
            self.deadline = self._clock.monotonic() + self._stop_timeout_s
            if self._timer is not None:  # stopping anyway: no later stop to begin
                self._timer.cancel()
            self._metrics.training_ended()
        if state is State.STOPPED and self.running:
            assert self.done is not None
            self.done.set_result(None)

    def ask(self, why: str, *, version: int, at_version: int | None, quiet: bool,
            stop: Callable[[str], None]) -> None:
        """A stop asked for (see Coordinator.request_stop): `stop(why)` now, or once
        `at_version` is reached (`stop_due`), or after the stop timeout if it never is."""
        if self.requested is not None or not self.running:
            return
        self.requested, self.quiet = why, quiet
        if not quiet:
            self._metrics.stopped_by = why
        if at_version is not None and at_version > version:
            log.warning("stop requested (%s): training on to version %d, then stopping",
                        why, at_version)
            self.at_version = at_version
            self._timer = asyncio.get_running_loop().call_later(
                self._stop_timeout_s, self._now, why, stop)
            return
        self._now(why, stop)

    def stop_words(self, why: str) -> str:
        """How an asked stop ends the run (the summary's `ended`): a stop that is the run's
        normal end (`quiet`: a relay whose root stopped) as it is, another as asked."""
        return why if self.quiet else f"stop requested: {why}"

    def _now(self, why: str, stop: Callable[[str], None]) -> None:
        self.at_version = None
        log.log(logging.INFO if self.quiet else logging.WARNING, "stop requested (%s): %s", why,
                "finishing the update in flight" if self._metrics.trained_from is not None
                else "stopping before training began")
        stop(why)

    def stop_due(self, version: int) -> bool:
        """Whether `version` is the one an asked stop waited for (it stops now, then)."""
        if self.at_version is None or version < self.at_version:
            return False
        self.at_version = None
        if self._timer is not None:
            self._timer.cancel()
        return True

    def fail(self, why: str | TrainingError) -> None:
        """The run fails, for `why`: the stop that follows says so (`answer`), and run()
        raises it."""
        log.info("failing: %s", why)
        self.failure = why if isinstance(why, TrainingError) else TrainingError(why)

    def answer(self, request: int, version: int) -> Stop:
        """What a request is answered with once stopping (and what the stop broadcast
        says, as request 0): a failure said, so that a worker whose answer comes first
        knows it too."""
        if isinstance(self.failure, SteppedDown) and self.failure.endpoint:  # it goes on there
            return Stop(request=request, version=version, reason="moved", detail=self.failure.endpoint)
        if self.failure is not None:
            return Stop(request=request, version=version, reason="error", detail=str(self.failure))
        return Stop(request=request, version=version)
