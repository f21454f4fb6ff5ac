"""Multi-process: `tensorbus local --colocate`, each worker process serving one shard.

The same run as `local` without it gives the same figures to the last digit (2 and 3
workers); a worker killed mid-run ends the run at once with its one-line error and leaves
nothing running; SIGTERM stops every shard at one version with a checkpoint and `--resume`
goes on from them; options that cannot work colocated are refused in one line.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zygote
from cluster import leaked, segments
from test_local import (
    DIGITS,
    FAST,
    ROOT,
    _left_running,
    _run,
    _spec,
    _wait_for_a_step,
)

from tensorbus.run.options import RunOptions

pytestmark = [pytest.mark.timeout(180), pytest.mark.colocated]

CHILD = "tensorbus.run.colocated"  # the module a colocated worker process runs
FORKED = "tb colocated"  # the name of one forked from `local` (run.children), with its rank


def _forked_by(parent: int) -> dict[int, str]:
    """The workers `parent` forked (run.children), alive: pid -> name."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            name = (stat.parent / "comm").read_text().strip()
        except OSError:
            continue
        state, ppid = text[text.rindex(")") + 2:].split()[:2]
        if int(ppid) == parent and state not in ("Z", "X") and name.startswith(FORKED):
            found[int(stat.parent.name)] = name
    return found


def _summary(done: subprocess.CompletedProcess[str]) -> dict:
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_colocated_gives_the_figures_of_a_central_coordinator(tmp_path: Path) -> None:
    """... and so do both with the gradients pushed as bytes, not from shared memory
    (bus.shared): every push to a shard in another process goes by reference, by default;
    none with --no-shared-memory; and no segment is left in /dev/shm."""
    workers = 2  # 3 are compared with one coordinator in tests/integration/test_colocated.py
    spec = _spec(tmp_path, "colocated")
    before = segments()
    common = ["local", str(spec), "--workers", str(workers), "--steps", "40", *FAST]
    central = _summary(_run(common))
    colocated = _summary(_run([*common, "--colocate", "--metrics", str(tmp_path / "m.jsonl")]))
    as_bytes = [_summary(_run([*common, *extra, "--no-shared-memory"]))
                for extra in ([], ["--colocate"])]
    for key in ("steps", "final_loss", "accuracy", "test_loss"):
        assert colocated[key] == central[key] == as_bytes[0][key] == as_bytes[1][key], key
    assert colocated["colocated"] == workers
    # Shard 0's figures: worker 0 reaches it in process (inproc, no copy), worker 1 by reference.
    pushed = [(w["pushes"], w["by_reference"]) for w in colocated["per_worker"].values()]
    assert pushed == [(pushed[0][0], 0), (pushed[1][0], pushed[1][0])] and pushed[1][0] >= 40
    assert all(w["by_reference"] == w["pushes"] > 0 for w in central["per_worker"].values())
    assert all(w["by_reference"] == 0 for run in as_bytes for w in run["per_worker"].values())
    assert leaked(before) == set()
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert lines[-1]["event"] == "summary" and lines[-1]["accuracy"] == central["accuracy"]
    assert _left_running(FORKED) == []


