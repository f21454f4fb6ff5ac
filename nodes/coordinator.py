"""The coordinator as a parameter server: master weights, optimizer, versions, membership.

It binds a ROUTER (requests) and a PUB (new versions, heartbeats, stop), feeds its strategy
the events it sees and carries out the decisions it gets back. Two tasks run on one loop:
`_receive` takes every request in arrival order, `_tick` publishes heartbeats, removes
silent workers, and notices the end of a phase. Optimizer steps run in a thread so that the
loop keeps publishing heartbeats meanwhile.

This class is the core that ties the run's parts together; each part with state of its
own lives in its module, decides and records, and never touches a socket:

- nodes.admission: a Join refused or welcomed; rejections counted and rate-limited.
- nodes.intake: a push judged (finite, in range, within its epochs), kept for its step.
- nodes.parking: requests the strategy holds back, answered when released or stopped.
- nodes.stepping: the optimizer and the step that makes each next version.
- nodes.serving: the sockets, bound and closed once, and same-host shared memory.
- nodes.publisher: versions broadcast, and sent to a worker that pulls or joins.
- nodes.ending: where the run is, and how it ends (stops and failures).
- nodes.run_checkpoints, nodes.run_length, nodes.evalpoints: checkpoints, the run's
  length and each rank's data position, the copies evaluated after training.
- nodes.replication: a standby's replicas, sent before each version is published; as a
  standby, following a coordinator until it takes its run over (`stand_by`).

What is left here, past the size the other modules keep, is what needs several parts at
once: receiving and answering, carrying out the strategy's decisions, the tick, a worker's
departure, the run's start and end, and a standby's place in them (a Follow answered, a
first replica under the step lock, a replica before each broadcast, a takeover that loads
the checkpoints' parts and opens the strategy's gate). Split further, each of these would
reach into most parts through callbacks, and the order of their effects (a step, then its
metrics, then its replica, then its broadcast, then a stop) would no longer be read in one
place. So this module is about twice the size the others keep, and the class has about 40
methods where the others have at most 25: a third of them are properties and short
entry points of its public surface (state, endpoint, standby, place, request_stop, remove,
fail, status, ...), the rest the steps named above. A relay (nodes.relay) holds one and
gives it its next versions (nodes.next_version).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tensorbus.bus.buffers import SendBuffers
from tensorbus.bus.clock import SYSTEM_CLOCK, Clock
from tensorbus.bus.codec import decode
from tensorbus.bus.errors import WireError
from tensorbus.bus.layout import Compression
from tensorbus.bus.messages import (
    Ack,
    Describe,
    Follow,
    Heartbeat,
    Join,
    Leave,
    Message,
    Peers,
    Phase,
    Pull,
    Push,
    Ready,
    Reject,
    RejectCode,
    Weights,
)
from tensorbus.bus.pieces import Received
from tensorbus.bus.shared import SharedTensorError, SharedWeightPool, sweep
from tensorbus.bus.transport import (
    ClientFactory,
    Hub,
    ServerFactory,
    ServerTransport,
    ZmqClient,
    ZmqServer,
)
from tensorbus.bus.tree import MAX_JSON_BYTES
from tensorbus.nodes import admission
from tensorbus.nodes.admission import Rejections
from tensorbus.nodes.config import CoordinatorConfig
from tensorbus.nodes.ending import Ending, State
from tensorbus.nodes.evalpoints import EvalPoints, Evaluate, summarize
from tensorbus.nodes.failures import (
    Diverged,
    JoinTimedOut,
    NoVersionMade,
    SteppedDown,
    TooFewWorkers,
    TrainingError,
)
from tensorbus.nodes.flat import FlatModel
from tensorbus.nodes.intake import DIVERGED_AFTER, Held, Intake
from tensorbus.nodes.master import Master, shared_weight_pool, version_sets
from tensorbus.nodes.membership import Member, Membership
from tensorbus.nodes.metrics import Metrics
from tensorbus.nodes.model_buffers import ServedBuffers
from tensorbus.nodes.next_version import NextVersion, NoNextVersion
from tensorbus.nodes.optimizers import OptimizerFactory
from tensorbus.nodes.parking import Parking
from tensorbus.nodes.pipeline_directory import PipelineDirectory
from tensorbus.nodes.publisher import Publisher
from tensorbus.nodes.replication import Ended, FollowError, Following, Standbys, StepDownNotice
from tensorbus.nodes.run_checkpoints import RunCheckpoints
from tensorbus.nodes.run_length import RunLength
from tensorbus.nodes.schedules import SchedulerFactory, make_schedule
from tensorbus.nodes.serving import Serving
from tensorbus.nodes.shards import ShardModel
from tensorbus.nodes.stepping import (
    Stepper,
    correct_momentum,
    follow_lrs,
    master_optimizer,
    stepped_lr,
)
from tensorbus.nodes.watch import Status, Watch
from tensorbus.strategies.base import (
    Apply,
    Decision,
    DropReason,
    Hold,
    Joined,
    Left,
    PushKind,
    Release,
    Stall,
    Strategy,
    Tick,
    Wait,
)

log = logging.getLogger("tensorbus.coordinator")




# A worker's reported phase, as the status table names it (a held push is "staleness").
_STATES = {"waiting": "barrier"}


def _part(fragment: int) -> str:
    """How a refusal names what a push carries (bus.messages.Push.fragment)."""
    return "the whole model" if fragment < 0 else f"fragment {fragment}"


@dataclass(frozen=True)
class Progress:
    version: int
    target: int | None  # versions to apply, when the run is measured in versions
    loss: float
    samples: int
    wall_s: float
    done: float | None = None  # the share of the run done, 0..1, when known


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
        hub: Hub | None = None,
        pool: SendBuffers | None = None,
        shared_pool: SharedWeightPool | None = None,
        transport: ServerFactory = ZmqServer,
        clock: Clock = SYSTEM_CLOCK,
        scheduler: SchedulerFactory | None = None,
        server: ServerTransport | None = None,
        next_version: NextVersion | None = None,
        client: ClientFactory = ZmqClient,
        directory: PipelineDirectory | None = None,
        on_lost: Callable[[int, str], Awaitable[None]] | None = None,
    ) -> None:
        """`hub`: this process's shared ZeroMQ context, to be reachable in-process too
        (by the worker beside a colocated shard: see nodes.colocated). `pool`: the buffer
        sets versions are made and published in (by default its own; a colocated shard's
        are shared with its worker: nodes.colocated_sets). `shared_pool`: where the given pool's
        sets lie in shared memory (without a pool, with `config.shared_memory`, this
        coordinator's own sets do: bus.shared.SharedWeightPool); it is closed when the run ends.
        `transport` makes the sockets, `client` those to a standby or the coordinator a
        standby follows (bus.memory's for one-loop tests); `clock` is read
        for every deadline and record (bus.clock). `scheduler`: the SPEC's, stepped here on
        the optimizer that steps the versions (nodes.schedules); under average each worker
        steps its own, and it is not used here. `server`: sockets bound already, to
        serve on (nodes.serving), in place of binding `config.bind`. `next_version`: where
        each next version comes from, in place of an optimizer step here (a relay's: see
        nodes.next_version for what that changes). `directory`: where
        the stage workers of a run's pipelines listen, shared by its stage coordinators
        (a coordinator of stage `config.stage`: nodes.pipeline_directory). `on_lost`:
        awaited with a worker's rank and why, once it is lost (killed, or silent), after
        its removal (a stage coordinator's launcher stops that worker's pipeline)."""
        if isinstance(model, ShardModel) and (config.eval_every_s or config.eval_every_epochs):
            raise ValueError("eval_every_s evaluates the whole model during training, and a "
                             "shard holds a range of it: evaluate after training the model "
                             "that nodes.shards.assemble fills")
        if strategy.changes_pushed and not config.compress:
            # (Pushes are changes since the version loaded, which go quantized: int8 unless
            # int4 is asked for. strategies.async_average.)
            config = dataclasses.replace(config, compress="int8")
        self.model = model
        self.strategy = strategy
        self.config = config
        self._next_version = next_version
        self._own_optimizer = optimizer is not None  # the SPEC's: --lr does not set its lr
        self._clock = clock
        self.flat = FlatModel(model)
        self.lr = lr  # handed to workers that own their optimizers
        weights_pushed = strategy.rhythm.push is PushKind.WEIGHTS
        self.version = 0
        self._evaluate = evaluate
        self._on_step = on_step
        self._directory = directory
        self._on_lost = on_lost
        if directory is not None and directory.stages != config.pipeline:
            raise ValueError(f"a directory of {directory.stages} stages for a coordinator of "
                             f"stage {config.stage} of {config.pipeline}")
        # What pushes must look like: the model's layout, compressed if asked.
        compression = Compression.parse(config.compress)
        compression.check(weights_pushed, strategy.name)
        self._wire_layout = compression.wire(self.flat.layout)
        # Streaming averaging: the model's fragments, and the layouts their pushes travel as.
        if strategy.rhythm.fragments and isinstance(model, ShardModel):
            raise ValueError("streaming averaging (fragments) needs the whole model at one "
                             "coordinator: drop the shards, or the fragments")
        fragments = (self.flat.layout.fragments(strategy.rhythm.fragments)
                     if strategy.rhythm.fragments else ())
        self._fragment_layouts = tuple(compression.wire(f.layout) for f in fragments)
        if config.max_workers is not None and config.max_workers < strategy.workers:
            raise ValueError(f"max_workers ({config.max_workers}) is below the {strategy.workers} "
                             "workers the run starts with")
        self._members = Membership(config.max_workers or strategy.workers,
                                   first_rank=config.first_rank, world_size=config.world_size)
        self._length = RunLength(
            steps=config.steps, epochs=config.epochs, batch_size=config.batch_size,
            version=lambda: self.version, samples=lambda: self.metrics.samples,
            ready=lambda: [m.batches for m in self._members if m.ready])
        self._evals = EvalPoints(config.eval_every_s, evaluate,
                                 every_epochs=config.eval_every_epochs)
        # Versions made in shared memory, which workers of this host read where they lie.
        self._shared_pool = shared_pool if pool is not None else shared_weight_pool(config)
        sets = pool if pool is not None else version_sets(self.flat.layout, self._shared_pool)
        stepped = (master_optimizer(model.parameters(), strategy, optimizer, lr)
                   if next_version is None else None)
        # The published snapshot is the master's own buffer set (no copy), never written in
        # place after (nodes.master), unless versions come from elsewhere: then copies.
        self.master = Master(self.flat, stepped, sets, compression=compression,
                             weights_pushed=weights_pushed, alias=next_version is None,
                             clip_grad_norm=config.clip_grad_norm, fragments=fragments)
        if pool is not None:  # every version is made in the given pool's sets, the first too
            self.flat.rebind(self.master.copy())
        correct_momentum(self.master.optimizer, strategy)
        self._step_lock = asyncio.Lock()  # one update (or checkpoint) at a time
        self.stepper = Stepper(self.master, self.flat, step_lock=self._step_lock,
                               version=lambda: self.version)
        self._schedule = (make_schedule(scheduler, self.master.optimizer)
                          if scheduler is not None and self.master.optimizer is not None
                          and not weights_pushed else None)
        self._max_bytes = self.flat.layout.nbytes + 65536
        self._started_at = 0.0
        self._errors: list[str] = []  # why workers left with an error, for the final message
        self._background: asyncio.Task[None] | None = None  # a stop under way
        # The model's buffers: each worker's newest, and what goes out with the weights.
        self._buffers = ServedBuffers(self.flat.model_buffers, relay=next_version is not None)
        self.metrics = Metrics(config.metrics, strategy=strategy.name, workers=strategy.workers,
                               append=config.resume, clock=clock)
        self.watch = Watch(self.metrics, trace=config.trace)
        self._serving = Serving(config, transport=transport, hub=hub, max_bytes=self._max_bytes,
                                workers=strategy.workers, metrics=self.metrics, server=server,
                                term=lambda: self._standbys.term)
        self._rejections = Rejections(self.metrics, clock, workers=strategy.workers)
        self._parking = Parking(self._serving.reply, metrics=self.metrics, watch=self.watch, clock=clock,
                                wait=strategy.rhythm.wait, local_steps=strategy.local_steps)
        self._intake = Intake(stepper=self.stepper, strategy=strategy, length=self._length,
                              metrics=self.metrics, watch=self.watch, buffers=self._buffers,
                              rejections=self._rejections, clock=clock)
        self._ending = Ending(clock=clock, stop_timeout_s=config.stop_timeout_s, metrics=self.metrics)
        self.checkpoints = RunCheckpoints(
            config.checkpoint_dir, model=model, flat=self.flat, master=self.master,
            strategy=strategy, schedule=self._schedule, length=self._length,
            buffers=self._buffers, metrics=self.metrics, watch=self.watch, clock=clock)
        if config.keys is not None:  # (to our standby, or the coordinator we follow: ours)
            client = functools.partial(client, keys=config.keys.as_peer())
        self._client = client
        self._standbys = Standbys(term=0, layout=self.flat.layout.digest,
                                  timeout_s=config.timeout_s, clock=clock, client=client,
                                  metrics=self.metrics, shared_pool=self._shared_pool)
        self._replicating: asyncio.Task[None] | None = None  # a first replica for a new standby
        self._former = ""  # as a standby that took over: the coordinator it followed
        self._busy_since: float | None = None  # when the request being carried out came in
        self._following: Following | None = None  # as a standby, until it takes over

    @property
    def state(self) -> State:
        """Where the run is (nodes.ending)."""
        return self._ending.state

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """What steps the master weights (None: a plain average of pushed weights)."""
        return self.master.optimizer

    @property
    def endpoint(self) -> str:
        return self._serving.endpoint

    @property
    def inproc_endpoint(self) -> str:
        """Where a worker of this process reaches us in-process (bound with a hub)."""
        if not self._serving.server.inproc_endpoint:
            raise RuntimeError("the coordinator is not bound with a hub: give it hub= and bind()")
        return self._serving.server.inproc_endpoint

    @property
    def standby(self) -> str:
        """Where this coordinator's standby serves ("": none follows it now)."""
        return self._standbys.advertised

    @property
    def stopping(self) -> bool:
        """Whether the run is stopping or stopped."""
        return self._ending.stopping

    def place(self, *, first_rank: int, world_size: int, batch_size: int) -> None:
        """Serve ranks first_rank.. of `world_size` data shards, of `batch_size` samples a
        batch, where these are known only once the run is under way elsewhere (a relay
        learns them as its root welcomes it); before `run`."""
        self.config = dataclasses.replace(self.config, first_rank=first_rank,
                                          world_size=world_size, batch_size=batch_size)
        self._members = Membership(self._members.size, first_rank=first_rank, world_size=world_size)

    def combined_buffers(self) -> tuple[torch.Tensor, ...]:
        """The model's buffers combined from the workers' newest (a relay's, to go up with
        its update: nodes.model_buffers.ServedBuffers.upstream)."""
        return self._buffers.upstream()

    def versions_held(self) -> asyncio.Lock:
        """Held (`async with`), no version is made: the one under way ends first."""
        return self._step_lock

    def close(self) -> None:
        """Close the sockets of a coordinator bound and never run (`run` closes its own)."""
        if self._serving.bound:
            self._serving.close()

    async def stand_by(self, primary: str) -> bool:
        """Follow the coordinator at `primary` as its standby (nodes.replication) until it
        is lost, then take its run over from the newest replica: True, and `run` goes on
        from there. False: that coordinator ended its run, and there is nothing to take
        over (TrainingError if it ended with an error). Binds first."""
        # A replica holds the weights, the optimizer's state (a tensor or two a parameter)
        # and the buffers: room for that, from the bind on (ZeroMQ takes the limit there).
        replica_bytes = 4 * self.flat.layout.nbytes + MAX_JSON_BYTES + 65536
        if self._serving.bound:
            raise RuntimeError("a standby binds its own sockets, in stand_by: do not bind it before")
        self._serving.max_bytes = replica_bytes
        endpoint = self.bind()
        if endpoint.startswith("inproc://"):
            raise ValueError(f"a standby serves where workers of other processes reach it, not {endpoint}")
        server = self._serving.server
        following = self._following = Following(
            primary, endpoint=endpoint, layout=self.flat.layout.digest, server=server,
            client=self._client, clock=self._clock, heartbeat_s=self.config.heartbeat_s,
            timeout_s=self.config.timeout_s, first_answer_s=self.config.join_timeout_s,
            max_bytes=replica_bytes, check=self._replica_refusal)
        self.metrics.write("following", coordinator=primary, endpoint=endpoint)
        try:
            outcome = await following.run()
        except BaseException:
            self.close()
            raise
        finally:
            self._following = None
        if isinstance(outcome, Ended):
            self.close()
            if outcome.stop.reason == "error":
                raise TrainingError(f"the coordinator at {primary} ended its run with an error: "
                                    f"{outcome.stop.detail}")
            log.info("the coordinator at %s ended its run at version %d: nothing to take over",
                     primary, outcome.stop.version)
            return False
        source = f"the replica of version {outcome.state['version']} from {primary}"
        self.version = self.checkpoints.load(outcome.state, source)
        if outcome.torn():  # (copied from its set, which its coordinator wrote again meanwhile)
            self.close()
            raise FollowError(f"{source} was written again while it was read: nothing whole to "
                              "take over (the coordinator wrote its newest version's set)")
        # (0: replicated before any worker joined; then as many as the run starts with)
        members = outcome.state["strategy_state"].get("members") or self.strategy.workers
        self.strategy.open_gate_at(members)
        self._standbys.term, self._standbys.run_id, self._former = outcome.term, outcome.run, primary
        log.warning("took over from the coordinator at %s, silent for %.1f s: version %d, term "
                    "%d, waiting for %d worker(s) (%d replicas taken)", primary, outcome.silent_s,
                    self.version, outcome.term, self.strategy.gate, following.replicas)
        self.metrics.write("takeover", version=self.version, term=outcome.term, former=primary,
                           silent_s=round(outcome.silent_s, 3), replicas=following.replicas)
        return True

    def bind(self) -> str:
        """Bind the sockets now (so that the endpoint is known); `run` binds if not done."""
        return self._serving.bind(lambda server, host_token: Publisher(
            self.master, server, step_lock=self._step_lock, clock=self._clock,
            heartbeat_s=self.config.heartbeat_s, metrics=self.metrics,
            shared_pool=self._shared_pool, host_token=host_token, version=lambda: self.version,
            stopping=lambda: self._ending.stopping, buffers=self._buffers.published,
            background=lambda c: asyncio.create_task(self._guard(c)),
            term=lambda: self._standbys.term))

    async def run(self, *, before_evaluate: Awaitable[Any] | None = None) -> dict[str, Any]:
        """Train until the target version, then stop the workers and return the summary.

        `before_evaluate` is awaited between the end of training and `evaluate`: for the
        first shard of a sharded server, the other shards' runs, so that the model
        `evaluate` assembles holds every shard's final weights."""
        self.bind()
        if self._shared_pool is not None:
            # Sets in shared memory from now on (until the run ends), the first version's
            # too (a relay publishes copies of its master, not the master: see _ALIAS).
            self._shared_pool.open()
            if self.master.alias:
                self.flat.rebind(self.master.copy())
        done = self._ending.begin()
        self._started_at = self._clock.monotonic()
        try:
            # (A standby that took over goes on from its replica, newer than any checkpoint.)
            if self.config.resume and not self._former:
                resumed = self.checkpoints.resume()
                if resumed is not None:
                    self.version = resumed
            await self._serving.publisher.publish()
        except BaseException:
            if self._shared_pool is not None:
                self._shared_pool.close()
            raise
        jobs = [self._receive(), self._tick()]
        if self._former:  # (taken over: the one followed steps down if it comes back)
            jobs.append(StepDownNotice(
                self._former, endpoint=self.endpoint, term=self._standbys.term,
                run=self._standbys.run_id,
                layout=self.flat.layout.digest, client=self._client,
                heartbeat_s=self.config.heartbeat_s).run())
        tasks = [asyncio.create_task(self._guard(c)) for c in jobs]
        try:
            await done
        except BaseException:
            self.metrics.close()
            raise
        finally:
            if self._serving.publisher.later is not None:
                tasks.append(self._serving.publisher.later)
            if self._replicating is not None:
                tasks.append(self._replicating)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._serving.close()
            self._standbys.drop()
            if self._shared_pool is not None:
                self._shared_pool.close()
            self.watch.close()
        if self._ending.failure is not None:
            self.metrics.close()
            raise self._ending.failure
        if before_evaluate is not None:
            try:
                await before_evaluate
            except BaseException:
                self.metrics.close()
                raise
        self._buffers.refresh()
        if self._standbys.term or self._standbys.replicated:  # (a run that had a standby)
            self.metrics.sections["standby"] = self._standbys.summary()
        return summarize(self._evals, self._evaluate, self.master, self.metrics)

    async def _guard(self, coroutine: Any) -> None:
        try:
            await coroutine
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed on to run(), which raises it
            self.metrics.close()
            if self._ending.running:
                assert self._ending.done is not None
                self._ending.done.set_exception(e)

    async def remove(self, rank: int, why: str) -> bool:
        """Remove a worker known to be dead (its launcher saw it die), without waiting for
        its heartbeats to stop; the strategy goes on without it. False if not running or
        not a member."""
        member = next((m for m in self._members if m.rank == rank), None)
        if member is None or not self._ending.running:
            return False
        await self._depart(member, why, lost=True)
        await self._carry_out(self.strategy.handle(Left(rank, self._clock.monotonic())))
        return True

    def request_stop(self, why: str, *, at_version: int | None = None, quiet: bool = False) -> None:
        """Stop gracefully (for SIGTERM or Ctrl-C): finish the update in flight, write a
        checkpoint (with a checkpoint_dir), tell the workers to stop, and return the summary.
        With `at_version`, train on to that version first, then stop so: shards that must
        end at one version (colocated, see run.colocated) are each told the same one. If
        it is not reached within the stop timeout, stop where it is. `quiet`: a stop that
        is the run's normal end (said at info level, not as a warning). Call it from the
        coordinator's event loop."""
        if self._following is not None:  # a standby: it stops following, and takes nothing over
            self._following.stop(why)
            return

        def begin(why: str) -> None:  # (a reference kept, so that the task is not collected)
            self._background = asyncio.get_running_loop().create_task(
                self._guard(self._graceful_stop(why)))

        self._ending.ask(why, version=self.version, at_version=at_version, quiet=quiet, stop=begin)

    async def _graceful_stop(self, why: str) -> None:
        async with self._step_lock:
            if self._ending.stopping:
                return
            await self.checkpoints.write(self.version)
            await self._stop(self._ending.stop_words(why))

    # Receiving ---------------------------------------------------------------------------

    async def _receive(self) -> None:
        while True:
            peer, frames = await self._serving.server.recv()
            member = self._members.get(peer) is not None
            try:
                # Tensors by reference only from members (bus.shared: the trust it needs).
                message = decode(frames, max_bytes=self._max_bytes, layout=self._wire_layout,
                                 segments=self._serving.segments if member else None,
                                 fragments=self._fragment_layouts)
            except WireError as e:
                code, detail = e.code, str(e)[:1000]
                if isinstance(e, SharedTensorError) and not member:
                    # A worker removed (silent for too long) that pushes by reference: told
                    # to join again, as one that pushes bytes is (see _dispatch).
                    code, detail = RejectCode.UNKNOWN_WORKER, admission.NOT_A_MEMBER
                self._rejections.count(peer, code.value,
                                       f"rejected a message from {self._members.name(peer)}: {e}")
                await self._serving.reply(peer, Reject(request=e.request, code=code.value, detail=detail))
                continue
            began = self._busy_since = self._clock.monotonic()
            await self._dispatch(peer, message)
            self._busy_since = None
            busy = self._clock.monotonic() - began
            if busy > self.config.heartbeat_s:
                # Not reading meanwhile (a step, a replica waited for: up to --timeout for a
                # standby cut off), we heard nobody's beats: that is not their silence.
                self._members.not_listening(busy)
            # Let go of the frames now, not when the next message comes: sent in-process,
            # they are the sender's memory, which it may not write until we are done.
            del frames, message

    async def _dispatch(self, peer: bytes, message: Message) -> None:
        now = self._clock.monotonic()
        if isinstance(message, Join):
            if message.term > self._standbys.term and message.run == self._standbys.run_id:
                await self._newer_term(peer, message)
                return
            await self._join(peer, message, now)
            return
        if isinstance(message, Follow):  # a standby's (nodes.replication)
            await self._follow(peer, message)
            return
        if isinstance(message, Describe):  # a script's model, after the first's (run.own_loop)
            refused = admission.refusal(message, layout=self.flat.layout.digest, model=self.model)
            await self._serving.reply(peer, Ack(request=message.request, version=self.version)
                                      if refused is None else
                                      Reject(request=message.request, code=refused.code.value,
                                             detail=refused.detail))
            return
        member = self._members.get(peer)
        if member is None or member.rank != message.sender:
            if self._rejections.departed(peer) and isinstance(message, Heartbeat | Leave):
                return  # beats a worker sent before its Leave was taken
            await self._refuse(peer, message, RejectCode.UNKNOWN_WORKER, admission.NOT_A_MEMBER)
            return
        member.last_seen = now
        # Stopping, a worker may still fetch the final weights (a Pull) before it leaves.
        if self.state is State.STOPPING and not isinstance(message, Leave | Heartbeat | Pull):
            await self._serving.reply(peer, self._ending.answer(message.request, self.version))
            return
        match message:
            case Heartbeat(phase=phase, clock=clock, version=version):
                # A beat sent just before a push may arrive after it: never move backwards.
                member.phase = phase
                member.clock = max(member.clock, clock)
                member.version = max(member.version, version)
            case Ready(batches=batches, unused=unused):
                member.ready, member.batches = True, batches
                self.metrics.unused = max(self.metrics.unused, unused)
                decisions = self.strategy.handle(Joined(member.rank, now))
                await self._parking.answer(peer, member, message.request, decisions, now, push=False,
                                          version=self.version)
                await self._carry_out(decisions)
            case Push(batches=batches, fragment=fragment):
                expected = self.strategy.rhythm.fragment(message.version)
                if fragment != expected:
                    # (Its tensors are that fragment's, as the codec checked: not the one
                    # this run averages on that version, or a whole model where it streams.)
                    await self._refuse(peer, message, RejectCode.LAYOUT, (
                        f"a push of {_part(fragment)} on version {message.version}, where this "
                        f"run's pushes on it carry {_part(expected)}"))
                    return
                # Fresher than its last beat (beats come every heartbeat_s): for the status.
                member.phase = Phase.PUSHING.value
                member.version = max(member.version, message.version)
                if batches > 0 and member.batches == -1:  # its first pass over: its length
                    member.batches = batches
                await self._push(peer, member, message, now)
            case Pull(version=have):
                await self._serving.publisher.refresh()
                if self.master.snapshot is not None and have >= self.master.snapshot.version:
                    # Nothing newer: say so without resending the model.
                    await self._serving.reply(peer, Weights(request=message.request, version=self.version))
                else:
                    await self._serving.publisher.send(peer, Weights(request=message.request))
            case Peers():
                if self._directory is None:
                    await self._refuse(peer, message, RejectCode.UNEXPECTED,
                                       "this coordinator serves no pipeline stage")
                else:
                    previous, following = self._directory.neighbours(self.config.stage, member.rank)
                    await self._serving.reply(peer, Peers(request=message.request,
                                                          version=self.version,
                                                          previous=previous, next=following))
            case Leave(reason=reason, detail=detail):
                await self._serving.reply(peer, Ack(request=message.request, version=self.version))
                self._rejections.left(peer)
                if reason == "error":  # (before it departs: a failure below the minimum says it)
                    self._errors.append(f"worker {member.rank}: {detail}")
                    self.metrics.failed.append(
                        {"rank": member.rank, "version": member.version, "why": detail})
                # (An error is said by the run's failure, or its worker; a normal end is not news.)
                await self._depart(member, f"left ({reason}{': ' + detail if detail else ''})",
                                   warn=reason == "interrupted",
                                   finished=reason == "done" and self.config.until_workers_leave)
                await self._carry_out(self.strategy.handle(Left(member.rank, now)))
            case _:
                await self._refuse(peer, message, RejectCode.UNEXPECTED, "not taken here")

    async def _newer_term(self, peer: bytes, message: Join) -> None:
        """A worker of this run joins in a newer term: it was at the coordinator that took
        the run over while we were cut off (and came back, having lost it). Two coordinators
        must not serve one run: step down, and send the workers to our standby, which that
        one was. (Only a join naming the run's id counts: a stranger's term decides nothing.)"""
        if not self._ending.stopping:
            # (Our last words in the newer term: a worker of it takes them, and moves.)
            self._standbys.term = message.term
            await self.fail(SteppedDown(endpoint=self._standbys.last, term=message.term,
                                        version=self.version,
                                        by=(f"worker {message.sender}" if message.sender >= 0
                                            else "a joining worker")))
        await self._serving.reply(peer, self._ending.answer(message.request, self.version))

    async def _follow(self, peer: bytes, message: Follow) -> None:
        """A standby follows us; or one that took our run over (a newer term): step down."""
        refused = self._standbys.refusal(message)
        if refused is not None:
            await self._refuse(peer, message, RejectCode.UNEXPECTED, refused)
            return
        if self.state is State.STOPPING:  # the run is ending: its standby ends with it
            await self._serving.reply(peer, self._ending.answer(message.request, self.version))
            return
        if message.term > self._standbys.term:
            await self._serving.reply(peer, Ack(request=message.request, version=self.version))
            self._standbys.term = message.term  # (our last words in it: see _newer_term)
            await self.fail(SteppedDown(endpoint=message.endpoint, term=message.term,
                                        version=self.version))
            return
        self._standbys.follow(peer, message)
        await self._serving.reply(peer, Ack(request=message.request, version=self.version))
        if self._standbys.fresh and (self._replicating is None or self._replicating.done()):
            self._replicating = asyncio.get_running_loop().create_task(
                self._guard(self._replicate_now()))

    async def _replicate_now(self) -> None:
        """A new standby's first replica: the version the workers have now."""
        async with self._step_lock:
            if self._standbys.fresh and not self._ending.stopping:
                await self._standbys.replicate(self.version, self._replica)

    def _replica(self) -> dict[str, Any]:
        """What a standby takes over from: a checkpoint's state, and our term."""
        return {**self.checkpoints.state(self.version, to_file=False), "term": self._standbys.term}

    def _replica_refusal(self, state: dict[str, Any]) -> str | None:
        """Why a standby could not take a run of this state over (None: it could)."""
        if state.get("layout") != self.flat.layout.digest:
            return f"a model of layout {state.get('layout')}, this standby's {self.flat.layout.digest}"
        if state.get("strategy") != self.strategy.name:
            return (f"strategy {state.get('strategy')}, this standby's {self.strategy.name}: "
                    "start it with the coordinator's options")
        return None

    async def _join(self, peer: bytes, message: Join, now: float) -> None:
        if self.state is State.STOPPING:
            await self._serving.reply(peer, self._ending.answer(message.request, self.version))
            return
        refused = admission.refusal(message, layout=self.flat.layout.digest, model=self.model,
                                    stage=(self.config.stage, self.config.pipeline))
        if refused is not None:
            await self._refuse(peer, message, refused.code, refused.detail)
            return
        again = self._members.get(peer) is not None  # a repeated Join (a retry): no-op
        admitted = self._members.join(peer, message.rank, now)
        if isinstance(admitted, RejectCode):
            await self._refuse(peer, message, admitted, self._members.refusal(admitted, message.rank))
            return
        if not again:
            log.info("worker %d joined (%s, build %s)", admitted.rank, self._members.name(peer),
                     message.build)
            self.metrics.worker(admitted.rank)["joins"] += 1
        if self._directory is not None and message.inbox:
            self._directory.place(self.config.stage, admitted.rank, message.inbox)
            admitted.inbox = message.inbox
        welcome = admission.welcome(
            message, admitted.rank, strategy=self.strategy, config=self.config,
            world_size=self._members.world_size, pub_port=self._serving.server.pub_port, lr=self.lr,
            position=self._length.positions.get(admitted.rank, 0), host_token=self._serving.host_token,
            standby=self._standbys.advertised, run=self._standbys.run_id)
        self._intake.copy_held(admitted.rank, self._serving.segments)
        await self._serving.publisher.refresh()
        await self._serving.publisher.send(peer, welcome)

    async def _push(self, peer: bytes, member: Member, message: Push, now: float) -> None:
        taken = await self._intake.take(
            peer, member, message, now, members=lambda: [m.rank for m in self._members],
            segments=self._serving.segments, stopping=self._ending.stopping,
            # (Over: a push that comes now is not stepped on, its buffers not taken.)
            over=lambda: self._ending.stopping or self._length.reached_target)
        decisions, dropped = taken.decisions, taken.dropped
        if dropped == DropReason.PAST_EPOCHS.value:
            # Answered once the run's length is known (_know_length), not computed on again
            # and again meanwhile: the CPU is the slower workers' now.
            self._parking.park(member.rank, peer, message.request, now, push=True)
        elif dropped:
            await self._serving.reply(peer, Ack(request=message.request, version=self.version,
                                                dropped=dropped,
                                                local_steps=self.strategy.local_steps(member.rank) or 0))
            self.watch.answered(member.rank)
        else:
            member.clock = max(member.clock, message.clock + 1)  # what it says, once taken
            # Answered before the step is taken, so that a worker that need not wait goes on;
            # but one that pushed by reference and waits for no newer version writes these
            # buffers again once answered (bus.shared, Ownership): answered after the step
            # that takes the push, or, kept for a later one, once copied out. (Ssp's Hold
            # stays: the answer, after the step, still waits for the slowest.) Async-average's
            # worker goes on from the version its change made (it takes the model back, as in
            # Liu et al.): answered after that step too, the answer names that version.
            stepped = False
            rhythm = self.strategy.rhythm
            after_step = taken.by_reference or (rhythm.push is PushKind.WEIGHTS
                                                and rhythm.wait is Wait.ANSWERED)
            if after_step and rhythm.wait is not Wait.NEWER:
                if any(isinstance(d, Apply) and member.rank in d.workers for d in decisions):
                    await self._carry_out(decisions)
                    # (Held still, unless released meanwhile: a member left while the step
                    # ran, and the Release found nobody parked yet.)
                    decisions = [d for d in decisions if isinstance(d, Hold)
                                 and self.strategy.holds_back(d.worker)]
                    stepped = True
                elif taken.by_reference:
                    self._intake.copy_held(member.rank, self._serving.segments)
            if stepped and self._ending.stopping:  # (the last step)
                await self._serving.reply(peer, self._ending.answer(message.request, self.version))
            else:
                await self._parking.answer(peer, member, message.request, decisions, now,
                                          push=True, version=self.version)
        await self._carry_out(decisions)
        if self.state in (State.STARTING, State.TRAINING):
            await self._check_finite()

    async def _check_finite(self) -> None:
        """Fail the run once no version can come of the updates pushed (Intake.diverged)."""
        diverged = self._intake.diverged((m.rank for m in self._members),
                                         lambda rank: rank in self._parking)
        if diverged is None:
            return
        bad, waiting = diverged
        await self.fail(Diverged(
            ranks=bad, window=DIVERGED_AFTER, waiting=waiting,
            version=self.version if self.state is State.TRAINING else None,
            lr="the lr of the SPEC's optimizer()" if self._own_optimizer else "--lr",
            remedies=self.strategy.remedies()))

    # Carrying out decisions ----------------------------------------------------------------

    async def _carry_out(self, decisions: list[Decision]) -> None:
        for decision in decisions:
            match decision:
                case Apply():
                    await self._apply(decision)
                case Release(workers=workers):
                    if self.state is State.STARTING and self._length.reached_target:
                        # Resumed from the checkpoint of a run that was over: no step more.
                        await self._stop(f"reached {self._length.progress_words()} before this start "
                                         "(resumed from the end of a run)")
                        return
                    await self._parking.release(workers, version=self.version)
                    if self.metrics.trained_from is None and self.strategy.started:
                        self.metrics.training_started()
                        if self.metrics.unused:
                            log.info("each epoch leaves out %d sample(s) of the data: the last "
                                     "partial global batch (its data() says so)",
                                     self.metrics.unused)
                        self._take_eval_point()
                case Stall(version=version, waiting_for=waiting, waited_s=waited):
                    names = ", ".join(m.describe() for m in self._members if m.rank in waiting)
                    log.warning("version %d has waited %.1f s for %s", version, waited, names or "joiners")

    async def _apply(self, decision: Apply) -> None:
        held = [self._intake.held.pop(w) for w in decision.workers]
        async with self._step_lock:
            if self._ending.stopping:
                return  # stopped while this update waited for the one in flight
            await self._apply_locked(decision, held)

    async def _apply_locked(self, decision: Apply, held: list[Held]) -> None:
        await self._know_length()
        # A script's own loop steps its scheduler on its optimizer; ours follows it.
        follow_lrs(self.master.optimizer, next((h.lrs for h in held if h.lrs), ""))
        started = self._clock.wall()
        try:
            await self._update([h.tensors for h in held], decision.scale,
                               loss=sum(h.loss for h in held) / len(held),
                               samples=sum(h.samples for h in held), ranks=decision.workers)
        except NoNextVersion as e:
            if e.failure is not None:  # (not fail(): it waits for the step lock held here)
                self._ending.fail(e.failure)
            await self._stop(e.failure or e.why)
            return
        finally:
            for h in held:
                h.tensors = ()  # reduced: let go of the frames (see _receive)
        if self.state is State.STOPPING:
            return  # stopped while the next version was awaited (a relay's): none made
        self.watch.span("apply", started, version=self.version + 1, workers=list(decision.workers))
        staleness = self.version - decision.version
        self.version += 1
        self.metrics.max_staleness = max(self.metrics.max_staleness, staleness)
        loss = sum(h.loss for h in held) / len(held)
        samples = sum(h.samples for h in held)
        for w, h in zip(decision.workers, held, strict=True):
            self.metrics.worker(w)["applied"] += 1
            self._length.used(w, h.steps)
        lr = stepped_lr(self.master.optimizer, self.strategy, self.lr)  # (this version's)
        self.metrics.step(self.version, loss, samples, decision.workers, staleness, lr=lr)
        if self._schedule is not None:  # (after the samples are counted: epochs are samples)
            self._schedule.after_step(self._length.epochs_done())
        if self.state is State.STARTING:
            self._ending.enter(State.TRAINING, f"first step with workers {list(decision.workers)}")
        # Replicated before it is published: no worker builds on a version its standby lacks.
        started = self._clock.wall()
        await self._standbys.replicate(self.version, self._replica)
        if self._standbys.endpoint:
            self.watch.span("replicate", started, version=self.version)
        started = self._clock.wall()
        await self._serving.publisher.publish()
        self.watch.span("broadcast", started, version=self.version)
        for member in self._members:  # released from the barrier by this version
            if member.phase == Phase.WAITING.value and member.rank in decision.workers:
                member.phase = Phase.COMPUTING.value
        # (Not before training started: the first copy is taken then, by _carry_out, and
        # train_s() is 0 until it does.)
        if self.metrics.trained_from is not None and self._evals.due(
                self.metrics.train_s(), self._length.epochs_done()):
            self._take_eval_point()
        if self._on_step is not None:
            self._on_step(Progress(self.version, self._length.steps, loss, self.metrics.samples,
                                   self.metrics.wall_s(), self._length.done_share()))
        if self._ending.stop_due(self.version):
            await self.checkpoints.write(self.version)
            await self._stop(self._ending.stop_words(self._ending.requested or ""))
        elif self._length.reached_target:
            await self.checkpoints.write(self.version)
            await self._stop(f"reached {self._length.progress_words()}")
        elif (self.config.checkpoint_every is not None
              and self.version % self.config.checkpoint_every == 0):
            await self.checkpoints.write(self.version)

    def _take_eval_point(self) -> None:
        """A copy of the weights as they are now, evaluated after training (nodes.evalpoints)."""
        self._buffers.refresh()
        self._evals.take(self.master, self.version, self.metrics.samples, self.metrics.train_s(),
                         self._length.epochs_done() if self._evals.by_epoch else None)

    async def _update(
        self, updates: list[tuple[Received, ...]], scale: float, *, loss: float, samples: int,
        ranks: Sequence[int] = (),
    ) -> None:
        """Make the next version of the weights from these updates: one optimizer step
        (nodes.stepping), or what `next_version` makes of them (a relay's)."""
        if self._next_version is None:
            await self.stepper.step(updates, scale, ranks=ranks)
        else:
            await self._next_version(updates, scale, loss=loss, samples=samples, ranks=ranks)

    async def _know_length(self) -> None:
        """Fix the run's length once every shard's is known, and answer the updates
        held back meanwhile (RunLength.past_its_epochs)."""
        if self._length.fix_target():
            await self._parking.release(self._parking.pushes(but=self.strategy.holds_back),
                                        version=self.version)

    # Sending (versions: nodes.publisher, through nodes.serving) -------------------------------

    async def _refuse(self, peer: bytes, message: Message, code: RejectCode, detail: str) -> None:
        self._rejections.count(peer, code.value, f"refused {message.KIND.name} from "
                                                 f"{self._members.name(peer)}: {code.value}: {detail}")
        await self._serving.reply(peer, Reject(request=message.request, code=code.value, detail=detail))

    # Time ----------------------------------------------------------------------------------

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            now = self._clock.monotonic()
            # Stopping, the Stop goes out again each beat: a worker whose subscription came
            # after the first one (welcomed just before the stop) hears it too, and leaves.
            beat = (self._ending.answer(0, self.version) if self.state is State.STOPPING
                    else Heartbeat(version=self.version, phase=self.state.value,
                                   standby=self._standbys.advertised))
            await self._serving.publish(beat)
            if self._standbys.peer is not None and self.state is not State.STOPPING:
                # Our standby hears us each beat too, whatever a step holds up meanwhile.
                await self._serving.reply(self._standbys.peer, Heartbeat(
                    version=self.version, phase=self.state.value))
            busy = self._busy_since is not None and now - self._busy_since > self.config.heartbeat_s
            for member in [] if busy else self._members.silent(now, self.config.timeout_s):
                await self._depart(member, f"silent for {self.config.timeout_s:.1f} s: removed", lost=True)
                await self._carry_out(self.strategy.handle(Left(member.rank, now)))
            await self._carry_out(self.strategy.handle(Tick(now)))
            self._rejections.handshakes(self._serving.server.rejected)
            await self._check_phase(now)
            self._rejections.forget(now)

    async def _check_phase(self, now: float) -> None:
        if self.state is State.STARTING and now - self._started_at > self.config.join_timeout_s:
            waited = self.config.join_timeout_s
            if len(self._members) < self.strategy.workers:
                await self.fail(JoinTimedOut(
                    joined=len(self._members), wanted=self.strategy.workers, waited_s=waited,
                    endpoint=self.endpoint, refused=self.metrics.rejected["handshake"],
                    lost_early=tuple(w["rank"] for w in self.metrics.lost)))
            else:  # all here, and yet no first version
                await self.fail(NoVersionMade(waited_s=waited, dropped=dict(self.metrics.dropped)))
        await self._check_minimum()
        if self.state is State.STOPPING and (len(self._members) == 0 or now > self._ending.deadline):
            if len(self._members):
                log.warning("%d worker(s) did not leave in time", len(self._members))
            self._ending.enter(State.STOPPED, "workers released")

    async def _check_minimum(self) -> None:
        """Fail the run if fewer workers than the minimum are left in it: at once, as the
        one that leaves goes (a checkpoint then holds the last version of enough workers)."""
        if self.state is State.TRAINING and len(self._members) < self.config.min_workers:
            await self.fail(TooFewWorkers(
                live=len(self._members), minimum=self.config.min_workers, version=self.version,
                why="; ".join(self._errors) or "the others left or went silent",
                lost=tuple(f"{w['rank']} (at version {w['version']}, {w['phase']})"
                           for w in self.metrics.lost)))

    async def fail(self, why: str | TrainingError) -> None:
        """End the run with an error: checkpoint (to resume once workers are back), tell the
        workers to stop (so that none waits to reconnect to a coordinator that is not coming
        back), let them leave, then `run` raises TrainingError with `why` (said once, by
        whoever catches it: the CLI's last line)."""
        self._ending.fail(why)
        async with self._step_lock:
            if not isinstance(why, SteppedDown):  # (its versions since the cut are nobody's)
                await self.checkpoints.write(self.version)
            await self._stop(str(why))

    @property
    def failed(self) -> bool:
        """Whether the run is failing or failed (run() raises, or will, TrainingError)."""
        return self._ending.failure is not None

    async def _stop(self, why: str) -> None:
        self._ending.enter(State.STOPPING, why)
        self.metrics.ended = why
        # A failure is said to the workers too: theirs is not a run that ended well.
        stop = self._ending.answer(0, self.version)
        await self._parking.release(self._parking, version=self.version, stop=stop)
        await self._serving.publish(stop)
        if not isinstance(self._ending.failure, SteppedDown):  # (then the standby is the run)
            await self._standbys.ended(stop)

    async def _depart(self, member: Member, why: str, *, lost: bool = False,
                      warn: bool = False, finished: bool = False) -> None:
        """`member` is no longer in the run: `lost` (killed, silent), or left, said as a
        warning if `warn` (a worker interrupted, by a signal say: the run goes on smaller),
        or `finished` (its script's loop ended: the run ends once every one has); the run
        fails here if too few are left (`_check_minimum`)."""
        # A departed worker's kept update stays held: the strategy may still count it.
        self._members.remove(member)
        if self._directory is not None:  # (not sent to it by its neighbours any more)
            self._directory.forget(self.config.stage, member.rank, member.inbox)
        self.watch.left(member.rank)
        await self._parking.removed(member.rank, why)
        if lost:
            self._buffers.forget(member.rank)  # (its statistics are of the past now)
            self.metrics.lost.append(
                {"rank": member.rank, "version": member.version, "phase": member.phase}
            )
            self.metrics.write("lost", rank=member.rank, version=member.version,
                               phase=member.phase, clock=member.clock, why=why,
                               train_s=round(self.metrics.train_s(), 6))
            log.warning("%s %s", member.describe(), why)
            if self._serving.segments is not None:  # a killed worker's segments: unlinked by nobody else
                sweep()
            if self._on_lost is not None:
                await self._on_lost(member.rank, why)
        else:
            log.log(logging.WARNING if warn else logging.INFO, "%s %s", member.describe(), why)
        if finished:
            if not self._members and self._ending.running and not self._ending.stopping:
                await self._stop("every worker's script has ended")
            return
        await self._check_minimum()  # (as it goes: not at the next tick, trained on meanwhile)
        if self.state is State.TRAINING:
            await self._know_length()  # (it may have been the last shard not known)

    def status(self) -> Status:
        """What the run and each live worker are doing now (the status table)."""
        now = self._clock.monotonic()
        rows = []
        for member in sorted(self._members, key=lambda m: m.rank):
            parked = self._parking.get(member.rank)
            if parked is not None:
                state = "staleness" if parked.push else "start gate"
            else:
                state = _STATES.get(member.phase, member.phase)
            rows.append(self.watch.row(
                member.rank, state=state, seen_s=now - member.last_seen, clock=member.clock,
                version=member.version, behind=max(self.version - member.version, 0),
            ))
        return Status(state=self.state.value, version=self.version, target=self._length.steps,
                      samples=self.metrics.samples, train_s=self.metrics.train_s(),
                      loss=self.metrics.final_loss, workers=tuple(rows))

