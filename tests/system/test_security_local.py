"""Multi-process: CURVE keys end to end, through `tensorbus keys`, `coordinator --keys` and
`worker --keys`. A worker whose key is not listed and a worker without CURVE cannot join or
push anything, and the honest workers train on as if they were not there."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import zygote
from cluster import ROOT, cluster, version

pytestmark = pytest.mark.timeout(120)


def _tensorbus(*args: str) -> subprocess.CompletedProcess[str]:
    return zygote.shared().run([*args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL, check=False)


def test_only_listed_keys_get_in_and_honest_workers_are_unaffected(tmp_path: Path) -> None:
    keys, stranger = tmp_path / "keys", tmp_path / "stranger"
    assert _tensorbus("keys", str(keys), "--worker", "alice", "--worker", "bob").returncode == 0
    # A stranger with a pair of its own, who knows the coordinator's public key.
    assert _tensorbus("keys", str(stranger), "--worker", "mallory").returncode == 0
    (stranger / "coordinator.key").unlink()
    (stranger / "coordinator.key_secret").unlink()
    shutil.copy(keys / "coordinator.key", stranger / "coordinator.key")

    with cluster(tmp_path) as c:
        c.start_coordinator("--workers", "2", "--steps", "150", "--batch-size", "16",
                            "--keys", str(keys))
        # The outsiders start first; each gives up at its first refused handshake.
        c.start_worker(3, "--keys", str(stranger), "--key-name", "mallory", "--join-timeout", "4")
        outsider_stranger = c.workers.pop(3)
        c.start_worker(3, "--join-timeout", "4")  # no CURVE at all
        outsider_plain = c.workers.pop(3)
        c.start_worker(0, "--keys", str(keys), "--key-name", "alice", "--fault", "slow:30")
        c.start_worker(1, "--keys", str(keys), "--key-name", "bob", "--fault", "slow:30")
        c.wait_for("version 5", lambda rs: version(rs) >= 5)
        summary, records = c.finish()
        assert summary["steps"] == 150
        # Only the two honest ranks ever joined or pushed; each joined once.
        assert sorted(summary["per_worker"]) == ["0", "1"]
        assert all(w["joins"] == 1 and w["applied"] == 150 for w in summary["per_worker"].values())
        assert all(sorted(r["workers"]) == [0, 1] for r in records if r["event"] == "step")
        assert summary["lost"] == [] and summary["dropped"] == {}
        # Both were refused at the handshake and counted: the stranger for its key (by the
        # gate), the plain peer for having none (by the socket's monitor).
        assert summary["rejected"].get("handshake", 0) >= 2, summary["rejected"]
        assert set(summary["rejected"]) <= {"handshake"}
        for outsider in (outsider_stranger, outsider_plain):
            assert outsider.wait(timeout=30) == 1
        log = c.logs()
        # Each says why at once (waiting would not mend it), and what to check.
        assert log.count("error: cannot talk to coordinator at") == 2, log
        assert "the coordinator refused the CURVE handshake: its authorized/ directory" in log
        assert "one side uses CURVE keys and the other does not" in log
        assert "refused a CURVE handshake" in log
        assert "connection(s) for their keys" in log  # the coordinator says it as it comes


def test_keys_refuses_a_missing_key_with_one_line(tmp_path: Path) -> None:
    done = _tensorbus("worker", str(ROOT / "examples" / "digits.py"), "--connect",
                      "tcp://127.0.0.1:9", "--keys", str(tmp_path / "none"))
    assert done.returncode == 2
    assert done.stderr.strip().startswith("error: ") and "tensorbus keys" in done.stderr


def test_a_public_bind_without_keys_is_refused(tmp_path: Path) -> None:
    done = _tensorbus("coordinator", str(ROOT / "examples" / "digits.py"), "--bind",
                      "tcp://0.0.0.0:0", "--workers", "1")
    assert done.returncode == 2 and "--insecure" in done.stderr and "--keys" in done.stderr
