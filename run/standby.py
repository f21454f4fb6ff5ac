"""`local --standby`: a standby coordinator beside a local run, a process of its own.

It is `tensorbus coordinator SPEC --standby-of ENDPOINT` with the run's options
(run.flags.as_argv), started once the run's coordinator listens and before any worker: the
workers start once it follows, so that every version is replicated to it from the first
(nodes.replication), forked from this process as the workers are where that is safe
(run.children). Its output goes to our stderr, each line after `[standby] `. It ends as
the run ends (the coordinator tells it); one still running then is ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from typing import Final

from tensorbus.bus.deadline import at_most
from tensorbus.nodes.coordinator import Coordinator
from tensorbus.run.children import Forked, Forks, spawn

log = logging.getLogger("tensorbus.local")
FOLLOW_POLL_S: Final = 0.05
END_S: Final = 10.0  # how long it may take to end once the run has


class StandbyFailed(Exception):
    """The standby ended before it followed the run's coordinator; the message says why."""


class StandbyProcess:
    def __init__(self, process: asyncio.subprocess.Process | Forked) -> None:
        self.process = process
        self.last = ""  # its last line, for an error
        self._relay = asyncio.create_task(self._copy())

    @classmethod
    async def start(cls, argv: list[str], coordinator: Coordinator, *, within_s: float,
                    forks: Forks | None = None) -> StandbyProcess:
        """Start it, following `coordinator` (forked from `forks` where given, as the
        workers are: run.children), and wait until it does (StandbyFailed if it ends first,
        or does not within `within_s`)."""
        command = ["coordinator", *argv, "--standby-of", coordinator.endpoint]
        standby = cls(await forks.start("tb standby", "tensorbus", command)
                      if forks is not None else await spawn(command))
        deadline = asyncio.get_running_loop().time() + within_s
        while not coordinator.standby:
            if standby.process.returncode is not None:
                await asyncio.wait({standby._relay}, timeout=1.0)
                raise StandbyFailed(f"the standby ended (exit status {standby.process.returncode}) "
                                    f"before it followed the coordinator: {standby.last or 'no message'}")
            if asyncio.get_running_loop().time() > deadline:
                await standby.end(0.0)
                raise StandbyFailed(f"the standby did not follow the coordinator within "
                                    f"{within_s:.0f} s: {standby.last or 'no message'}")
            await asyncio.sleep(FOLLOW_POLL_S)
        return standby

    async def _copy(self) -> None:
        # (Its stdout and stderr, in one pipe: a fresh one's stdout, a forked one's stderr.)
        output = self.process.stdout or self.process.stderr
        assert output is not None
        async for raw in output:
            line = raw.decode(errors="replace").rstrip()
            self.last = line
            print(f"[standby] {line}", file=sys.stderr, flush=True)

    async def end(self, within_s: float = END_S) -> int | None:
        """Wait up to `within_s` for it to end by itself, then end it; its exit status."""
        process = self.process
        if process.returncode is None:
            with contextlib.suppress(TimeoutError):
                await at_most(process.wait(), within_s)
        if process.returncode is None:
            log.warning("the standby did not end with the run: ending it")
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGKILL)
            await process.wait()
        await asyncio.wait({self._relay}, timeout=1.0)
        self._relay.cancel()
        return process.returncode
