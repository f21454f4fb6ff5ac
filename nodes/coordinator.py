"""The coordinator as a parameter server: master weights, optimizer, versions, membership.

It binds a ROUTER (requests) and a PUB (new versions, heartbeats, stop), feeds its strategy
the events it sees and carries out the decisions it gets back. Two tasks run on one loop:
`_receive` takes every request in arrival order, `_tick` publishes heartbeats, removes
silent workers, and notices the end of a phase. Optimizer steps run in a thread so that the
loop keeps publishing heartbeats meanwhile.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from bus.buffers import SendBuffers, Tracker
from bus.codec import decode, encode
from bus.errors import WireError
from bus.messages import (
    Ack,
    Heartbeat,
    Join,
    Leave,
    Message,
    Pull,
    Push,
    Ready,
    Reject,
    RejectCode,
    Stop,
    Weights,
    Welcome,
)
from bus.transport import ZmqServer
from nodes.config import CoordinatorConfig
from nodes.flat import FlatModel
from nodes.membership import Member, Membership
from nodes.metrics import Metrics
from strategies.base import Apply, Arrived, Decision, Drop, DropReason, Joined, Keep, Left, Stall
from strategies.base import Strategy, Tick

log = logging.getLogger("tensorbus.coordinator")

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
Evaluate = Callable[[nn.Module], dict[str, float]]


class State(str, enum.Enum):
    STARTING = "starting"  # waiting for the first workers
    TRAINING = "training"
    STOPPING = "stopping"  # target reached or failed: telling workers to leave
    STOPPED = "stopped"


class TrainingError(Exception):
    """The run cannot go on; the message says why and what was waited for."""


@dataclass(frozen=True)
class Progress:
    version: int
    target: int | None
    loss: float
    samples: int
    wall_s: float


@dataclass
class _Held:
    tensors: tuple[torch.Tensor, ...]  # views into received frames; they keep the frames alive
    loss: float
    samples: int


@dataclass
class _Snapshot:
    """The published copy of one version; Welcome and Pull replies send it too."""

    version: int
    buffers: tuple[torch.Tensor, ...]
    trackers: list[Tracker | None] = field(default_factory=list)


class Coordinator:
    def __init__(
        self,
        *,
        model: nn.Module,
        strategy: Strategy,
        config: CoordinatorConfig,
        optimizer: OptimizerFactory | None = None,
        lr: float = 0.01,
        evaluate: Evaluate | None = None,
        on_step: Callable[[Progress], None] | None = None,
    ) -> None:
        self.model = model
        self.strategy = strategy
        self.config = config
        self.flat = FlatModel(model)
        make = optimizer or (lambda params: torch.optim.SGD(params, lr=lr))
        self.optimizer = make(model.parameters())
        self.version = 0
        self.state = State.STARTING
        self._evaluate = evaluate
        self._on_step = on_step
        self._members = Membership(strategy.workers)
        self._held: dict[int, _Held] = {}
        self._target = config.steps
        self._pool = SendBuffers(self.flat.layout.allocate)
        self._snapshot: _Snapshot | None = None
        self._max_bytes = self.flat.layout.nbytes + 65536
        self._server: ZmqServer | None = None
        self._done: asyncio.Future[None] | None = None
        self._started_at = 0.0
        self._stop_deadline = 0.0
        self._errors: list[str] = []  # why workers left with an error, for the final message
        self.metrics = Metrics(config.metrics, strategy=strategy.name, workers=strategy.workers)

    @property
    def endpoint(self) -> str:
        if self._server is None:
            raise RuntimeError("the coordinator is not bound yet: call bind() or run()")
        return self._server.endpoint

    def bind(self) -> str:
        """Bind the sockets now (so that the endpoint is known); `run` binds if not done."""
        if self._server is None:
            self._server = ZmqServer(
                self.config.bind, max_message_bytes=self._max_bytes, pub_port=self.config.pub_port
            )
            log.info("listening on %s (broadcasts on port %d)", self.endpoint, self._server.pub_port)
        return self.endpoint

    async def run(self) -> dict[str, Any]:
        """Train until the target version, then stop the workers and return the summary."""
        self.bind()
        self._done = asyncio.get_running_loop().create_future()
        self._started_at = time.monotonic()
        await self._publish()
        tasks = [asyncio.create_task(self._guard(c)) for c in (self._receive(), self._tick())]
        try:
            await self._done
        except BaseException:
            self.metrics.close()
            raise
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            assert self._server is not None
            self._server.close()
        try:
            evaluation = self._evaluate(self.model) if self._evaluate else {}
        except Exception as e:
            self.metrics.close()
            raise TrainingError(f"evaluate() raised {type(e).__name__}: {e}") from e
        summary = self.metrics.summary(evaluation)
        self.metrics.close(summary)
        return summary

    async def _guard(self, coroutine: Any) -> None:
        try:
            await coroutine
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self.metrics.close()
            if self._done is not None and not self._done.done():
                self._done.set_exception(e)

    def _enter(self, state: State, why: str) -> None:
        log.info("%s -> %s: %s", self.state.value, state.value, why)
        self.state = state
        if state is State.STOPPING:
            self._stop_deadline = time.monotonic() + self.config.stop_timeout_s
        if state is State.STOPPED and self._done is not None and not self._done.done():
            self._done.set_result(None)

    # Receiving ---------------------------------------------------------------------------

    async def _receive(self) -> None:
        assert self._server is not None
        while True:
            peer, frames = await self._server.recv()
            try:
                message = decode(frames, max_bytes=self._max_bytes, layout=self.flat.layout)
            except WireError as e:
                self.metrics.rejected[e.code.value] += 1
                log.warning("rejected a message from %s: %s", self._name(peer), e)
                await self._reply(peer, Reject(request=e.request, code=e.code.value, detail=str(e)))
                continue
            await self._dispatch(peer, message)

    async def _dispatch(self, peer: bytes, message: Message) -> None:
        now = time.monotonic()
        if isinstance(message, Join):
            await self._join(peer, message, now)
            return
        member = self._members.get(peer)
        if member is None or member.rank != message.sender:
            if not isinstance(message, Heartbeat | Leave):
                await self._refuse(peer, message, RejectCode.UNKNOWN_WORKER, "join first")
            return
        member.last_seen = now
        if self.state is State.STOPPING and not isinstance(message, Leave | Heartbeat):
            await self._reply(peer, Stop(request=message.request, version=self.version))
            return
        match message:
            case Heartbeat(phase=phase, clock=clock, version=version):
                # A beat sent just before a push may arrive after it: never move backwards.
                member.phase = phase
                member.clock = max(member.clock, clock)
                member.version = max(member.version, version)
            case Ready(batches=batches):
                member.ready, member.batches = True, batches
                await self._reply(peer, Ack(request=message.request, version=self.version))
                await self._carry_out(self.strategy.handle(Joined(member.rank, now)))
            case Push():
                await self._push(peer, member, message, now)
            case Pull(version=have):
                if self._snapshot is not None and have >= self._snapshot.version:
                    # Nothing newer: say so without resending the model.
                    await self._reply(peer, Weights(request=message.request, version=self.version))
                else:
                    await self._send_weights(peer, Weights(request=message.request))
            case Leave(reason=reason, detail=detail):
                await self._reply(peer, Ack(request=message.request, version=self.version))
                self._depart(member, f"left ({reason}{': ' + detail if detail else ''})")
                if reason == "error":
                    self._errors.append(f"worker {member.rank}: {detail}")
                await self._carry_out(self.strategy.handle(Left(member.rank, now)))
            case _:
                await self._refuse(peer, message, RejectCode.UNEXPECTED, "not taken here")

    async def _join(self, peer: bytes, message: Join, now: float) -> None:
        if self.state is State.STOPPING:
            await self._reply(peer, Stop(request=message.request, version=self.version))
            return
        if message.layout != self.flat.layout.digest:
            await self._refuse(
                peer, message, RejectCode.LAYOUT,
                f"worker model layout {message.layout} differs from the coordinator's "
                f"{self.flat.layout.digest}: both must load the same SPEC",
            )
            return
        admitted = self._members.join(peer, message.rank, now)
        if isinstance(admitted, RejectCode):
            await self._refuse(peer, message, admitted, f"rank {message.rank} not available")
            return
        log.info("worker %d joined (%s, build %s)", admitted.rank, self._name(peer), message.build)
        rhythm = self.strategy.rhythm
        welcome = Welcome(
            request=message.request, rank=admitted.rank, world_size=self.strategy.workers,
            strategy=self.strategy.name, push=rhythm.push.value, local_steps=rhythm.local_steps,
            wait=rhythm.wait, batch_size=self.config.batch_size, pub_port=self._pub_port(),
            heartbeat_s=self.config.heartbeat_s, timeout_s=self.config.timeout_s,
        )
        await self._send_weights(peer, welcome)

    async def _push(self, peer: bytes, member: Member, message: Push, now: float) -> None:
        member.clock = message.clock + 1
        self.metrics.max_clock_gap = max(self.metrics.max_clock_gap, self._members.clock_gap())
        if not math.isfinite(message.loss) or not all(
            t.isfinite().all() for t in message.tensors if t.is_floating_point()
        ):
            decisions: list[Decision] = [Drop(member.rank, message.version, DropReason.NOT_FINITE)]
            log.warning("worker %d pushed a non-finite update on version %d", member.rank, message.version)
        else:
            decisions = self.strategy.handle(Arrived(member.rank, message.version, now))
        for decision in decisions:
            match decision:
                case Keep(worker=worker):
                    self._held[worker] = _Held(message.tensors, message.loss, message.samples)
                    await self._reply(peer, Ack(request=message.request, version=self.version))
                case Drop(reason=reason):
                    self.metrics.dropped[reason.value] += 1
                    await self._reply(
                        peer, Ack(request=message.request, version=self.version, dropped=reason.value)
                    )
        await self._carry_out(decisions)

    # Carrying out decisions ----------------------------------------------------------------

    async def _carry_out(self, decisions: list[Decision]) -> None:
        for decision in decisions:
            match decision:
                case Apply():
                    await self._apply(decision)
                case Stall(version=version, waiting_for=waiting, waited_s=waited):
                    names = ", ".join(m.describe() for m in self._members if m.rank in waiting)
                    log.warning("version %d has waited %.1f s for %s", version, waited, names or "joiners")

    async def _apply(self, decision: Apply) -> None:
        held = [self._held.pop(w) for w in decision.workers]
        if self._target is None:
            self._target = self._epochs_to_steps(decision.workers)
        await asyncio.to_thread(self._step, [h.tensors for h in held])
        self.version = decision.version + 1
        self.metrics.max_staleness = max(self.metrics.max_staleness, self.version - 1 - decision.version)
        loss = sum(h.loss for h in held) / len(held)
        samples = sum(h.samples for h in held)
        self.metrics.step(self.version, loss, samples, decision.workers)
        if self.state is State.STARTING:
            self._enter(State.TRAINING, f"first step with workers {list(decision.workers)}")
        await self._publish()
        if self._on_step is not None:
            self._on_step(Progress(self.version, self._target, loss, self.metrics.samples, self.metrics.wall_s()))
        if self._target is not None and self.version >= self._target:
            await self._stop(f"reached version {self.version}")

    def _step(self, updates: list[tuple[torch.Tensor, ...]]) -> None:
        """Average the updates into the gradient buffers (in the given order), then step."""
        with torch.no_grad():
            for b, grad in enumerate(self.flat.grads):
                grad.copy_(updates[0][b])
                for update in updates[1:]:
                    grad.add_(update[b])
                if len(updates) > 1:
                    grad.div_(len(updates))
        self.optimizer.step()

    def _epochs_to_steps(self, workers: tuple[int, ...]) -> int:
        epochs = self.config.epochs
        assert epochs is not None  # config guarantees steps or epochs
        batches = [m.batches for m in self._members if m.rank in workers]
        if not batches or min(batches) < 1:
            raise TrainingError(
                "--epochs needs data() to return a sized iterable (with len()); use --steps"
            )
        steps = epochs * min(batches)
        log.info("%d epoch(s) of %d batches: %d versions", epochs, min(batches), steps)
        return steps

    # Sending -------------------------------------------------------------------------------

    async def _publish(self) -> None:
        """Copy the master weights into a free snapshot and broadcast it."""
        assert self._server is not None
        buffers = self._pool.take()
        with torch.no_grad():
            for dst, src in zip(buffers, self.flat.weights, strict=True):
                dst.copy_(src)
        old, self._snapshot = self._snapshot, _Snapshot(self.version, buffers)
        if old is not None:
            self._pool.release(old.buffers, old.trackers)
        tracker = await self._server.publish(encode(Weights(version=self.version, tensors=buffers)))
        self._snapshot.trackers.append(tracker)

    async def _send_weights(self, peer: bytes, message: Welcome | Weights) -> None:
        snapshot = self._snapshot
        assert snapshot is not None
        message = replace(message, version=snapshot.version, tensors=snapshot.buffers)
        snapshot.trackers.append(await self._reply(peer, message))

    async def _reply(self, peer: bytes, message: Message) -> Tracker | None:
        assert self._server is not None
        return await self._server.send(peer, encode(message))

    async def _refuse(self, peer: bytes, message: Message, code: RejectCode, detail: str) -> None:
        self.metrics.rejected[code.value] += 1
        log.warning("refused %s from %s: %s: %s", message.KIND.name, self._name(peer), code.value, detail)
        await self._reply(peer, Reject(request=message.request, code=code.value, detail=detail))

    # Time ----------------------------------------------------------------------------------

    async def _tick(self) -> None:
        assert self._server is not None
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            now = time.monotonic()
            await self._server.publish(encode(Heartbeat(version=self.version, phase=self.state.value)))
            for member in self._members.silent(now, self.config.timeout_s):
                self._depart(member, f"silent for {self.config.timeout_s:.1f} s: removed", lost=True)
                await self._carry_out(self.strategy.handle(Left(member.rank, now)))
            await self._carry_out(self.strategy.handle(Tick(now)))
            self._check_phase(now)

    def _check_phase(self, now: float) -> None:
        if self.state is State.STARTING and now - self._started_at > self.config.join_timeout_s:
            raise TrainingError(
                f"only {len(self._members)} of {self.strategy.workers} workers joined within "
                f"{self.config.join_timeout_s:.0f} s"
            )
        if self.state is State.TRAINING and len(self._members) == 0:
            why = "; ".join(self._errors) or "they left or went silent"
            raise TrainingError(f"all workers are gone at version {self.version}: {why}")
        if self.state is State.STOPPING and (len(self._members) == 0 or now > self._stop_deadline):
            if len(self._members):
                log.warning("%d worker(s) did not leave in time", len(self._members))
            self._enter(State.STOPPED, "workers released")

    async def _stop(self, why: str) -> None:
        assert self._server is not None
        self._enter(State.STOPPING, why)
        await self._server.publish(encode(Stop(version=self.version, reason="done")))

    def _depart(self, member: Member, why: str, *, lost: bool = False) -> None:
        # A departed worker's kept update stays held: the strategy may still count it.
        self._members.remove(member)
        if lost:
            self.metrics.lost.append(
                {"rank": member.rank, "version": member.version, "phase": member.phase}
            )
            log.warning("%s %s", member.describe(), why)
        else:
            log.info("%s %s", member.describe(), why)

    def _pub_port(self) -> int:
        assert self._server is not None
        return self._server.pub_port

    def _name(self, peer: bytes) -> str:
        member = self._members.get(peer)
        return f"worker {member.rank}" if member else f"peer {peer.hex()}"
