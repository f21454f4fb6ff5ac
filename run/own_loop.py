"""The coordinator of scripts that bring their own training loop, and `tensorbus launch`.

Started without a SPEC, a coordinator has no model until a script describes its own
(nodes.own_loop sends a Describe before it joins): it binds its sockets, takes the first
Describe, builds the model's shell and its optimizer from it (nodes.description), loads
the script's initial weights into it, and becomes the run's coordinator on the same
sockets. Every rank joins it and loads its first version: all start from the first
script's weights. A later Describe is answered by the coordinator: the same model, or a
one-line refusal.

The run ends when every script has ended its loop (`until_workers_leave`), not at a number
of steps or epochs: those are the script's.

`launch` starts that coordinator in this process and N copies of the script beside it, each
with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK) and TENSORBUS_COORDINATOR, and
returns the coordinator's summary once they have all ended; if any script exited with an
error status (it raised), ScriptsFailed carries the summary and names them: the run went on
without them, as a run of `local` fails with a worker that failed. With --keys, the coordinator's
sockets take only the authorized keys, and each script is given the key directory in
TENSORBUS_KEYS. From the command line, the copies are forked from this process before it
starts anything (run.children), with torch imported already; where that is not safe, they
are fresh interpreters, `python SCRIPT`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from tensorbus.bus.codec import decode, encode
from tensorbus.bus.deadline import at_most
from tensorbus.bus.errors import WireError
from tensorbus.bus.messages import Ack, Describe, Reject, RejectCode
from tensorbus.bus.pieces import Received, whole
from tensorbus.bus.security import load_server_keys
from tensorbus.bus.shared import sweep
from tensorbus.bus.transport import ZmqServer, new_event_loop
from tensorbus.nodes.coordinator import Coordinator, Progress
from tensorbus.nodes.description import DescriptionError, build, build_optimizer
from tensorbus.nodes.ending import State
from tensorbus.nodes.failures import TrainingError
from tensorbus.nodes.flat import FlatModel
from tensorbus.nodes.own_loop import COORDINATOR_VARIABLE, KEYS_VARIABLE
from tensorbus.run.children import Forks
from tensorbus.run.local import Process, signal_all, wait_exits
from tensorbus.run.options import RunOptions, coordinator_config, make_strategy
from tensorbus.run.signals import cancel_on_signals, die_of
from tensorbus.strategies.base import PushKind

log = logging.getLogger("tensorbus.coordinator")

# The largest Describe taken: the model's initial weights ride in it (4 GiB: a billion
# float32 parameters). Only the first is read this way; later ones go to the coordinator.
MAX_DESCRIBE_BYTES = 1 << 32
END_S = 10.0  # how long a script may take to end, once the run has, before it is ended


class ScriptsFailed(TrainingError):
    """Some scripts exited with an error status while the run went on to its end without
    them: `summary` is the run's; the message names them (the first, and how many)."""

    def __init__(self, summary: dict[str, Any], failed: list[tuple[int, int]], scripts: int) -> None:
        rank, code = failed[0]
        more = f" ({len(failed)} of the {scripts} scripts failed)" if len(failed) > 1 else ""
        super().__init__(f"the script of rank {rank} exited with status {code} (its output says "
                         f"why); the run went on without it to its end{more}")
        self.summary = summary
        self.failed = failed


def check(options: RunOptions) -> None:
    """Refuse the options that are the script's to decide, in one line."""
    theirs = {"steps": "--steps", "epochs": "--epochs", "save": "--save",
              "checkpoint_dir": "--checkpoint-dir", "eval_every_s": "--eval-every",
              "eval_every_epochs": "--eval-every"}
    for field, flag in theirs.items():
        if getattr(options, field) is not None:
            raise ValueError(f"{flag}: a script that brings its own loop decides that itself "
                             "(its epochs, its evaluation, its checkpoints): drop it")
    if options.shards > 1 or options.colocate:
        raise ValueError("a script's own loop trains with one coordinator: drop --shards "
                         "and --colocate")
    if "fragments" in options.strategy_options:
        raise ValueError("--fragments: a script's own loop pushes the whole model at each "
                         "average, not fragments while it computes on: drop it")


