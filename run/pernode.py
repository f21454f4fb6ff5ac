"""`tensorbus worker --workers-per-node G`: G worker processes on this node, one per GPU.

Worker l (from 0) is `tensorbus worker SPEC --rank NODE_RANK*G+l ...` with LOCAL_RANK=l in its
environment (see `run.cluster.child_environment`): forked from this process where that is
safe (no GPU: run.children, as `tensorbus local`'s workers), else a fresh interpreter. Each
stays in this process's group, so Ctrl-C in the terminal reaches it; a SIGTERM to this
process is passed on. Their stderr is relayed line by line with a `[worker R]` prefix. The
workers train independently of each other, so one that fails does not stop the rest (the
coordinator drops a lost worker and goes on); this process waits for them all and fails,
with the first failure's one-line error, if any did. Every worker is reaped, and each is
told by the kernel to die with this process (PR_SET_PDEATHSIG), as `run.local` does.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Mapping, Sequence

from tensorbus.bus.transport import new_event_loop
from tensorbus.run.children import Forks, die_with_parent
from tensorbus.run.cluster import child_environment
from tensorbus.run.device import resolve as resolve_device
from tensorbus.run.local import (
    ERROR_PREFIX,
    LocalRunError,
    Process,
    _reap,
    fork_children,
    signal_all,
    threads_per_worker,
    wait_exits,
)
from tensorbus.run.signals import cancel_on_signals, die_of
from tensorbus.run.spec import load_spec

GRACE_S = 5.0  # after an interruption, how long the workers get to leave on their own
RELAY_S = 2.0  # then, how long their output may take to be relayed to its end
HEARD_S = 1.0  # how long workers that heard a Ctrl-C take to leave, at most (a few ms, seen)


class NodeRunError(LocalRunError):
    """A worker of this node failed; the message is one line saying which and why."""


def launch_node(
    spec: str,
    *,
    workers: int,
    node_rank: int,
    connect: str,
    device: str,
    threads: int | None,
    flags: Sequence[str],
    environ: Mapping[str, str],
) -> None:
    """Run `workers` worker processes with ranks node_rank*workers + l until all have
    exited; NodeRunError if any failed. `flags` go to every worker as they are."""
    if workers < 1:
        raise ValueError(f"--workers-per-node must be at least 1, got {workers}")
    per_worker = threads_per_worker(threads, workers)
    devices = [resolve_device(device, local) for local in range(workers)]
    commands = []
    for local in range(workers):
        rank = node_rank * workers + local
        argv = ["worker", spec, "--connect", connect, "--rank", str(rank), "--device",
                devices[local], "--threads", str(per_worker), *flags]
        commands.append((rank, argv, child_environment(
            environ, rank=rank, local_rank=local, local_world_size=workers,
            node_rank=node_rank)))
    # Forked before the SPEC is loaded here, as `local`'s workers are: each worker imports
    # it afresh, with its own rank in its environment.
    forks = fork_children(workers, devices)
    signalled: list[signal.Signals] = []
    try:
        load_spec(spec)  # a SPEC error once, here, rather than from every worker
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            failures = runner.run(_launch(commands, forks, signalled))
    except asyncio.CancelledError:
        if not signalled:
            raise
    finally:
        if forks is not None:
            forks.close()
    if signalled:  # the workers have left and their last lines are relayed: die of it
        die_of(signalled[0])
    if failures:
        more = f" ({len(failures)} of this node's {workers} workers failed)" \
            if len(failures) > 1 else ""
        raise NodeRunError(failures[0] + more)


async def _launch(commands: list[tuple[int, list[str], dict[str, str]]],
                  forks: Forks | None, signalled: list[signal.Signals]) -> list[str]:
    """Start every worker (`tensorbus ARGV` in its environment), wait for all; their
    failures, one line each, in rank order. Ctrl-C or SIGTERM cancel this (`signalled`
    says which), once the workers have left and what they said last is relayed."""
    processes: list[Process] = []
    relays: list[asyncio.Task[str | None]] = []
    undo = cancel_on_signals(signalled)
    try:
        for rank, argv, env in commands:
            # stdout is ours (what a SPEC prints shows); stderr is relayed.
            process: Process
            if forks is not None:
                # (In this process group, as a subprocess: Ctrl-C reaches it, see below.)
                process = await forks.start(
                    f"tb worker {rank}", "tensorbus", argv, stdout="launchers", environ=env,
                    unset=[name for name in os.environ if name not in env], session=False)
            else:
                process = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "tensorbus", *argv, env=env,
                    stdin=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
                    preexec_fn=die_with_parent)
            processes.append(process)
            relays.append(asyncio.create_task(_relay(rank, process)))
        # (Not gather: cancelled by Ctrl-C, it would cancel the relays, and with them the
        # last lines of the workers as they leave.)
        await asyncio.wait(relays)
        return [why for relay in relays if (why := relay.result()) is not None]
    finally:
        # Done: nothing is left. Interrupted: the workers got the Ctrl-C too (same process
        # group) and leave through their coordinator; a signal to this process alone is
        # passed on to them (a Ctrl-C after HEARD_S, to those that did not leave: a second
        # one would make a leaving worker's exit abrupt). What has not left in GRACE_S is
        # ended.
        if signalled:
            if signalled[0] == signal.SIGINT:
                await wait_exits(processes, HEARD_S)
            signal_all(processes, signalled[0])
        await _reap(processes, timeout=GRACE_S)
        if relays:  # what the workers said last, relayed before this process ends
            await asyncio.wait(relays, timeout=RELAY_S)
        for relay in relays:
            relay.cancel()
        await asyncio.gather(*relays, return_exceptions=True)
        undo()


async def _relay(rank: int, process: Process) -> str | None:
    """Copy a worker's stderr to ours; return why it failed, or None if it did not."""
    assert process.stderr is not None
    last_error = ""
    tail = ""
    async for raw in process.stderr:
        line = raw.decode(errors="replace").rstrip()
        if line.startswith(ERROR_PREFIX):
            last_error = line[len(ERROR_PREFIX):]
            continue
        tail = line or tail
        print(f"[worker {rank}] {line}", file=sys.stderr, flush=True)
    code = await process.wait()
    if code < 0:
        return f"worker {rank} was killed by {signal.Signals(-code).name}"
    if code != 0:
        return f"worker {rank} failed (exit status {code}): {last_error or tail or 'no message'}"
    return None
