"""Multi-host: the coordinator and each worker in a network namespace of its own, joined by
veth pairs through a bridge (see `netns`), so that they talk real TCP between distinct
addresses (10.211.0.1 for the coordinator, 10.211.0.10 and .11 for the workers), as on
separate machines. Nothing leaves those namespaces; they are made by each test and torn down
in its `finally`, and the tests skip, saying why, where `ip netns` is not permitted.

- With `--insecure`, a run across the namespaces trains to the end, each worker connected
  from its own address. (A non-loopback bind without `--insecure` or `--keys` is refused:
  tests/system/test_errors.py.)
- With CURVE keys, cutting one worker's link (its bridge port down) for twice the
  heartbeat timeout: the coordinator drops that worker for silence and trains on with the
  other; once the link is back the worker, which has meanwhile noticed the coordinator's
  silence, joins again under its rank and counts in later versions; the run finishes and
  every process exits 0. (This test found a livelock, now fixed: a worker rejoining while
  its broadcasts were still held up in TCP back-off pushed on a version already left
  behind, was dropped as late, and computed on that version again, forever.)
- A standby in a namespace of its own, cut off: it takes the run over while the coordinator
  drops it and trains on; once healed, the old coordinator steps down with its line and its
  workers move to the standby.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import zygote
from cluster import LIVENESS, QUIET, ROOT, TIMEOUT_S, Cluster, steps, version
from netns import COORDINATOR_ADDRESS, Network, network, worker_address
from zygote import Forked

pytestmark = [pytest.mark.timeout(120), pytest.mark.netns]

# Each namespace is new and empty: any port is free in it.
PORT = 5555

class NetCluster(Cluster):
    """`Cluster`, with the coordinator and each worker started in its own namespace."""

    def __init__(self, tmp_path: Path, net: Network) -> None:
        super().__init__(tmp_path)
        self.net = net
        self.port, self.pub_port = PORT, PORT + 1
        self.endpoint = f"tcp://{COORDINATOR_ADDRESS}:{PORT}"

    def _start_in(self, namespace: str, *args: str, log: str) -> Forked:
        with (self.tmp / log).open("a") as stderr:
            process = zygote.shared().popen(
                args, netns=namespace, cwd=ROOT, text=True, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=stderr)
        self._all.append(process)  # reaped with the rest
        return process

    def start_coordinator(self, *args: str) -> None:
        self.coordinator = self._start_in(
            self.net.coordinator, "coordinator", str(self.spec), "--bind", self.endpoint,
            "--pub-port", str(self.pub_port), "--no-progress", "--json", "--metrics",
            str(self.metrics), *LIVENESS, *QUIET, *args, log="coordinator.log",
        )

    def start_worker(self, rank: int, *args: str) -> None:
        self.workers[rank] = self._start_in(
            self.net.workers[rank], "worker", str(self.spec), "--connect", self.endpoint,
            "--rank", str(rank), *QUIET, *args, log=f"worker-{rank}.log",
        )

    def snapshot(self, moment: str) -> None:
        """Append every namespace's TCP connections to wire.log (shown with the logs)."""
        with (self.tmp / "wire.log").open("a") as wire:
            for namespace in (self.net.coordinator, *self.net.workers):
                wire.write(f"== {moment}: {namespace}\n{self.net.tcp(namespace)}\n")


@contextmanager
def net_cluster(tmp_path: Path, workers: int) -> Iterator[NetCluster]:
    """A namespace per node and a cluster across them: every process reaped, then the
    namespaces torn down."""
    with network(workers) as net:
        c = NetCluster(tmp_path, net)
        try:
            yield c
        finally:
            c.reap()


def _tensorbus(*args: str) -> subprocess.CompletedProcess[str]:
    """A short command that needs no network (`keys`), run here."""
    return zygote.shared().run(args, cwd=ROOT, capture_output=True, text=True, timeout=60)


def _lost(records: list[dict[str, Any]], rank: int) -> dict[str, Any] | None:
    return next((r for r in records if r["event"] == "lost" and r["rank"] == rank), None)