async def first_description(server: ZmqServer, *, within_s: float) -> Describe:
    """The first Describe that comes to `server`, its tensors copied out of the frames."""
    endpoint = server.endpoint
    log.info("listening on %s (broadcasts on port %d), for the first script to describe its "
             "model", endpoint, server.pub_port)
    try:
        while True:
            peer, frames = await at_most(server.recv(), within_s)
            try:
                message = decode(frames, max_bytes=MAX_DESCRIBE_BYTES)
            except WireError as e:
                await server.send(peer, encode(Reject(request=e.request, code=e.code.value,
                                                      detail=str(e)[:1000])))
                continue
            if not isinstance(message, Describe):
                # (A Join before the model is known: its link asks again.)
                await server.send(peer, encode(Reject(
                    request=message.request, code=RejectCode.UNEXPECTED.value,
                    detail="this coordinator has no model yet: describe it first")))
                continue
            copied = dataclasses.replace(
                message, tensors=tuple(_copy(t) for t in message.tensors),
                state=tuple(_copy(t) for t in message.state))
            await server.send(peer, encode(Ack(request=message.request)))
            return copied
    except TimeoutError:
        raise TrainingError(f"no script described its model to {endpoint} within "
                            f"{within_s:.0f} s: is any running, with {COORDINATOR_VARIABLE}="
                            f"{endpoint}?") from None


def _copy(received: Received) -> torch.Tensor:
    """Out of the frames: a tensor over them is copied; pieces joined are a copy already."""
    joined = whole(received)
    return joined.clone() if joined is received else joined


def own_loop_coordinator(
    described: Describe, options: RunOptions, server: ZmqServer, *,
    on_step: Callable[[Progress], None] | None = None,
) -> Coordinator:
    """The run's coordinator for the model and optimizer `described`, starting from the
    weights it carries, serving on `server`."""
    shell, optimizer = build(described.model)
    flat = FlatModel(shell)
    if flat.layout.digest != described.layout:
        raise DescriptionError(f"the described model's layout is {flat.layout.digest}, and the "
                               f"script said {described.layout}: report this, it is a bug")
    flat.load(described.tensors)
    if flat.model_buffers and described.state:
        flat.model_buffers.load(described.state)
    strategy = make_strategy(options)
    if strategy.rhythm.push is PushKind.GRADIENT and optimizer is None:
        raise DescriptionError(
            f"under {strategy.name} the coordinator steps the script's optimizer, and none "
            "was described: give DistributedOptimizer one of torch.optim's optimizers, or "
            "choose --strategy average")
    config = dataclasses.replace(
        coordinator_config(options, bind=server.endpoint, pub_port=server.pub_port),
        steps=None, epochs=None, until_workers_leave=True)
    coordinator = Coordinator(
        model=shell, strategy=strategy, config=config,
        optimizer=(lambda params: build_optimizer(optimizer, list(params))) if optimizer else None,
        on_step=on_step, server=server)
    return coordinator


async def serve(options: RunOptions, *, bind: str, pub_port: int | None = None,
                on_step: Callable[[Progress], None] | None = None,
                bound: Callable[[str], None] | None = None,
                made: Callable[[Coordinator], None] | None = None) -> dict[str, Any]:
    """Wait for the first script's model, then coordinate the run until every script has
    ended; the summary. `bound`: told the endpoint once bound; `made`: the coordinator."""
    keys = load_server_keys(options.keys) if options.keys is not None else None
    server = ZmqServer(bind, max_message_bytes=MAX_DESCRIBE_BYTES, pub_port=pub_port, keys=keys)
    try:
        if bound is not None:
            bound(server.endpoint)
        described = await first_description(server, within_s=options.join_timeout_s)
        coordinator = own_loop_coordinator(described, options, server, on_step=on_step)
    except BaseException:
        server.close()
        raise
    if made is not None:
        made(coordinator)
    return await coordinator.run()


def launch(script: str | Path, options: RunOptions, script_args: Sequence[str] = (), *,
           bind: str = "tcp://127.0.0.1:0", threads: int | None = None,
           forks: Forks | None = None) -> dict[str, Any]:
    """Run `script` N times beside a coordinator of its model (see the module docstring);
    the coordinator's summary. A script that fails is said in its own output; the run goes
    on without it, and ScriptsFailed says so at the end. `forks`: N children to run the
    copies in (else fresh interpreters)."""
    signalled: list[signal.Signals] = []
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        try:
            return runner.run(_launch(Path(script), options, list(script_args), bind, threads,
                                      forks, signalled))
        except asyncio.CancelledError:
            if not signalled:
                raise
    if signalled[0] == signal.SIGINT:
        raise KeyboardInterrupt
    die_of(signalled[0])  # (as `local` ends on one: by it, once all is ended)
    raise AssertionError("unreachable")


async def _start(script: Path, script_args: list[str], environ: dict[str, str],
                 threads: int | None, forks: Forks | None, rank: int) -> Process:
    """A copy of the script, its output the launcher's own: forked, or `python SCRIPT`."""
    if forks is not None:
        return await forks.start(f"tb script {rank}", str(script), script_args, stdout="inherit",
                                 script=True, environ=environ, threads=threads)
    return await asyncio.create_subprocess_exec(
        sys.executable, str(script), *script_args, env={**os.environ, **environ},
        stdin=asyncio.subprocess.DEVNULL)