def test_a_killed_worker_ends_the_run_in_one_line(tmp_path: Path) -> None:
    spec, metrics = _spec(tmp_path, "killed"), tmp_path / "m.jsonl"
    launcher = zygote.shared().popen(
        ["local", str(spec), "--workers", "3", "--colocate", "--steps", "100000", *FAST,
         "--metrics", str(metrics)],
        cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_a_step(metrics)
        running = _forked_by(launcher.pid)
        assert sorted(running.values()) == ["tb colocated 1", "tb colocated 2"]
        children = sorted(running)
        subprocess.run(["kill", "-KILL", str(children[-1])], check=False)
        _, err = launcher.communicate(timeout=60)
        assert launcher.returncode == 1
        last = err.strip().splitlines()[-1]
        assert last.startswith("tensorbus: error: worker ") and "killed by SIGKILL" in last
        assert "cannot go on without it" in last
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    deadline = time.monotonic() + 10
    while _left_running(FORKED) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _left_running(FORKED) == []


def test_a_spec_whose_data_fails_on_one_rank_is_named(tmp_path: Path) -> None:
    """Rank 1 is a forked child of the launcher (run.colocated's), not the launcher's own
    process: its one line names the SPEC all the same."""
    text = DIGITS.read_text() + (
        "\n\n_all_data = data\n\n"
        "def data(rank, world_size, batch_size):\n"
        "    if rank == 1:\n"
        "        raise ValueError('no shard here')\n"
        "    return _all_data(rank, world_size, batch_size)\n")
    spec = _spec(tmp_path, "bad_rank", text)
    done = _run(["local", str(spec), "--workers", "2", "--colocate", "--steps", "3", *FAST])
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("tensorbus: error: worker 1 failed (exit status 1): "
                           f"SPEC {spec}: data(rank=1, world_size=2, batch_size=64) raised "
                           "ValueError: no shard here"), last
    assert _left_running(FORKED) == []


def test_sigterm_checkpoints_every_shard_and_resume_goes_on(tmp_path: Path) -> None:
    spec, checkpoints, metrics = _spec(tmp_path, "stopped"), tmp_path / "ck", tmp_path / "m.jsonl"
    launcher = zygote.shared().popen(
        ["local", str(spec), "--workers", "2", "--colocate", *FAST, "--steps", "100000",
         "--checkpoint-dir", str(checkpoints), "--metrics", str(metrics)],
        cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_a_step(metrics)
        launcher.send_signal(signal.SIGTERM)
        out, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == -signal.SIGTERM, err[-2000:]  # (stopped, it dies of it)
    stopped = json.loads(out)
    assert stopped["ended"] == "stop requested: SIGTERM" and stopped["steps"] > 0
    shards = sorted(p.parent.name for p in checkpoints.glob("*/ckpt-*.pt"))
    assert shards == ["shard-0-of-2", "shard-1-of-2"]
    # Every shard stopped at the same version: checkpoints that fit together.
    versions = {p.parent.name: p.name for p in checkpoints.glob("*/ckpt-*.pt")}
    assert versions == dict.fromkeys(shards, f"ckpt-{stopped['steps']:09d}.pt"), versions
    resumed = _summary(_run(["local", str(spec), "--workers", "2", "--colocate", *FAST,
                             "--checkpoint-dir", str(checkpoints), "--resume",
                             "--steps", str(stopped["steps"] + 5)]))
    assert resumed["resumed_from"] == stopped["steps"] and resumed["steps"] == stopped["steps"] + 5
    assert _left_running(FORKED) == []


@pytest.mark.parametrize(("extra", "says"), [
    ({"strategy": "async"}, ("--colocate serves sync and average, whose workers wait for every "
                             "version, not async")),
    ({"strategy": "ssp"}, "--colocate serves sync and average"),
    ({"shards": 2}, "drop --shards"),
    ({"max_workers": 3}, "drop --max-workers"),
    ({"faults": ("crash:1:5",)}, "drop the crash fault"),
    ({"eval_every_s": 1.0}, "drop one of them"),
    ({"workers": 1}, "--colocate needs at least 2 workers"),
])
def test_what_cannot_be_colocated_is_refused(extra: dict, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        RunOptions(**{"workers": 2, "colocate": True, **extra})


def test_a_refusal_is_one_line_from_the_command() -> None:
    done = _run(["local", str(DIGITS), "--workers", "2", "--colocate", "--strategy", "async", *FAST])
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [(
        "tensorbus: error: --colocate serves sync and average, whose workers wait for every "
        "version, not async: a worker that runs ahead holds a shard the others need; drop "
        "--colocate for it")]


def test_the_child_entry_point_is_not_a_command() -> None:
    """`python -m tensorbus.run.colocated` only takes orders from `local`: with none, it says so."""
    done = subprocess.run([sys.executable, "-m", CHILD], cwd=ROOT, input="", text=True,
                          capture_output=True, timeout=60, check=False)
    assert done.returncode == 2
    assert done.stderr.strip() == ("error: python -m tensorbus.run.colocated is started by `tensorbus "
                                   "local --colocate`, which gives it its orders on stdin")