def test_a_shaped_link_carries_its_rate_and_no_more() -> None:
    """`Network.shape`, which benchmarks/slow_links.py trains over: 6 MB from a worker's
    namespace to the coordinator's at 40 Mbit/s take about 1.2 s; unshaped, a veth carries
    them many times faster."""
    rate_mbit, size = 40.0, 6_000_000
    receiver = ("import socket, sys, time\n"
                f"s = socket.create_server(('{COORDINATOR_ADDRESS}', {PORT}))\n"
                "print('listening', flush=True)\n"
                "c, _ = s.accept(); n = 0; start = time.monotonic()\n"
                "while (d := c.recv(1 << 20)):\n"
                "    n += len(d)\n"
                "print(n, time.monotonic() - start, flush=True)\n")
    sender = ("import socket\n"
              f"s = socket.create_connection(('{COORDINATOR_ADDRESS}', {PORT}))\n"
              f"s.sendall(bytes({size})); s.close()\n")
    with network(1) as net:
        net.shape(rate_mbit)
        listening = subprocess.Popen([*net.exec(net.coordinator), sys.executable, "-c", receiver],
                                     stdout=subprocess.PIPE, text=True)
        try:
            assert listening.stdout is not None and listening.stdout.readline() == "listening\n"
            subprocess.run([*net.exec(net.workers[0]), sys.executable, "-c", sender],
                           timeout=30, check=True)
            received, took = listening.communicate(timeout=30)[0].split()
        finally:
            if listening.poll() is None:
                listening.kill()
                listening.communicate()
    assert int(received) == size
    mbit = size * 8 / float(took) / 1e6
    assert 0.7 * rate_mbit < mbit < 1.1 * rate_mbit, f"{mbit:.1f} Mbit/s"


def test_an_insecure_run_trains_across_namespaces(tmp_path: Path) -> None:
    with net_cluster(tmp_path, workers=2) as c:
        run = ["--workers", "2", "--steps", "60", "--batch-size", "16"]
        c.start_coordinator(*run, "--insecure")
        for rank in range(2):
            c.start_worker(rank, "--fault", "slow:10")
        c.wait_for("version 5", lambda rs: version(rs) >= 5)
        # Each worker's two connections (requests and broadcasts) come from its own address.
        assert c.net.peers(c.port) == {worker_address(0), worker_address(1)}
        assert c.net.peers(c.pub_port) == {worker_address(0), worker_address(1)}
        summary, records = c.finish()
        assert summary["steps"] == 60 and summary["lost"] == []
        assert all(r["workers"] == [0, 1] for r in steps(records))
        for rank in range(2):
            assert c.workers[rank].wait(timeout=15) == 0, c.logs()


def test_a_worker_cut_off_longer_than_the_timeout_is_dropped_then_rejoins(
    tmp_path: Path,
) -> None:
    with net_cluster(tmp_path, workers=2) as c:
        keys = tmp_path / "keys"
        made = _tensorbus("keys", str(keys), "--worker", "w0", "--worker", "w1")
        assert made.returncode == 0, made.stderr
        # Open-ended (stopped below): worker 0 alone is still training when worker 1's
        # rejoin gets through (its join backs off: up to several seconds after the restore).
        c.start_coordinator("--workers", "2", "--steps", "100000", "--batch-size", "16",
                            "--strategy", "sync", "--keys", str(keys))
        for rank in range(2):
            c.start_worker(rank, "--fault", "slow:10", "--reconnect-timeout", "30",
                           "--keys", str(keys), "--key-name", f"w{rank}",
                           "--log-level", "info")  # info: its joins and dropped updates
        c.wait_for("version 5", lambda rs: version(rs) >= 5)
        assert c.net.peers(c.port) == {worker_address(0), worker_address(1)}
        c.snapshot("before the cut")

        c.net.cut(1)
        cut_at = time.monotonic()
        records = c.wait_for("worker 1 dropped", lambda rs: _lost(rs, 1) is not None, timeout=20)
        dropped = _lost(records, 1)
        assert dropped is not None and "silent" in dropped["why"], dropped
        dropped_at: float = dropped["train_s"]
        c.wait_for("a version made by worker 0 alone", lambda rs: any(
            r["workers"] == [0] and r["train_s"] > dropped_at for r in steps(rs)))
        time.sleep(max(0.0, cut_at + 2 * TIMEOUT_S - time.monotonic()))
        c.snapshot(f"cut for {time.monotonic() - cut_at:.1f} s")
        c.net.restore(1)
        restored_at = time.monotonic()

        c.wait_for("a version from both workers again", lambda rs: any(
            r["workers"] == [0, 1] and r["train_s"] > dropped_at for r in steps(rs)), timeout=30)
        rejoined_after = time.monotonic() - restored_at
        c.snapshot(f"rejoined {rejoined_after:.1f} s after the restore")
        assert c.coordinator is not None
        c.coordinator.send_signal(signal.SIGTERM)
        summary, records = c.finish()
        assert summary["stopped_by"] == "SIGTERM"
        # Lost at least once, and joined once more than lost: a rejoin right after the
        # restore may meet a connection still in TCP's retransmission back-off, go silent
        # again, and be dropped and rejoin once more (seen once in CI, on a loaded machine).
        lost = [w["rank"] for w in summary["lost"]]
        assert lost and set(lost) == {1}, summary["lost"]
        assert summary["per_worker"]["1"]["joins"] == len(lost) + 1, summary["per_worker"]
        assert summary["per_worker"]["0"]["joins"] == 1, summary["per_worker"]
        for rank in range(2):
            assert c.workers[rank].wait(timeout=15) == 0, c.logs()
        # Worker 1 noticed the coordinator's silence by itself (nothing could reach it to
        # say it was removed) and joined again; worker 0 never did.
        assert "worker 1 lost the coordinator" in (tmp_path / "worker-1.log").read_text()
        assert "joining again" not in (tmp_path / "worker-0.log").read_text(), c.logs()


