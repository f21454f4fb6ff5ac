"""`launch_local`: a coordinator in this process and N worker processes on this machine.

Workers are real processes (`tensorbus worker ...`: forked from the launcher where that is
safe, see run.children, else `python -m tensorbus worker ...`) talking to the coordinator over tcp
loopback. Their output (stderr, and what they print) is relayed line by line to our
stderr with a `[worker R]` prefix. A worker that
fails with an error (its SPEC raised, say) ends the whole run at once with its one-line
error, since every worker would fail the same way; a worker killed by a signal (a crash,
injected or not) is removed at once and the run goes on with the others. Every worker is
reaped in `finally`, and each is also told by the kernel to die with this process
(PR_SET_PDEATHSIG), so none outlives a launcher that is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from tensorbus.bus.shared import sweep
from tensorbus.bus.transport import new_event_loop
from tensorbus.nodes.coordinator import Coordinator, Progress
from tensorbus.nodes.precision import Precision
from tensorbus.run.children import Forked, Forks, can_fork, spawn
from tensorbus.run.device import resolve as resolve_device
from tensorbus.run.export import save_model
from tensorbus.run.faults import parse_local
from tensorbus.run.options import RunOptions, final_model, make_coordinators, serve
from tensorbus.run.signals import stopping_on_signals
from tensorbus.run.spec import load_spec
from tensorbus.run.standby import StandbyFailed, StandbyProcess
from tensorbus.run.status import StatusTable

log = logging.getLogger("tensorbus.local")
Process = asyncio.subprocess.Process | Forked  # a worker: a fresh interpreter, or forked

ERROR_PREFIX = "error: "  # how a worker's last word starts (see run.cli)
REAP_TIMEOUT_S = 10.0


class LocalRunError(Exception):
    """The local run failed; the message is one line saying which process and why."""


def threads_per_worker(threads: int | None, workers: int) -> int:
    """Torch threads for each of `workers` processes on this machine: `threads` if given,
    else the cores shared out among them (at least one each)."""
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    return threads or max(1, (os.cpu_count() or 1) // workers)


def launch_local(
    spec: str | Path,
    options: RunOptions,
    *,
    on_step: Callable[[Progress], None] | None = None,
    threads: int | None = None,
    log_level: str = "warning",
    status: StatusTable | None = None,
    debug: bool = False,
    device: str = "cpu",
    fork: bool = False,
    standby: list[str] | None = None,
) -> dict[str, Any]:
    """Train with a coordinator here and `options.workers` worker processes; return the summary.
    With `status`, the per-worker table is shown as it says (see `run.status`). `device`:
    as `--device` (auto and cuda put worker R on GPU R mod the number of GPUs). With
    `fork`, the workers are forked from this process where that is safe (run.children):
    the CLI's, whose process is its own; a caller of this function may hold threads or
    state a fork would copy, so it gets fresh interpreters unless it asks. `standby`: start
    a standby coordinator (run.standby) with these options, before the workers."""
    if standby is not None and (options.colocate or options.shards > 1 or options.pipeline > 1):
        raise ValueError("--standby follows one central coordinator: drop --colocate, --shards "
                         "and --pipeline, or --standby")
    count = torch.cuda.device_count() if device != "cpu" else 0
    devices = [resolve_device(device, rank % max(count, 1)) for rank in range(options.workers)]
    if options.precision == Precision.FP16.value and "cpu" in devices:
        raise ValueError("--precision fp16-mixed needs CUDA, and "
                         + ("this machine has none" if count == 0 else "--device puts workers on the CPU")
                         + ": use bf16-mixed (or the GPUs)")
    if options.pipeline > 1 and any(d != "cpu" for d in devices):
        raise ValueError("--pipeline runs its stages on the CPU only, for now (a stage's "
                         "activations are not yet moved to and from a GPU): give --device cpu")
    # With --colocate this process is worker 0: the others are processes; a standby is one
    # process more.
    processes = options.workers - (1 if options.colocate else 0) + (1 if standby is not None else 0)
    forks = fork_children(processes, devices) if fork else None
    try:
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            if options.colocate:
                from tensorbus.run.colocated import launch_colocated  # it builds on this module

                per_worker = threads_per_worker(threads, options.workers)
                torch.set_num_threads(per_worker)  # this process is worker 0
                return runner.run(launch_colocated(str(spec), options, on_step, per_worker,
                                                   log_level, status, debug, devices, forks))
            if options.pipeline > 1:
                from tensorbus.run.pipelines import launch_pipelines  # it builds on this module

                return runner.run(launch_pipelines(str(spec), options, on_step, threads,
                                                   log_level, status, debug, devices, forks))
            return runner.run(_launch(str(spec), options, on_step, threads, log_level, status,
                                      debug, devices, forks, standby))
    finally:
        if forks is not None:
            forks.close()


def fork_children(count: int, devices: list[str]) -> Forks | None:
    """`count` children forked now (run.children), if that is safe here."""
    if not can_fork(devices):
        return None
    # Every run builds torch optimizers (the coordinator's or its shards', or each of
    # average's workers'), and the first one in a process imports torch._dynamo: 1 s of
    # CPU. Here, once, before the children are forked.
    importlib.import_module("torch._dynamo")
    return Forks(count)


async def _launch(
    spec_source: str,
    options: RunOptions,
    on_step: Callable[[Progress], None] | None,
    threads: int | None,
    log_level: str,
    status: StatusTable | None,
    debug: bool,
    devices: list[str],
    forks: Forks | None,
    standby_options: list[str] | None = None,
) -> dict[str, Any]:
    spec = load_spec(spec_source)  # fail here, before any process starts
    coordinators = make_coordinators(spec, options, bind="tcp://127.0.0.1:0", on_step=on_step)
    endpoint = ",".join(c.bind() for c in coordinators)  # every shard's, in order
    per_worker = threads_per_worker(threads, options.workers)
    workers: list[Process] = []
    failure: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    relays = []
    faults = parse_local(options.faults, options.workers)
    run = serve(coordinators)
    if status is not None:  # the first shard's view: every shard sees the same workers
        run = status.around(coordinators[0], run)
    standby: StandbyProcess | None = None
    training: asyncio.Task[dict[str, Any]] | None = None
    if options.resume:  # a checkpoint refused in one line, before any worker starts
        for coordinator in coordinators:
            coordinator.checkpoints.check_resume()
    try:
        if standby_options is not None:
            # The coordinator runs (to take the standby's Follow) before any worker starts:
            # every version, the first too, is the standby's.
            training = asyncio.create_task(stopping_on_signals(coordinators, run))
            standby = await StandbyProcess.start(standby_options, coordinators[0],
                                                 within_s=options.join_timeout_s, forks=forks)
        for rank in range(options.workers):
            extra = [f"--fault={f}" for f in faults.get(rank, [])]
            if options.keys is not None:
                extra += ["--keys", str(options.keys)]
            if debug:
                extra.append("--debug")
            if not options.shared_memory:
                extra.append("--no-shared-memory")
            argv = ["worker", spec_source, "--connect", endpoint, "--rank", str(rank),
                    "--threads", str(per_worker), "--log-level", log_level,
                    "--device", devices[rank], *extra]
            workers.append(await forks.start(f"tb worker {rank}", "tensorbus", argv)
                           if forks is not None else await spawn(argv))
            relays.append(asyncio.create_task(_relay(rank, workers[-1], failure, coordinators)))
        if training is None:
            training = asyncio.create_task(stopping_on_signals(coordinators, run))
        either: set[asyncio.Future[Any]] = {training, failure}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if failure.done():
            training.cancel()
            await asyncio.gather(training, return_exceptions=True)
            raise LocalRunError(failure.result())
        summary = training.result()
        # A worker that never joined (the run was stopped while it started) is told nothing
        # by anyone: end it now, and give the others time to leave.
        joined = {rank for c in coordinators for rank, w in c.metrics.per_worker.items()
                  if w["joins"] > 0}
        await _reap([p for rank, p in enumerate(workers) if rank not in joined], timeout=0.0)
        await _reap(workers, timeout=REAP_TIMEOUT_S)
        # A worker that failed while the others finished (its shard was empty, say) still
        # fails the run: it did not train as asked. Its relay has its last word.
        await asyncio.wait(relays, timeout=REAP_TIMEOUT_S)
        if failure.done():
            raise LocalRunError(failure.result())
        if options.save is not None:
            save_model(final_model(spec, coordinators), options.save)
        return summary
    except StandbyFailed as e:
        raise LocalRunError(str(e)) from None
    finally:
        if training is not None and not training.done():
            training.cancel()
            await asyncio.gather(training, return_exceptions=True)
        elif training is None:
            run.close()  # (a coroutine never awaited: the run never began)
        if standby is not None:
            await standby.end()
        await _reap(workers, timeout=0.0)
        for relay in relays:
            relay.cancel()
        await asyncio.gather(*relays, return_exceptions=True)
        if any(p.returncode != 0 for p in workers):
            sweep()  # what workers killed here or before had in shared memory


async def _relay(
    rank: int, process: Process, failure: asyncio.Future[str],
    coordinators: list[Coordinator],
) -> None:
    """Copy a worker's output (stderr, with what it prints to stdout) to our stderr; if
    it fails, report its last word; if it is killed, have the coordinator go on without it."""
    output = process.stderr if process.stderr is not None else process.stdout
    assert output is not None
    last_error = ""
    tail: list[str] = []
    async for raw in output:
        line = raw.decode(errors="replace").rstrip()
        if line.startswith(ERROR_PREFIX):
            last_error = line[len(ERROR_PREFIX):]
            continue
        tail = (tail + [line])[-5:]
        if line.startswith(f"worker {rank} done: "):
            continue  # (its end, which the run's summary says for every worker)
        if not failure.done():
            print(f"[worker {rank}] {line}", file=sys.stderr, flush=True)
    code = await process.wait()
    if code != 0:
        sweep()  # what it had in shared memory, if it could not unlink it itself
    if code < 0:
        name = signal.Signals(-code).name
        why = f"was killed by {name}: removed; going on without it"
        removed = [await c.remove(rank, why) for c in coordinators]
        if any(removed):
            return
        # (A worker asked to leave, by SIGTERM or SIGINT, left: the run goes on smaller.)
        if not failure.done() and code not in (-signal.SIGTERM, -signal.SIGINT):
            failure.set_result(f"worker {rank} was killed by {name}")
        return
    if code != 0 and not failure.done() and not any(c.failed for c in coordinators):
        # (A worker that fails because the run failed says so; the coordinator's own
        # error is the one to report, and run() raises it.)
        why = last_error or (tail[-1] if tail else "no message")
        failure.set_result(f"worker {rank} failed (exit status {code}): {why}")


async def _reap(processes: Sequence[Process], *, timeout: float) -> None:
    """Wait up to `timeout` for processes to exit, then terminate, then kill what is left."""
    if timeout > 0:
        await wait_exits(processes, timeout)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if all(p.returncode is not None for p in processes):
            return
        signal_all(processes, sig)
        await wait_exits(processes, 3.0)


async def wait_exits(processes: Sequence[Process], timeout: float) -> None:
    """Wait up to `timeout` for every process still running to exit."""
    waits = [asyncio.ensure_future(p.wait()) for p in processes if p.returncode is None]
    if waits:
        await asyncio.wait(waits, timeout=timeout)
    for wait in waits:
        wait.cancel()


def signal_all(processes: Sequence[Process], sig: signal.Signals) -> None:
    """`sig` to each process still running."""
    for process in processes:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(sig)
