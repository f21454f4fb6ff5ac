"""Bring your own training loop: `tensorbus.init()` and `DistributedOptimizer`.

A script keeps its loop (its argparse, its data, its logging, its checkpoints) and adds:

    ctx = tensorbus.init()
    optimizer = tensorbus.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)

`init` reads where this process stands from the launcher (nodes.cluster's conventions:
torchrun, Open MPI, Slurm; `tensorbus launch` sets torchrun's) and where the coordinator is
from TENSORBUS_COORDINATOR (tcp://HOST:PORT). Without either, the script runs as a world of
one and the optimizer steps as it always did. Where the coordinator has CURVE keys,
TENSORBUS_KEYS names the script's key directory and TENSORBUS_KEY_NAME its pair in it.

Behind `DistributedOptimizer`, a worker (nodes.worker) runs on a thread of its own with its
event loop: it describes the model and optimizer to the coordinator (nodes.description),
joins, loads the run's initial weights into the script's model, and follows the strategy's
rhythm. The script's thread plays the compute thread's part: where a SPEC worker computes a
step, this one hands the turn to the script and waits for its `step()`. So:

- gradient strategies (sync, backups, ssp, async): `step()` pushes the gradient that
  backward left in the model, and returns once the next weights are loaded into it (under
  async, pipelined: at once, on the newest weights seen). The coordinator holds the
  optimizer, built from the description, as for a SPEC run: sync is then one optimizer
  step on the mean gradient, the same arithmetic as single-process training on the
  combined batch.
- average: `step()` steps the script's own optimizer, and every H steps pushes the weights
  and loads their average.

Only the script's thread touches the model between its `step()`s; the worker's thread
touches it only while the script waits in `step()` (the two take turns: `_ScriptThread`).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import functools
import json
import logging
import math
import os
import queue
import sys
import threading
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tensorbus.bus.codec import decode, encode
from tensorbus.bus.deadline import at_most
from tensorbus.bus.errors import HandshakeError, PeerTimeoutError, RejectedError
from tensorbus.bus.layout import Compression
from tensorbus.bus.messages import Ack, Describe, Ready, Reject, RejectCode, Welcome
from tensorbus.bus.protocol import BUILD
from tensorbus.bus.security import ClientKeys, load_client_keys
from tensorbus.bus.transport import (
    HANDSHAKE_MECHANISM,
    HANDSHAKE_REFUSED,
    ZmqClient,
    new_event_loop,
)
from tensorbus.nodes.compute import ComputeThread, ScriptEnded
from tensorbus.nodes.config import WorkerConfig
from tensorbus.nodes.description import describe
from tensorbus.nodes.epochs import RankData
from tensorbus.nodes.link import RunFailedError
from tensorbus.nodes.run_length import RELAY
from tensorbus.nodes.version_chain import PendingVersion
from tensorbus.nodes.worker import Worker
from tensorbus.strategies.base import PushKind

log = logging.getLogger("tensorbus.worker")

COORDINATOR_VARIABLE = "TENSORBUS_COORDINATOR"  # tcp://HOST:PORT of the coordinator
KEYS_VARIABLE = "TENSORBUS_KEYS"  # CURVE: a key directory (`tensorbus keys`)
KEY_NAME_VARIABLE = "TENSORBUS_KEY_NAME"  # which pair of it is this script's (default: worker)


@dataclass(frozen=True)
class Context:
    """Where this process stands in the run."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    coordinator: str | None  # tcp://HOST:PORT; None: a world of one, no coordinator


_context: Context | None = None


def init(*, device: str | torch.device | None = None) -> Context:
    """This process's place in the run, from its launcher's variables and
    TENSORBUS_COORDINATOR; a world of one outside any launcher. `device`: where the model
    trains (default: cuda:LOCAL_RANK where CUDA is, else the CPU)."""
    global _context
    from tensorbus.run.cluster import placement  # (pure; run/ imports nodes/, not back)

    environ = os.environ
    found = placement(environ)
    coordinator = environ.get(COORDINATOR_VARIABLE) or None
    if coordinator is None and found.source != "flags" and (found.world_size or 1) > 1:
        raise ValueError(f"this process is rank {found.rank} of a {found.source} launch, and "
                         f"{COORDINATOR_VARIABLE} is not set: set it to the coordinator's "
                         "tcp://HOST:PORT (tensorbus launch sets it)")
    if coordinator is not None and (found.rank < 0 or found.world_size is None):
        raise ValueError(f"{COORDINATOR_VARIABLE} is set but no rank and world size are: "
                         "start the script with tensorbus launch, torchrun, srun or mpirun "
                         "(or set RANK and WORLD_SIZE)")
    if device is None:
        device = f"cuda:{found.local_rank}" if torch.cuda.is_available() else "cpu"
    _context = Context(rank=max(found.rank, 0), world_size=found.world_size or 1,
                       local_rank=found.local_rank, device=torch.device(device),
                       coordinator=coordinator)
    return _context