def test_a_coordinator_cut_off_from_its_standby_steps_down_once_the_network_heals(
    tmp_path: Path,
) -> None:
    """The standby (in a namespace of its own) is cut off: it takes the run over, while the
    coordinator, still reaching its workers, drops it and trains on. Once the link is back,
    the standby's call makes the old coordinator step down with its line; its workers move
    to the standby, which then trains with both: one coordinator again."""
    with net_cluster(tmp_path, workers=3) as c:  # (the third namespace holds the standby)
        # (Namespaces share /dev/shm: without shared memory, as between hosts. A standby of
        # the same host would read a cut-off coordinator's weights where that one, alive,
        # goes on writing them, and refuse to take over from a torn copy.)
        run = ["--workers", "2", "--steps", "100000", "--batch-size", "16", "--strategy", "sync",
               "--insecure", "--no-shared-memory"]
        c.start_coordinator(*run)
        standby_at = f"tcp://{worker_address(2)}:{PORT}"
        standby_metrics = tmp_path / "standby.jsonl"
        standby = c._start_in(
            c.net.workers[2], "coordinator", str(c.spec), "--bind", standby_at, "--pub-port",
            str(PORT + 1), "--standby-of", c.endpoint, "--no-progress", "--json", "--metrics",
            str(standby_metrics), *LIVENESS, *QUIET, *run, log="standby.log")
        c.wait_for("the standby", lambda rs: any(r["event"] == "standby" for r in rs))
        for rank in range(2):
            c.start_worker(rank, "--fault", "slow:10", "--reconnect-timeout", "30",
                           "--no-shared-memory", "--log-level", "info")
        c.wait_for("version 5", lambda rs: version(rs) >= 5)

        c.net.cut(2)
        records = c.wait_for("the standby dropped", lambda rs: any(
            r["event"] == "standby_dropped" for r in rs), timeout=20)
        dropped_at = next(r for r in records if r["event"] == "standby_dropped")["wall_s"]
        c.wait_for("a version after the drop", lambda rs: any(
            r["event"] == "step" and r["wall_s"] > dropped_at for r in rs))
        taken_over = _records_of(standby_metrics, "takeover", within_s=20)
        c.net.restore(2)

        assert c.coordinator is not None
        assert c.coordinator.wait(timeout=30) == 1, c.logs()
        said = (tmp_path / "coordinator.log").read_text()
        assert "tensorbus: error: stepped down at version" in said
        assert f"the standby at {standby_at} took the run over (term 1)" in said
        # The workers moved: the standby trains with both of them.
        _records_of(standby_metrics, "step", within_s=30, where=lambda r: r["workers"] == [0, 1]
                    and r["version"] > taken_over["version"])
        standby.send_signal(signal.SIGTERM)
        out, _ = standby.communicate(timeout=30)
        summary = json.loads(out[out.index("{"):])
        assert summary["standby"]["term"] == 1 and summary["stopped_by"] == "SIGTERM"
        for rank in range(2):
            assert c.workers[rank].wait(timeout=15) == 0, c.logs()
            said = (tmp_path / f"worker-{rank}.log").read_text()
            assert f"the run moved to the coordinator at {standby_at}" in said, said[-2000:]


def _records_of(path: Path, event: str, *, within_s: float,
                where: Any = lambda r: True) -> dict[str, Any]:
    """The first `event` record of the metrics at `path` that `where` accepts, waited for."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        found = next((r for r in map(json.loads, lines) if r["event"] == event and where(r)), None)
        if found is not None:
            return found
        time.sleep(0.1)
    raise AssertionError(f"no {event} in {path} within {within_s} s")
