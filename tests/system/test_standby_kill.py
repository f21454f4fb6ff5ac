"""System: a standby coordinator in real processes, its coordinator killed with SIGKILL.

`tensorbus coordinator`, `tensorbus coordinator --standby-of` and two `tensorbus worker`s on
loopback, with CURVE keys; the first coordinator is killed mid-run. The standby takes the run over within
`--timeout`, the workers move to it by themselves, and the run ends as an uninterrupted one
(`tensorbus local` with the same options) does: the same versions, samples and final loss.
Every strategy, and the other failures (a killed standby, a partition), in one loop on a
virtual clock: tests/integration/test_standby.py.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest
import zygote
from cluster import ANY_PORT, LIVENESS, QUIET, ROOT, TIMEOUT_S, bound, cluster, steps

from tensorbus.bus.security import make_keys

pytestmark = [pytest.mark.system, pytest.mark.timeout(120)]

RUN = ["--workers", "2", "--strategy", "sync", "--steps", "150", "--batch-size", "16",
       "--lr", "0.1"]
KILL_AT = 60


def _summary(out: str) -> dict[str, Any]:
    summary: dict[str, Any] = json.loads(out[out.index("{"):])
    return summary


def test_a_coordinator_killed_mid_run_is_taken_over_by_its_standby(tmp_path: Path) -> None:
    """With CURVE keys: the standby holds the coordinator's key pair, so the workers'
    handshakes with it pass as with the coordinator, and the two coordinators let each
    other in by that pair."""
    keys = tmp_path / "keys"
    make_keys(keys)
    secure = ["--keys", str(keys)]
    calm = zygote.shared().run(["local", str(ROOT / "examples" / "digits.py"), *RUN, "--json",
                                "--no-progress", *QUIET], cwd=ROOT, capture_output=True,
                               text=True, timeout=100, check=False)
    assert calm.returncode == 0, calm.stderr[-2000:]
    with cluster(tmp_path) as c:
        c.start_coordinator(*RUN, *secure)
        standby_metrics = tmp_path / "standby.jsonl"
        standby = c._start("coordinator", str(c.spec), "--bind", ANY_PORT, "--standby-of",
                           c.endpoint, "--metrics", str(standby_metrics), "--no-progress",
                           "--json", *LIVENESS, *QUIET, *RUN, *secure, log="standby.log")
        standby_at, _ = bound(standby, standby_metrics)
        # Replicated from the moment it follows: before the workers start.
        c.wait_for("the standby", lambda records: any(r["event"] == "standby" for r in records))
        for rank in range(2):
            c.start_worker(rank, *secure)
        c.wait_for(f"version {KILL_AT}", lambda records: len(steps(records)) >= KILL_AT)
        assert c.coordinator is not None
        c.coordinator.send_signal(signal.SIGKILL)
        c.coordinator.wait(timeout=10)
        last = steps(c.records())[-1]["version"]
        out, _ = standby.communicate(timeout=60)
        assert standby.returncode == 0, c.logs()
        records = [json.loads(line) for line in standby_metrics.read_text().splitlines()]
        worker_logs = [(tmp_path / f"worker-{r}.log").read_text() for r in range(2)]
        for worker in c.workers.values():
            assert worker.wait(timeout=30) == 0, c.logs()
    summary, want = _summary(out), _summary(calm.stdout)
    takeover = next(r for r in records if r["event"] == "takeover")
    # No version lost: its newest replica is the last version published (a version the
    # killed one had made but not yet replicated was never published: its step is redone).
    assert last - 1 <= takeover["version"] <= last
    first_new = next(r for r in steps(records) if r["version"] == takeover["version"] + 1)
    assert takeover["silent_s"] + first_new["wall_s"] - takeover["wall_s"] <= TIMEOUT_S + 1.0
    # The workers moved by themselves, and the run ended as if never interrupted.
    assert all(f"joining again at {standby_at}" in log for log in worker_logs)
    assert summary["standby"]["term"] == 1 and summary["resumed_from"] == takeover["version"]
    assert (summary["steps"], summary["samples"]) == (want["steps"], want["samples"])
    assert summary["final_loss"] == pytest.approx(want["final_loss"], abs=1e-5)
    assert summary["accuracy"] == pytest.approx(want["accuracy"], abs=0.005)


def test_local_standby_follows_every_version_and_ends_with_the_run(tmp_path: Path) -> None:
    """`local --standby`: its standby follows before any worker starts, takes every version
    (by reference: it is on this host) and ends with the run, taking nothing over."""
    done = zygote.shared().run(["local", str(ROOT / "examples" / "digits.py"), *RUN, "--standby",
                                "--json", "--no-progress", "--metrics", str(tmp_path / "m.jsonl"),
                                *QUIET], cwd=ROOT, capture_output=True, text=True, timeout=100,
                               check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    standby = _summary(done.stdout)["standby"]
    assert standby == {"term": 0, "standby": None, "replicated": 151,  # versions 0..150
                       "replicate_s": standby["replicate_s"], "by_reference": True}
    assert "[standby] the coordinator at tcp://127.0.0.1:" in done.stderr
    assert "ended its run: this standby took nothing over" in done.stderr
    records = (tmp_path / "m.standby.jsonl").read_text()
    assert '"event": "following"' in records and '"event": "takeover"' not in records
