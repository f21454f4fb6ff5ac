"""Test helper: a private network of Linux network namespaces, made and torn down by a test.

One namespace for the coordinator and one per worker. The coordinator's namespace holds a
bridge (`br0`, 10.211.0.1/24, the only address the coordinator has besides loopback); each
worker's namespace is joined to it by its own veth pair: `eth0` (10.211.0.10 + rank) on the
worker's side, bridge port `w{rank}` on the coordinator's. No namespace has a default route
and nothing joins them to the host's network, so no test traffic can leave them.

Cutting a worker's link sets its bridge port down (a cable pulled at the switch): both ends
lose carrier, while the addresses stay where they are (the kernel keeps IPv4 addresses on a
link that goes down; `restore` checks that and puts them back if some kernel did not).

`shape(rate_mbit)` shapes every worker's link to a bandwidth, each way (a token bucket, `tc
tbf`, on the egress of both ends of its veth pair), as between machines on a slow network;
benchmarks/slow_links.py runs training over it (`made_network` outside pytest).

Names carry the test process's pid and a random suffix, so that parallel runs never collide;
namespaces of ours whose pid is gone (a run killed before its `finally`) are removed on the
next run. Where namespaces cannot be made (no `ip`, not root, no CAP_SYS_ADMIN in a
container) `network` skips the test and says why (`made_network` raises Unavailable).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Final

PREFIX: Final = "tbnet-"
SUBNET: Final = "10.211.0"
COORDINATOR_ADDRESS: Final = f"{SUBNET}.1"
BRIDGE: Final = "br0"
WORKER_LINK: Final = "eth0"


class Unavailable(Exception):
    """Namespaces (or shaping) cannot be made here; the message says why."""


class NetnsError(Exception):
    """An `ip` command failed; carries the command and what it said."""

    def __init__(self, command: list[str], stderr: str) -> None:
        super().__init__(f"{' '.join(command)}: {stderr.strip() or 'failed'}")
        self.command = command
        self.stderr = stderr


def ip(*args: str) -> str:
    """Run `ip ARGS`; its stdout, or NetnsError."""
    command = ["ip", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=20, check=False,
                          stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise NetnsError(command, done.stderr)
    return done.stdout


def worker_address(rank: int) -> str:
    return f"{SUBNET}.{10 + rank}"


def port_name(rank: int) -> str:
    return f"w{rank}"


@dataclass(frozen=True)
class Network:
    """Namespace names and addresses of one test's network."""

    coordinator: str  # the coordinator's namespace
    workers: tuple[str, ...]  # worker rank -> its namespace

    def exec(self, namespace: str) -> list[str]:
        """The prefix that runs a command inside `namespace` (`ip netns exec` execs it, so
        the process started is the command itself, and killing it kills the command)."""
        return ["ip", "netns", "exec", namespace]

    def cut(self, rank: int) -> None:
        ip("-n", self.coordinator, "link", "set", port_name(rank), "down")

    def restore(self, rank: int) -> None:
        ip("-n", self.coordinator, "link", "set", port_name(rank), "up")
        namespace, address = self.workers[rank], worker_address(rank)
        if f"inet {address}/" not in ip("-n", namespace, "-4", "addr", "show", WORKER_LINK):
            ip("-n", namespace, "addr", "add", f"{address}/24", "dev", WORKER_LINK)

    def shape(self, rate_mbit: float) -> None:
        """Shape every worker's link to `rate_mbit` megabits a second in each direction."""
        for rank, namespace in enumerate(self.workers):
            _token_bucket(namespace, WORKER_LINK, rate_mbit)  # worker -> the bridge
            _token_bucket(self.coordinator, port_name(rank), rate_mbit)  # the bridge -> worker

    def tcp(self, namespace: str) -> str:
        """`ss -tnoi` inside `namespace`: its TCP connections with timers and retransmits."""
        done = subprocess.run([*self.exec(namespace), "ss", "-tnoi"], capture_output=True,
                              text=True, timeout=20, check=False, stdin=subprocess.DEVNULL)
        return done.stdout + done.stderr

    def peers(self, port: int) -> set[str]:
        """Addresses with an established connection to `port` in the coordinator's namespace."""
        done = subprocess.run(
            [*self.exec(self.coordinator), "ss", "-Htn", "state", "established",
             f"( sport = :{port} )"],
            capture_output=True, text=True, timeout=20, check=True, stdin=subprocess.DEVNULL,
        )
        return {line.split()[-1].rsplit(":", 1)[0] for line in done.stdout.splitlines() if line}


