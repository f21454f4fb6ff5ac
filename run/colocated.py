"""`tensorbus local --colocate`: every worker process also serves one coordinator shard.

This process is worker 0 with shard 0, so that the progress line, the status table, the
metrics and the summary (with the evaluation of the final model) are where `local` has
them. Workers 1..N-1 are processes, `python -m tensorbus.run.colocated`, that read their orders as
one JSON line on stdin, bind their shard on a random loopback port, say where as one JSON
line on stdout, read every shard's address as a second line, and train (nodes.colocated).
Their stderr is relayed with a `[worker R]` prefix, as `local` does.

Every process holds a shard of the model, so a worker that fails or dies ends the run with
its one-line error: the others cannot go on without its part. Ctrl-C or SIGTERM here stops
every shard gracefully at one version (told to the others as a further line on stdin, which
each acknowledges on stdout), each checkpointing there with --checkpoint-dir, so that
`--resume` finds checkpoints that fit together; a second one interrupts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import sys
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from tensorbus.bus.security import load_client_keys
from tensorbus.bus.transport import new_event_loop
from tensorbus.nodes.config import WorkerConfig
from tensorbus.nodes.coordinator import Coordinator, Progress
from tensorbus.run.children import Forks, die_with_parent
from tensorbus.run.export import save_model
from tensorbus.run.faults import parse_local, parse_worker
from tensorbus.run.local import (
    ERROR_PREFIX,
    REAP_TIMEOUT_S,
    LocalRunError,
    Process,
    _reap,
    _relay,
)
from tensorbus.run.memory import keep_freed_memory
from tensorbus.run.options import RunOptions, make_colocated
from tensorbus.run.signals import stopping_on_signals
from tensorbus.run.spec import error_line, load_spec
from tensorbus.run.status import StatusTable

KEY_NAME = "worker"  # the key pair `tensorbus keys` makes for workers, as `local` uses
STARTUP_S = 120.0  # how long a worker process may take to import, build and bind
TOLD_S = 10.0  # how long shard 0 waits for the others to acknowledge a stop's version
T = TypeVar("T")


async def launch_colocated(
    spec_source: str,
    options: RunOptions,
    on_step: Callable[[Progress], None] | None,
    threads: int,
    log_level: str,
    status: StatusTable | None,
    debug: bool,
    devices: list[str],
    forks: Forks | None = None,
) -> dict[str, Any]:
    """Train with `options.workers` colocated workers, this process being worker 0; the
    others forked from `forks` where given (run.children), else fresh interpreters."""
    spec = load_spec(spec_source)  # fail here, before any process starts
    node = make_colocated(spec, options, index=0, bind="tcp://127.0.0.1:0", on_step=on_step)
    endpoints = [node.bind()]
    children: list[Process] = []
    relays: list[asyncio.Task[None]] = []
    shards: _Shards | None = None
    failure: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    try:
        for rank in range(1, options.workers):
            child = await (forks.start(f"tb colocated {rank}", "tensorbus.run.colocated", [],
                                       stdin=True, stdout="pipe")
                           if forks is not None else _spawn())
            children.append(child)
            relays.append(asyncio.create_task(_relay(rank, child, failure, [])))
            orders = {"spec": spec_source, "options": _to_json(options), "index": rank,
                      "threads": threads, "log_level": log_level, "debug": debug,
                      "device": devices[rank]}
            _write_line(child, orders)
        for rank, child in enumerate(children, start=1):
            endpoints.append(await _endpoint(rank, child, failure))
        for child in children:
            _write_line(child, {"endpoints": endpoints})
        shards = _Shards(node.coordinator, children)
        relays += [asyncio.create_task(shards.read(rank, child))
                   for rank, child in enumerate(children, start=1)]
        config = worker_config(options, rank=0, endpoints=endpoints, device=devices[0])
        run = node.run(config)
        if status is not None:
            run = status.around(node.coordinator, run)
        # A signal stops every shard, at one version.
        training = asyncio.create_task(stopping_on_signals(shards, run))
        either: set[asyncio.Future[Any]] = {training, failure}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if failure.done():
            # The others cannot go on: ended at once, while our own side winds down (its
            # worker's goodbye to the lost shard waits out its timeout meanwhile).
            training.cancel()
            await asyncio.gather(training, _reap(children, timeout=0.0), return_exceptions=True)
            raise LocalRunError(_fatal(failure.result()))
        summary, _ = training.result()
        await _reap(children, timeout=REAP_TIMEOUT_S)
        await asyncio.wait(relays, timeout=REAP_TIMEOUT_S)
        if failure.done():
            raise LocalRunError(_fatal(failure.result()))
        if options.save is not None:
            save_model(node.model, options.save)
        return {**summary, "colocated": options.workers}
    finally:
        if shards is not None:
            shards.close()
        await _reap(children, timeout=0.0)
        for relay in relays:
            relay.cancel()
        await asyncio.gather(*relays, return_exceptions=True)


async def _spawn() -> asyncio.subprocess.Process:
    """`python -m tensorbus.run.colocated`, a fresh interpreter, as a worker of this launcher."""
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tensorbus.run.colocated",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, preexec_fn=die_with_parent,
        start_new_session=True,  # Ctrl-C reaches this process alone (see _Shards)
    )


def worker_config(options: RunOptions, *, rank: int, endpoints: list[str], device: str) -> WorkerConfig:
    """Worker `rank`'s configuration, as `local` gives its workers on their command line."""
    faults = parse_local(options.faults, options.workers).get(rank, [])
    keys = load_client_keys(options.keys, KEY_NAME) if options.keys is not None else None
    return WorkerConfig(connect=endpoints, rank=rank, device=device, faults=parse_worker(faults),
                        join_timeout_s=options.join_timeout_s, keys=keys,
                        shared_memory=options.shared_memory)