class _ScriptThread(ComputeThread):
    """The worker's compute thread, which is the script's own: the jobs the worker submits
    run on the script's thread, while it waits in step() (or in DistributedOptimizer()).

    A step's job is a generator (`_ScriptWorker._compute`): its first part loads the next
    weights and yields, and step() returns, the script's turn; the next step() resumes it,
    and it puts what the script computed in the outbox and ends, which the worker's loop
    hears as the compute done. Other jobs (setting up a session) run whole. Without a thread
    between them, a step costs no handover of the GIL more than a SPEC worker's."""

    def __init__(self) -> None:
        super().__init__("tensorbus-script")
        self._started = True  # (so that submit never starts the thread: the script runs the jobs)
        self._step: tuple[concurrent.futures.Future[Any], Generator[None, None, Any]] | None = None
        self.ended: BaseException | None = None  # the run is over for this script: why
        self.loss = 0.0  # what the script's last step() reported
        self.samples = 0  # samples the model took in training mode since the last step()

    def end(self, why: BaseException) -> None:
        """The worker's thread is over (why): the script's next wait raises it."""
        self.ended = why
        self._jobs.put(None)

    def step_done(self, error: BaseException | None = None) -> None:
        """On the script's thread: resume the step under way (with `error` thrown in: the
        script ended), which ends it or yields again (several local steps a push)."""
        if self._step is None:
            return
        future, steps = self._step
        try:
            steps.throw(error) if error is not None else next(steps)
        except StopIteration as stop:
            self._step = None
            future.set_result(stop.value)
        except BaseException as e:  # noqa: BLE001 - handed to the worker's loop
            self._step = None
            future.set_exception(e)

    def next_turn(self) -> None:
        """On the script's thread: run the worker's jobs until the next step's weights are
        in the model (its turn), or raise why the run is over for this script."""
        while self._step is None:
            if self.ended is not None:  # (said once in the queue, and kept here)
                raise self.ended
            try:
                job = self._jobs.get(timeout=0.2)
            except queue.Empty:
                continue
            if job is None:
                continue  # (shut down: the worker's thread says why next, in `ended`)
            future, work = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = work()
                if isinstance(result, Generator):
                    next(result)  # its first part: the weights loaded
                    self._step = (future, result)
                    return
            except StopIteration as stop:  # (a step of no part for the script)
                future.set_result(stop.value)
            except BaseException as e:  # noqa: BLE001 - handed to the worker's loop
                future.set_exception(e)
            else:
                future.set_result(result)


class ScriptFailed(Exception):
    """The script ended on an exception it did not catch: its worker leaves with it."""


class _ScriptWorker(Worker):
    """A worker whose steps are the script's: it hands the turn to the script where a SPEC
    worker would compute, and takes it back at the script's step()."""

    _COMPUTES_ON_SETS = False

    def __init__(self, *, model: nn.Module, optimizer: torch.optim.Optimizer, config: WorkerConfig,
                 script_thread: _ScriptThread) -> None:
        self._turns = script_thread
        super().__init__(model=model, data=lambda *_: [], loss=_no_loss, config=config)
        self._data = _ScriptData(lambda *_: [], self.device)  # (what pushes say of it)
        self._optimizer = optimizer
        # Each gradient set's learning rates, from the compute that filled it: read as its
        # push is made, by when the script may have stepped its scheduler (and computed on).
        self._set_lrs: dict[int, str] = {}
        self.weights_pushed = False

    async def _train(self, welcome: Welcome) -> None:
        if welcome.fragments:
            raise RejectedError(RejectCode.UNEXPECTED.value, (
                "the coordinator streams its averages in fragments (--fragments), which a "
                "script's own loop does not: start it without --fragments"))
        self.weights_pushed = PushKind(welcome.push) is PushKind.WEIGHTS
        if self.weights_pushed:
            self._local_steps.optimizer = self._optimizer  # the script steps it (average)
        await self._local_steps.configure(welcome, self.rank, weights_pushed=self.weights_pushed,
                                          off_loop=self._off_loop)
        # Counted in at the start gate; its data is the script's (it never says how much).
        await asyncio.gather(*(link.request(Ready(sender=self.rank, version=link.version,
                                                  batches=-2), patient=True)
                               for link in self.links))
        # Gradients pushed by reference, from shared memory, as a SPEC worker's are.
        compression = Compression.parse(welcome.compress)
        refer = (await self._off_loop(functools.partial(
            self._push_memory.gradients, self.flat, self.rank, dense=compression.dtype is None))
                 if not self.weights_pushed and compression.topk is None
                 and any(link.shared for link in self.links) else None)
        await self._loop(welcome, compression, self.weights_pushed, refer)

    def _new_compute_thread(self, name: str) -> ComputeThread:
        return self._turns  # (the script's thread: see _ScriptThread)

    def lrs_of(self, current: int) -> str:
        return self._set_lrs.get(current, "")

    def _compute(  # type: ignore[override]
        self, latest: list[PendingVersion | None], local_steps: int, current: int,
        announce: Callable[[int], None] | None, loaded: Callable[[], object] | None = None,
    ) -> Generator[None, None, tuple[float, int]]:
        """On the script's thread: load the newest weights, then yield to the script for
        `local_steps` of its steps, and put what they made in the outbox."""
        for i, link in enumerate(self.links):
            weights, latest[i] = latest[i], None
            if weights is not None:
                link.versions.load(weights)
            del weights
        if loaded is not None:
            loaded()
        outbox = self._local_steps.outbox
        assert outbox is not None
        outbox.anchor()  # (pushed weights, quantized: the change is taken from here)
        total, samples = 0.0, 0
        for _ in range(local_steps):
            self._turns.samples = 0
            yield  # the script's turn: forward, backward (and its own step, under average)
            total += self._turns.loss
            samples += self._turns.samples
            self._local_steps.count += 1
        # (Where the coordinator steps: with the script's rates, its scheduler's.)
        self._set_lrs[current] = json.dumps([float(g["lr"]) for g in self._optimizer.param_groups])
        if self.weights_pushed:
            outbox.fill_weights()
        else:
            self.flat.gather_grads()
            for i in range(len(self.links)):
                outbox.fill(i, current)
        return total / local_steps, samples


