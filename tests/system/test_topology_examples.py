"""The custom-topology examples run as their docstrings say: a relay tree and a sharded
parameter server, each node a real process on loopback."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import zygote

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("script, args", [
    # (One worker a relay: relays of several workers are tests/system/test_relay.py's.)
    ("relay_tree.py", ["--relays", "2", "--per-relay", "1", "--steps", "60"]),
    ("sharded_server.py", ["--shards", "2", "--workers", "2", "--steps", "60"]),
])
def test_a_topology_example_trains(script: str, args: list[str]) -> None:
    # In a session of its own: its nodes are its children, and a script killed at the
    # timeout would leave them running (they are reaped below, whatever happens).
    # (Forked by the zygote, which gives each child a session of its own.)
    example = zygote.shared().popen(args, script=ROOT / "examples" / script, cwd=ROOT,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = example.communicate(timeout=140)
    finally:
        _reap(example)
    assert example.returncode == 0, err[-2000:]
    summary = json.loads(out[out.index("{"):])
    assert summary["steps"] == 60
    # It learned: 60 steps reach about 0.7 on digits' 10 classes, where chance is 0.1.
    assert summary["accuracy"] > 0.5, summary


def _running_in(group: int) -> bool:
    """Whether a process of process group `group` runs: zombies (dead, waiting for a
    reaper, which in a container's PID namespace may never come) do not count."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            # pid (comm) state ppid pgrp ...: split after the comm, which may hold spaces.
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == group and fields[0] not in ("Z", "X"):
                return True
    return False


def _reap(example: zygote.Forked) -> None:
    """End whatever is left of the example's session: SIGTERM first (multiprocessing's
    resource tracker ignores it and unlinks the shared memory once its users are gone),
    then SIGKILL after 10 s."""
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 0.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(example.pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _running_in(example.pid):
            time.sleep(0.1)
    with contextlib.suppress(subprocess.TimeoutExpired):
        example.communicate(timeout=5)