class _Shards:
    """Stops every shard at the same version, so that their checkpoints fit together.

    Under sync and average a worker computes on a version only once every shard has
    published it, so no shard is more than one version from this one's: the next version
    after this shard's is one that none has passed and every one can reach. Until every
    other shard has that version to stop at (it says so on stdout), this one makes no
    version: were it to publish the next one meanwhile, a shard not yet told could make
    the one after (it did, on a loaded machine), and the checkpoints would not fit."""

    def __init__(self, own: Coordinator, children: list[Process]) -> None:
        self._own, self._children = own, children
        self._told: dict[int, asyncio.Event] = {id(c): asyncio.Event() for c in children}
        self._stopping: asyncio.Task[None] | None = None

    def request_stop(self, why: str) -> None:
        if self._stopping is None:
            self._stopping = asyncio.get_running_loop().create_task(self._stop(why))

    async def _stop(self, why: str) -> None:
        at: int | None = None
        try:
            async with self._own.versions_held():
                at = self._own.version + 1
                told = []
                for child in self._children:
                    if child.returncode is None:
                        # (One gone, or that ends meanwhile, says nothing: its relay says
                        # why the run ends.)
                        with contextlib.suppress(OSError, RuntimeError):
                            _write_line(child, {"stop": why, "at_version": at})
                            told.append(self._told[id(child)])
                waits = [asyncio.create_task(t.wait()) for t in told]
                try:
                    if waits:
                        await asyncio.wait(waits, timeout=TOLD_S)
                finally:
                    for wait in waits:
                        wait.cancel()
        finally:  # (whatever happened to the others, this shard stops)
            self._own.request_stop(why, at_version=at)

    def close(self) -> None:
        """The run is over: a stop still being told is not."""
        if self._stopping is not None:
            self._stopping.cancel()

    async def read(self, rank: int, child: Process) -> None:
        """Worker `rank`'s stdout after its address: its acknowledgements of a stop, and
        what its SPEC prints (to our stderr, as its log)."""
        assert child.stdout is not None
        async for raw in child.stdout:
            line = raw.decode(errors="replace").rstrip()
            if line.startswith('{"stopping_at"'):
                self._told[id(child)].set()
            else:
                print(f"[worker {rank}] {line}", file=sys.stderr, flush=True)


def _fatal(why: str) -> str:
    return (f"{why} (with --colocate every worker serves a shard of the model: the run "
            "cannot go on without it)")


def _write_line(child: Process, message: dict[str, Any]) -> None:
    assert child.stdin is not None
    child.stdin.write(json.dumps(message).encode() + b"\n")