class _ScriptData(RankData):
    """The script's data is its own: how much there is, it never says."""

    @property
    def length(self) -> int:
        return RELAY  # (as a relay's: the run's length is not counted in its batches)


def _no_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # noqa: ARG001
    raise RuntimeError("an own loop computes its own loss")


class DistributedOptimizer(torch.optim.Optimizer):
    """`optimizer`, stepped as the run's strategy says (see the module docstring).

    A torch optimizer itself, over the wrapped one's parameter groups and state (the same
    objects): an LR scheduler made on either steps both. `backward_passes_per_step`: at
    most this many backward passes before each step(), whose gradients accumulate in the
    model as without tensorbus (scale each pass's loss for a mean) and are pushed as one;
    more raise at step(), as under Horovod (a step() forgotten). `reconnect_timeout_s`:
    how long, after losing the coordinator, to try to join it again (from when it was last
    heard) before step() raises PeerTimeoutError. Outside a run (a world of one), step() is
    the wrapped optimizer's."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module, *,
                 backward_passes_per_step: int = 1, reconnect_timeout_s: float = 60.0) -> None:
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be at least 1, got "
                             f"{backward_passes_per_step}")
        # (Optimizer.__init__ is not called: its groups and state are the wrapped one's.)
        self.defaults = optimizer.defaults
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.optimizer = optimizer
        self.model = model
        self.backward_passes_per_step = backward_passes_per_step
        self._passes = 0  # backward passes since the last step()
        if backward_passes_per_step > 1:  # (counted by one parameter's accumulated gradient)
            counted = next((p for p in model.parameters() if p.requires_grad), None)
            if counted is not None:
                counted.register_post_accumulate_grad_hook(self._count_pass)
        context = _context or init()
        self.context = context
        self._turns = _ScriptThread()  # the worker's compute thread: this one (see _ScriptThread)
        self._thread: threading.Thread | None = None
        self._worker: _ScriptWorker | None = None
        if context.coordinator is None:
            return  # a world of one
        model.to(context.device)
        described = describe(model, optimizer)
        config = WorkerConfig(connect=context.coordinator, rank=context.rank,
                              device=str(context.device), reconnect_timeout_s=reconnect_timeout_s,
                              keys=_keys(os.environ))
        self._worker = _ScriptWorker(model=model, optimizer=optimizer, config=config,
                                     script_thread=self._turns)
        # The samples a step trained on, for the run's figures: the first dimension of what
        # the model takes in training mode (a script's evaluation is in eval mode).
        model.register_forward_pre_hook(self._count_samples)
        flat = self._worker.flat  # the model's tensors now lie in its flat buffers
        self._describe = Describe(
            sender=context.rank, layout=flat.layout.digest, model=described, build=BUILD,
            tensors=flat.weights, state=flat.model_buffers.flat if flat.model_buffers else ())
        self._thread = threading.Thread(target=self._serve, name="tensorbus-worker", daemon=True)
        self._thread.start()
        atexit.register(self._at_exit)
        self._turns.next_turn()  # the run's initial weights are in the model now

    def _count_pass(self, _: torch.Tensor) -> None:
        self._passes += 1

    def _count_samples(self, module: nn.Module, inputs: tuple[Any, ...]) -> None:
        first = inputs[0] if inputs else None
        if module.training and isinstance(first, torch.Tensor) and first.dim() > 0:
            self._turns.samples += first.shape[0]

    def zero_grad(self, set_to_none: bool = True) -> None:
        if set_to_none and type(self.optimizer).zero_grad is torch.optim.Optimizer.zero_grad:
            # What torch's does, less its profiler's record: a tenth of a millisecond a step
            # on a small model, where a SPEC's worker spends a few microseconds.
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None
            return
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step of the run's strategy; the closure's loss, if one is given (it is
        reported to the coordinator)."""
        loss = closure() if closure is not None else None
        passes, self._passes = self._passes, 0
        if passes > self.backward_passes_per_step:
            raise RuntimeError(
                f"{passes} backward passes since the last step(), and backward_passes_per_step "
                f"is {self.backward_passes_per_step}: call step() after at most that many, or "
                "raise it")
        worker = self._worker
        if worker is None:
            self.optimizer.step()
            return loss
        if worker.weights_pushed:
            self.optimizer.step()  # a local step; the average comes every H of them
        self._turns.loss = float(loss) if loss is not None and math.isfinite(float(loss)) else 0.0
        self._turns.step_done()
        self._turns.next_turn()
        return loss

    def _at_exit(self) -> None:
        # An exception nobody caught ends the script: said to the coordinator as its error.
        uncaught = getattr(sys, "last_value", None)
        self.close(f"{type(uncaught).__name__}: {uncaught}" if uncaught is not None else "")

    def close(self, failed: str = "") -> None:
        """Leave the run (the script's loop is over; `failed`: with this error): called at
        exit if not before."""
        if self._thread is None or self._closed:
            return
        self._closed = True
        ended = ScriptFailed(failed) if failed else ScriptEnded()
        self._turns.step_done(ended)
        try:  # the worker's last jobs, until its thread ends (a step begun: ended too)
            while self._thread.is_alive():
                self._turns.next_turn()
                self._turns.step_done(ended)
        except BaseException:  # noqa: BLE001, S110 - its end: why is the worker's to say
            pass
        self._thread.join(timeout=30)
        failure = self._failure
        if failure is not None and not isinstance(failure, ScriptEnded):
            log.debug("the run ended with %r", failure)

    _failure: BaseException | None = None
    _closed = False

    def _serve(self) -> None:
        """The worker's thread: describe, join, follow the rhythm, until the script ends."""
        assert self._worker is not None
        loop = new_event_loop()
        try:
            loop.run_until_complete(self._run())
        except BaseException as e:  # noqa: BLE001 - handed to the script's thread
            self._failure = e
            self._turns.end(e if not isinstance(e, ScriptEnded) else RunFailedError(
                "the run ended for this script"))
        else:
            self._turns.end(RunFailedError("the run is over: the coordinator stopped it"))
        finally:
            loop.close()

    async def _run(self) -> None:
        worker = self._worker
        assert worker is not None
        config = worker.config
        await _describe(config.endpoints[0], self._describe, config.join_timeout_s, config.keys)
        await worker.run()


