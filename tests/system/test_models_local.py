"""Multi-process: consistency models through `tensorbus local`, with injected faults,
checking the semantics DESIGN.md states from the metrics the run writes. (Their pace
against a straggler: tests/integration/test_pace.py, on a virtual clock.)

A worker's step time is set with `--fault slow:RANK:MS` (waited out, so the timings hold
on a busy 2-core machine).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import zygote

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "examples" / "digits.py"
FAST = ["--threads", "1", "--no-progress", "--heartbeat", "0.2", "--timeout", "5"]
BASE_MS, STRAGGLER_MS = 30, 150  # every worker's step; the straggler's extra


def _local(tmp_path: Path, *args: str, workers: int, straggler: int | None = None,
           base_ms: int = BASE_MS) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run `tensorbus local` on digits; return the summary and the metrics records."""
    spec = tmp_path / "digits.py"
    shutil.copy(DIGITS, spec)
    metrics = tmp_path / f"metrics-{len(list(tmp_path.glob('metrics-*')))}.jsonl"
    faults = [f"--fault=slow:{r}:{base_ms}" for r in range(workers) if base_ms]
    if straggler is not None:
        faults.append(f"--fault=slow:{straggler}:{STRAGGLER_MS}")
    done = zygote.shared().run(
        ["local", str(spec), "--workers", str(workers), *FAST,
         "--metrics", str(metrics), *faults, *args],
        cwd=ROOT, capture_output=True, text=True, timeout=150, stdin=subprocess.DEVNULL, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert records[-1]["event"] == "summary"
    return records[-1], records


# The strategies' pace against a straggler (ssp's bound, backups, async holding nobody
# back): tests/integration/test_pace.py, exact on a virtual clock.


def test_average_runs_local_steps_between_averages(tmp_path: Path) -> None:
    summary, _records = _local(tmp_path, "--strategy", "average", "--average-every", "4",
                              "--steps", "6", "--batch-size", "16", workers=2, base_ms=0)
    assert summary["steps"] == 6
    assert summary["samples"] == 6 * 2 * 4 * 16  # versions x workers x local steps x batch
    assert all(c["applied"] == 6 for c in summary["per_worker"].values())


def test_a_crash_below_the_minimum_ends_the_run_at_the_version_it_came(tmp_path: Path) -> None:
    """At once, as the launcher sees the worker die: not at the next heartbeat, after
    training on with too few workers (the checkpoint would hold those versions)."""
    spec, checkpoints = tmp_path / "digits.py", tmp_path / "ck"
    shutil.copy(DIGITS, spec)
    done = zygote.shared().run(
        ["local", str(spec), "--workers", "3", "--min-workers", "3",
         "--threads", "1", "--no-progress", "--heartbeat", "2", "--steps", "100000",
         "--fault=crash:2:10", "--checkpoint-dir", str(checkpoints)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, check=False)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    found = re.fullmatch(r"tensorbus: error: 2 worker\(s\) left at version (\d+), fewer than the "
                         r"minimum of 3: .*; lost: 2 \(at version \d+, \w+\)", last)
    assert found, last
    version = int(found[1])
    assert version <= 10  # (its 10th push was its last: no version without it after)
    assert [p.name for p in checkpoints.glob("ckpt-*.pt")] == [f"ckpt-{version:09d}.pt"]


def test_a_crashed_worker_is_removed_and_the_run_finishes(tmp_path: Path) -> None:
    summary, _ = _local(tmp_path, "--strategy", "sync", "--steps", "30", "--fault=crash:2:10",
                        workers=3, base_ms=10)
    assert summary["steps"] == 30
    assert [lost["rank"] for lost in summary["lost"]] == [2]
    assert summary["per_worker"]["2"]["pushes"] == 10


def test_a_worker_killed_during_a_fragment_s_sync_leaves_the_others_training(tmp_path: Path) -> None:
    """Streaming averaging, 2 local steps a fragment: worker 2 dies at its 6th local step,
    computing while its second push (fragment 1, on version 1) is on its way; the others
    average the next fragments without it, to the last version."""
    summary, records = _local(tmp_path, "--strategy", "average", "--average-every", "4",
                              "--fragments", "2", "--compress", "int4", "--steps", "20",
                              "--batch-size", "16", "--fault=crash:2:5", workers=3, base_ms=10)
    assert summary["steps"] == 20
    assert [lost["rank"] for lost in summary["lost"]] == [2]
    assert summary["per_worker"]["2"]["pushes"] == 2
    assert all(summary["per_worker"][r]["applied"] == 20 for r in ("0", "1"))
    steps = [r for r in records if r["event"] == "step"]
    assert [r["workers"] for r in steps[-3:]] == [[0, 1]] * 3  # going on without it
