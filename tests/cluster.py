"""Test helper: a coordinator and workers started by hand as separate processes on loopback
(`tensorbus coordinator` and `tensorbus worker`, forked from the suite's zygote), their logs
and metrics, always reaped."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import zygote
from zygote import Forked

from tensorbus.bus.shared import creator_alive

ROOT = Path(__file__).resolve().parent.parent
DIGITS = ROOT / "examples" / "digits.py"
HEARTBEAT_S, TIMEOUT_S = 0.2, 2.0
LIVENESS = ["--heartbeat", str(HEARTBEAT_S), "--timeout", str(TIMEOUT_S)]
QUIET = ["--threads", "1", "--log-level", "warning"]


LISTENING = re.compile(r"listening on (tcp://\S+) \(broadcasts on port (\d+)\)")
ANY_PORT = "tcp://127.0.0.1:0"  # the coordinator binds a free port, and keeps it


def bound(process: Forked | subprocess.Popen[str], metrics: Path,
          timeout: float = 30.0) -> tuple[str, int]:
    """The endpoint and broadcast port of a coordinator started with `--bind ANY_PORT`
    and `--metrics`, from its first record. (A number picked beforehand, by binding port 0
    and closing it, could be taken by another test before the coordinator binds it.)"""
    return _wait(process, timeout, lambda: next(
        ((r["endpoint"], r["pub_port"]) for r in _records(metrics) if r["event"] == "listening"),
        None))


def bound_in_log(process: Forked | subprocess.Popen[str], log: Path,
                 timeout: float = 30.0) -> tuple[str, int]:
    """As `bound`, from the "listening on" line of a node whose log (level info) is `log`:
    for a relay, which writes no metrics."""
    def found() -> tuple[str, int] | None:
        match = LISTENING.search(log.read_text()) if log.exists() else None
        return (match.group(1), int(match.group(2))) if match else None
    return _wait(process, timeout, found)


def _wait(process: Forked | subprocess.Popen[str], timeout: float,
          found: Callable[[], tuple[str, int] | None]) -> tuple[str, int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        at = found()
        if at is not None:
            return at
        if process.poll() is not None:
            raise AssertionError(f"the node ended ({process.returncode}) before it bound")
        time.sleep(0.02)
    raise AssertionError(f"the node did not bind within {timeout} s")


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


class Cluster:
    """A coordinator and workers started by hand on loopback; every process is reaped."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.spec = tmp_path / "digits.py"
        shutil.copy(DIGITS, self.spec)
        # Known once the first coordinator has bound (a restarted one binds them again).
        self.port: int | None = None
        self.pub_port: int | None = None
        self.endpoint = ""
        self.metrics = tmp_path / "metrics.jsonl"
        self.coordinator: Forked | None = None
        self.workers: dict[int, Forked] = {}
        self._all: list[Forked] = []

    def _bind_args(self) -> list[str]:
        """--bind and --pub-port: free ports chosen by the first coordinator, then its own."""
        if self.port is None:
            return ["--bind", ANY_PORT]
        return ["--bind", self.endpoint, "--pub-port", str(self.pub_port)]

    def _learn_ports(self) -> None:
        if self.port is None:
            assert self.coordinator is not None
            self.endpoint, self.pub_port = bound(self.coordinator, self.metrics)
            self.port = int(self.endpoint.rsplit(":", 1)[1])

    def _start(self, *args: str, log: str) -> Forked:
        with (self.tmp / log).open("a") as stderr:  # the child keeps its own descriptor
            process = zygote.shared().popen(args, cwd=ROOT, text=True,
                                            stdout=subprocess.PIPE, stderr=stderr)
        self._all.append(process)
        return process

    def start_coordinator(self, *args: str) -> None:
        self.coordinator = self._start(
            "coordinator", str(self.spec), *self._bind_args(), "--no-progress", "--json",
            "--metrics", str(self.metrics), *LIVENESS, *QUIET, *args, log="coordinator.log",
        )
        self._learn_ports()

    def start_worker(self, rank: int, *args: str) -> None:
        self.workers[rank] = self._start(
            "worker", str(self.spec), "--connect", self.endpoint, "--rank", str(rank),
            *QUIET, *args, log=f"worker-{rank}.log",
        )

    def records(self) -> list[dict[str, Any]]:
        return _records(self.metrics)

    def wait_for(self, what: str, test: Callable[[list[dict[str, Any]]], bool],
                 timeout: float = 60.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            records = self.records()
            if test(records):
                return records
            assert self.coordinator is not None
            if self.coordinator.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"no {what} within {timeout} s; logs:\n{self.logs()}")

    def finish(self, timeout: float = 60.0) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Wait for the coordinator to end well (stopped by a signal, it dies of it once it
        has stopped gracefully); return its summary and all records."""
        assert self.coordinator is not None
        out, _ = self.coordinator.communicate(timeout=timeout)
        summary = json.loads(out) if out.startswith("{") else {}
        assert summary.get("event") == "summary", self.logs()
        stopped = summary["stopped_by"]
        assert self.coordinator.returncode == (-signal.Signals[stopped] if stopped else 0), \
            self.logs()
        return summary, self.records()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted(self.tmp.glob("*.log")))

    def reap(self) -> None:
        for process in self._all:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=10)
            if process.stdout is not None:
                process.stdout.close()


@contextmanager
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.reap()


def steps(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r["event"] == "step"]


def version(records: list[dict[str, Any]]) -> int:
    done = steps(records)
    return done[-1]["version"] if done else 0


def segments() -> set[Path]:
    """This machine's tensorbus shared-memory segments (bus.shared)."""
    return set(Path("/dev/shm").glob("tensorbus-*"))


def leaked(before: set[Path], wait_s: float = 3.0) -> set[Path]:
    """Segments made since `before` whose creators are gone (a leak): those of processes
    still running, other tests' beside this one say, are not. Waits up to `wait_s` for the
    sweeps that unlink a killed process's."""
    deadline = time.monotonic() + wait_s
    while True:
        gone = {p for p in segments() - before if p.exists() and not creator_alive(p.name)}
        if not gone or time.monotonic() > deadline:
            return gone
        time.sleep(0.1)
