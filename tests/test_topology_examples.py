"""The custom-topology examples run as their docstrings say: a relay tree and a sharded
parameter server, each node a real process on loopback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(150)
@pytest.mark.parametrize("script, args", [
    ("relay_tree.py", ["--relays", "2", "--per-relay", "2", "--steps", "5"]),
    ("sharded_server.py", ["--shards", "2", "--workers", "2", "--steps", "5"]),
])
def test_a_topology_example_trains(script: str, args: list[str]) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=140, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout[done.stdout.index("{"):])
    assert summary["steps"] == 5
    assert 0.0 <= summary["accuracy"] <= 1.0