def _remove_stale() -> None:
    """Delete namespaces of ours left by test processes that no longer exist."""
    try:
        names = [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]
    except NetnsError:
        return
    for name in names:
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX):].split("-")[0]  # tbnet-PID-RANDOM-ROLE
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            try:
                ip("netns", "del", name)
            except NetnsError:
                pass


def _build(net: Network, made: list[str]) -> None:
    for namespace in (net.coordinator, *net.workers):
        ip("netns", "add", namespace)
        made.append(namespace)
        ip("-n", namespace, "link", "set", "lo", "up")
    c = net.coordinator
    ip("-n", c, "link", "add", BRIDGE, "type", "bridge")
    ip("-n", c, "addr", "add", f"{COORDINATOR_ADDRESS}/24", "dev", BRIDGE)
    ip("-n", c, "link", "set", BRIDGE, "up")
    for rank, namespace in enumerate(net.workers):
        # Made inside the namespaces: no name is ever taken in the host's namespace.
        ip("-n", c, "link", "add", port_name(rank), "type", "veth",
           "peer", "name", WORKER_LINK, "netns", namespace)
        ip("-n", c, "link", "set", port_name(rank), "master", BRIDGE)
        ip("-n", c, "link", "set", port_name(rank), "up")
        ip("-n", namespace, "addr", "add", f"{worker_address(rank)}/24", "dev", WORKER_LINK)
        ip("-n", namespace, "link", "set", WORKER_LINK, "up")


def _token_bucket(namespace: str, device: str, rate_mbit: float) -> None:
    """tc tbf on `device`'s egress. The bucket holds at least 64 KiB: a veth hands tbf
    segments of up to 64 KiB (GSO), and a smaller bucket would drop them. Packets wait at
    most 100 ms in its queue, as in a switch's buffer, before they are dropped."""
    burst = max(65536, int(rate_mbit * 1e6 / 8 * 0.002))  # (or 2 ms at the rate)
    command = ["ip", "netns", "exec", namespace, "tc", "qdisc", "replace", "dev", device, "root",
               "tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "100ms"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=20, check=False,
                          stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise Unavailable(f"cannot shape a link with tc tbf here: {done.stderr.strip()}")


@contextmanager
def network(workers: int) -> Iterator[Network]:
    """A coordinator namespace and `workers` worker namespaces, bridged; always torn down.

    Skips the test (saying why) where namespaces cannot be made here."""
    import pytest  # (only here: benchmarks use made_network without pytest)

    try:
        with made_network(workers) as net:
            yield net
    except Unavailable as e:
        pytest.skip(str(e))


@contextmanager
def made_network(workers: int) -> Iterator[Network]:
    """`network`, raising Unavailable (saying why) where namespaces cannot be made here."""
    if shutil.which("ip") is None:
        raise Unavailable("needs `ip` (iproute2) to make network namespaces")
    if shutil.which("ss") is None:
        raise Unavailable("needs `ss` (iproute2) to look at the TCP connections")
    _remove_stale()
    base = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
    net = Network(coordinator=f"{base}-c", workers=tuple(f"{base}-w{r}" for r in range(workers)))
    made: list[str] = []
    try:
        try:
            _build(net, made)
        except NetnsError as e:
            if not made:
                raise Unavailable(f"cannot make network namespaces here (needs root, or "
                                  f"CAP_SYS_ADMIN and CAP_NET_ADMIN): {e}") from None
            raise Unavailable(f"cannot build a bridged veth network in namespaces here: "
                              f"{e}") from None
        yield net
    finally:
        # Deleting a namespace destroys the links in it, and with a veth its peer.
        for namespace in reversed(made):
            try:
                ip("netns", "del", namespace)
            except NetnsError:
                pass
