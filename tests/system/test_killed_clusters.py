"""System: whole clusters SIGKILLed at random points leave nothing in /dev/shm once the next
run has started and ended (bus.shared.sweep): no process of theirs could unlink its own
segments, and nothing else of theirs outlived them to do it."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import zygote
from cluster import segments

ROOT = Path(__file__).resolve().parents[2]
DIGITS = str(ROOT / "examples" / "digits.py")
CLUSTERS = 4

pytestmark = pytest.mark.timeout(180)


def _descendants(pid: int) -> set[int]:
    """`pid` and every process below it, now."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat[stat.rindex(")") + 2:].split()[1])
    found, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        children = [p for p, pp in parents.items() if pp == parent and p not in found]
        found.update(children)
        frontier += children
    return found


def _theirs(pids: set[int]) -> set[str]:
    return {p.name for p in segments() if int(p.name.split("-")[1]) in pids}


def test_whole_clusters_killed_at_random_points_leave_no_segment_behind() -> None:
    random.seed(7)
    killed: set[int] = set()
    left_by_kills: set[str] = set()
    for _ in range(CLUSTERS):
        launcher = zygote.shared().popen(
            ["local", DIGITS, "--workers", "2", "--steps", "100000", "--threads", "1",
             "--no-progress"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            # Once it has segments of its own (a coordinator's first: its host token), at a
            # random point of its start or its training.
            deadline = time.monotonic() + 30
            while not _theirs(_descendants(launcher.pid)):
                assert launcher.poll() is None and time.monotonic() < deadline
                time.sleep(0.02)
            time.sleep(random.uniform(0.0, 1.5))
            cluster = _descendants(launcher.pid)
            for pid in cluster:  # the coordinator (in the launcher) and every worker at once
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            assert launcher.wait(timeout=30) == -signal.SIGKILL
        finally:
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait()
        killed |= cluster
        left_by_kills |= _theirs(cluster)
    # What the kills left (unless a later cluster's start swept it already) ...
    assert left_by_kills, "no cluster was killed with a segment: the test proves nothing"
    # ... is gone once the next run has started and ended.
    done = zygote.tensorbus("local", DIGITS, "--workers", "2", "--steps", "5", "--threads", "1",
                            "--no-progress", timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert _theirs(killed) == set()