def _keys(environ: Mapping[str, str]) -> ClientKeys | None:
    """This script's CURVE keys, where TENSORBUS_KEYS names a key directory."""
    directory = environ.get(KEYS_VARIABLE)
    if not directory:
        return None
    return load_client_keys(Path(directory), environ.get(KEY_NAME_VARIABLE) or "worker")


async def _describe(endpoint: str, message: Describe, within_s: float,
                    keys: ClientKeys | None) -> None:
    """Tell the coordinator the model and optimizer, until it answers: Ack (it took
    them, or has the same model), or Reject (another model: RejectedError)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    peer = f"the coordinator at {endpoint}"
    client = ZmqClient(endpoint, max_message_bytes=1 << 20, keys=keys)

    def refused() -> None:
        problem = client.connection_problem()
        if problem in (HANDSHAKE_REFUSED, HANDSHAKE_MECHANISM):
            raise HandshakeError(peer, f"{problem} (a script's keys: the directory in "
                                       f"{KEYS_VARIABLE})") from None

    try:
        frames = encode(message)
        wait = 1.0
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise PeerTimeoutError(peer, "describe", within_s)
            try:
                # (The send too: a DEALER with no peer blocks in it, as once a refused
                # handshake has dropped its connection. A send cut short sent nothing.)
                await at_most(client.send(frames), min(wait, left))
                reply = decode(await at_most(client.recv(), min(wait, left)))
            except TimeoutError:
                refused()
                wait = min(wait * 2, 5.0)
                continue
            if isinstance(reply, Reject):
                raise RejectedError(reply.code, reply.detail)
            if isinstance(reply, Ack):
                return
    finally:
        client.close()