async def _endpoint(rank: int, child: Process, failure: asyncio.Future[str]) -> str:
    """The address worker `rank` bound its shard at (its first line on stdout)."""
    assert child.stdout is not None
    reading = asyncio.ensure_future(child.stdout.readline())
    either: set[asyncio.Future[Any]] = {reading, failure}
    await asyncio.wait(either, timeout=STARTUP_S, return_when=asyncio.FIRST_COMPLETED)
    if failure.done():
        reading.cancel()
        raise LocalRunError(_fatal(failure.result()))
    if not reading.done():
        reading.cancel()
        raise LocalRunError(f"worker {rank} did not bind its shard within {STARTUP_S:.0f} s")
    line = reading.result()
    try:
        return str(json.loads(line)["endpoint"])
    except (ValueError, KeyError, TypeError):
        # It ended without saying (its relay has its last word), or said something else.
        await asyncio.wait({failure}, timeout=REAP_TIMEOUT_S)
        why = failure.result() if failure.done() else f"said {line[:200]!r}"
        raise LocalRunError(f"worker {rank} did not bind its shard: {why}") from None


def _to_json(options: RunOptions) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(options).items()}


def _from_json(fields: dict[str, Any]) -> RunOptions:
    paths = {f.name for f in dataclasses.fields(RunOptions) if "Path" in str(f.type)}
    fields = {k: Path(v) if k in paths and v is not None else v for k, v in fields.items()}
    return RunOptions(**{**fields, "faults": tuple(fields["faults"])})


def _child() -> int:
    """A worker process of `local --colocate` (see the module's docstring)."""
    try:
        orders = json.loads(sys.stdin.readline())
    except ValueError:
        print(f"{ERROR_PREFIX}python -m tensorbus.run.colocated is started by `tensorbus local "
              "--colocate`, which gives it its orders on stdin", file=sys.stderr)
        return 2
    logging.basicConfig(level=orders["log_level"].upper(), stream=sys.stderr, datefmt="%H:%M:%S",
                        format="%(asctime)s worker %(levelname)s %(message)s")
    torch.set_num_threads(orders["threads"])
    keep_freed_memory()
    try:
        options = _from_json(orders["options"])
        node = make_colocated(load_spec(orders["spec"]), options, index=orders["index"],
                              bind="tcp://127.0.0.1:0")
        print(json.dumps({"endpoint": node.bind()}), flush=True)
        line = sys.stdin.readline()
        if not line:
            raise LocalRunError("the launcher went away before sending the shards' addresses")
        endpoints = json.loads(line)["endpoints"]
        config = worker_config(options, rank=orders["index"], endpoints=endpoints,
                               device=orders["device"])
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            runner.run(_serve(node.coordinator, node.run(config)))
        return 0
    except Exception as e:  # one line for the launcher, as `worker` does
        if orders["debug"]:
            logging.getLogger("tensorbus.worker").exception("worker %d failed", orders["index"])
        print(f"{ERROR_PREFIX}{error_line(e, orders['spec'])}", file=sys.stderr, flush=True)
        return 1


async def _serve(coordinator: Coordinator, run: Awaitable[T]) -> T:
    """A child's run: stopped by the launcher's stop orders (further lines on stdin) or,
    if one is sent here directly, by a signal."""
    loop = asyncio.get_running_loop()
    threading.Thread(target=_read_stops, args=(loop, coordinator), daemon=True,
                     name="tensorbus-stop-orders").start()
    return await stopping_on_signals(coordinator, run)


def _read_stops(loop: asyncio.AbstractEventLoop, coordinator: Coordinator) -> None:
    """Hand each stop order from the launcher to the shard, until stdin closes."""
    def stop(why: str, at_version: int) -> None:
        coordinator.request_stop(why, at_version=at_version)
        print(json.dumps({"stopping_at": at_version}), flush=True)  # (see _Shards)

    for line in sys.stdin:
        order = json.loads(line)
        try:
            loop.call_soon_threadsafe(stop, order["stop"], order["at_version"])
        except RuntimeError:  # the loop is closed: the run is over
            return


if __name__ == "__main__":
    sys.exit(_child())