async def _launch(script: Path, options: RunOptions, script_args: list[str], bind: str,
                  threads: int | None, forks: Forks | None,
                  signalled: list[signal.Signals]) -> dict[str, Any]:
    undo = cancel_on_signals(signalled)
    try:
        return await _launched(script, options, script_args, bind, threads, forks, signalled)
    finally:
        undo()


async def _launched(script: Path, options: RunOptions, script_args: list[str], bind: str,
                    threads: int | None, forks: Forks | None,
                    signalled: list[signal.Signals]) -> dict[str, Any]:
    at: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    coordinators: list[Coordinator] = []
    served = asyncio.ensure_future(serve(options, bind=bind, bound=at.set_result,
                                         made=coordinators.append))
    either: set[asyncio.Future[Any]] = {at, served}
    await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    if served.done():
        return served.result()  # (it could not bind: raises)
    endpoint = at.result()
    environ = {COORDINATOR_VARIABLE: endpoint, "WORLD_SIZE": str(options.workers),
               "LOCAL_WORLD_SIZE": str(options.workers), "MASTER_ADDR": "127.0.0.1"}
    if threads is not None:
        environ["OMP_NUM_THREADS"] = str(threads)
    if options.keys is not None:  # each script's pair: the key directory's `worker`
        environ[KEYS_VARIABLE] = str(options.keys)
    scripts: list[Process] = []
    watch: asyncio.Future[None] | None = None
    try:
        for r in range(options.workers):
            scripts.append(await _start(script, script_args, {
                **environ, "RANK": str(r), "LOCAL_RANK": str(r)}, threads, forks, r))
        watch = asyncio.ensure_future(_watch(scripts, coordinators))
        await asyncio.wait({served, watch}, return_when=asyncio.FIRST_COMPLETED)
        if watch.done() and not served.done():
            # (Raises where every script ended before any described its model; where one
            # ended before it joined, the coordinator was failed and `served` raises.)
            watch.result()
        summary = await served
    finally:
        if watch is not None:
            watch.cancel()
        # The scripts first: one ending on Ctrl-C leaves the run, which needs its coordinator.
        await _end(scripts, signalled)
        if not served.done():
            served.cancel()
            await asyncio.gather(served, return_exceptions=True)
    # (Killed scripts were removed, as `local`'s killed workers are: the summary's `lost`.)
    failed = [(rank, p.returncode) for rank, p in enumerate(scripts)
              if p.returncode is not None and p.returncode > 0]
    if failed:
        raise ScriptsFailed(summary, failed, len(scripts))
    return summary


async def _end(scripts: list[Process], signalled: list[signal.Signals]) -> None:
    """Every script ended: each given END_S to end by itself (it may be writing its last
    output, or handling Ctrl-C, which reached it too from the terminal), then SIGTERM, then
    SIGKILL. A SIGTERM to this launcher goes on to them at once."""
    if signalled and signalled[0] == signal.SIGTERM:
        signal_all(scripts, signal.SIGTERM)
    for then in (signal.SIGTERM, signal.SIGKILL, None):
        if all(p.returncode is not None for p in scripts):
            break
        await wait_exits(scripts, END_S)
        if then is not None:
            signal_all(scripts, then)
    if any(process.returncode != 0 for process in scripts):
        sweep()  # the shared memory of scripts that died: nobody else would unlink it


async def _watch(scripts: list[Process], coordinators: list[Coordinator]) -> None:
    """Remove a script that died from the run at once (its traceback, if any, is in its own
    output), rather than after --timeout of silence."""
    said: set[int] = set()
    while True:
        await asyncio.sleep(0.2)
        if not coordinators and all(process.returncode is not None for process in scripts):
            raise TrainingError("every script ended before any described its model (their "
                                "output says why): does each create a DistributedOptimizer?")
        for rank, process in enumerate(scripts):
            code = process.returncode
            if code == 0 and rank not in said and coordinators:
                # (One that left, as its end does, is no member: this one ended without.)
                said.add(rank)
                await coordinators[0].remove(rank, "(its script) ended without leaving the run: removed")
            if code not in (None, 0) and rank not in said:
                said.add(rank)
                why = (f"died of {signal.Signals(-code).name}" if code < 0
                       else f"exited with status {code}")
                if coordinators and await coordinators[0].remove(rank, f"(its script) {why}: removed"):
                    continue
                if not coordinators or coordinators[0].state is State.STARTING:
                    failure = TrainingError(
                        f"the script of rank {rank} {why} before it joined (its output says "
                        f"why): the run cannot start with {len(scripts)} workers")
                    if not coordinators:
                        raise failure
                    # Said to the scripts that joined, which end at once, as the run does.
                    await coordinators[0].fail(failure)
                    return
