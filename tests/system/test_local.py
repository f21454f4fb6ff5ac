"""Multi-process: the `tensorbus` command as a user runs it, with real worker processes.

Each test copies its SPEC to a path of its own, so that it can check afterwards that no
process naming that path is left running; every process started here is killed in finally.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zygote
from cluster import ANY_PORT, bound, leaked, segments

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "examples" / "digits.py"
TENSORBUS = [sys.executable, "-m", "tensorbus"]
FAST = ["--threads", "1", "--no-progress", "--json", "--heartbeat", "0.2", "--timeout", "5"]


def _run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return zygote.shared().run([*args], cwd=ROOT, check=False, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def _left_running(marker: str) -> list[str]:
    """The processes whose command line holds `marker`, or, orphaned (their launcher gone),
    whose name (comm) starts with it: a worker forked from its launcher (run.children)
    keeps the launcher's command line and is named by the launcher. (By name, only
    orphans: another test's run, its launcher alive, forks workers of the same name.)"""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state ppid ...
        orphan = fields[1] == "1"
        if int(pid) == os.getpid() or fields[0] in ("Z", "X"):
            continue
        if marker in cmdline or (orphan and name.startswith(marker)):
            found.append(f"{pid}: {name}: {cmdline}")
    return found


def _wait_for_a_step(metrics: Path) -> None:
    deadline = time.monotonic() + 90
    while not (metrics.exists() and '"event": "step"' in metrics.read_text()):
        assert time.monotonic() < deadline, "no step was taken"
        time.sleep(0.2)


def _spec(tmp_path: Path, name: str, text: str | None = None) -> Path:
    path = tmp_path / f"{name}.py"
    if text is None:
        shutil.copy(DIGITS, path)
    else:
        path.write_text(text)
    return path


def test_local_trains_and_writes_the_summary(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "digits_local")
    metrics = tmp_path / "m.jsonl"
    result = _run(["local", str(spec), "--workers", "3", "--strategy", "sync", "--steps", "40",
                   "--batch-size", "16", "--lr", "0.3", "--metrics", str(metrics), *FAST])
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    summary = lines[-1]
    assert summary["event"] == "summary"
    assert json.loads(result.stdout) == summary
    for key in ("strategy", "workers", "steps", "wall_s", "final_loss", "dropped",
                "max_staleness", "max_clock_gap", "accuracy"):
        assert key in summary, key
    assert (summary["strategy"], summary["workers"], summary["steps"]) == ("sync", 3, 40)
    assert [r["version"] for r in lines if r["event"] == "step"] == list(range(1, 41))
    assert summary["accuracy"] > 0.5  # 40 steps of 48 samples learn digits well past chance
    assert _left_running(str(spec)) == []


@pytest.mark.parametrize("started", ["forked", "fresh"])
def test_what_a_worker_prints_is_relayed(tmp_path: Path, started: str) -> None:
    """A worker's stdout comes to the launcher's stderr with its stderr, `[worker R]`
    before each line; the launcher's stdout holds the summary alone. Workers forked by
    the CLI, or fresh interpreters, as the Python API starts them."""
    spec = _spec(tmp_path, "digits_prints", DIGITS.read_text() + (
        "\n_data = data\n\n\ndef data(rank, world_size, batch_size):\n"
        "    print(f'hello from rank {rank}')\n"
        "    return _data(rank, world_size, batch_size)\n"))
    if started == "forked":
        result = _run(["local", str(spec), "--workers", "2", "--steps", "2", *FAST])
    else:
        api = ("import json, sys; from tensorbus.run import launch_local; from tensorbus.run.options import "
               "RunOptions; print(json.dumps(launch_local(sys.argv[1], RunOptions("
               "workers=2, steps=2), threads=1)))")
        result = zygote.shared().run([str(spec)], code=api, cwd=ROOT, text=True,
                                     capture_output=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["steps"] == 2
    for rank in range(2):
        assert f"[worker {rank}] hello from rank {rank}" in result.stderr.splitlines()


def test_local_forks_its_workers(tmp_path: Path) -> None:
    """`local`'s workers are forked from it (run.children), not fresh interpreters: its
    children, named for their ranks; SIGTERM stops them all with it."""
    spec, metrics = _spec(tmp_path, "digits_forked"), tmp_path / "m.jsonl"
    launcher = zygote.shared().popen(
        ["local", str(spec), "--workers", "2", "--steps", "100000", *FAST,
         "--metrics", str(metrics)],
        cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_a_step(metrics)
        children = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            name, rest = stat[stat.index("(") + 1:].rsplit(")", 1)
            if int(rest.split()[1]) == launcher.pid:
                children[name] = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert set(children) == {"tb worker 0", "tb worker 1"}, children
        mine = Path(f"/proc/{launcher.pid}/cmdline").read_bytes()
        assert all(cmdline == mine for cmdline in children.values())  # forked: the launcher's
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=60)
        # Stopped gracefully, it says what was saved and dies of the signal, as asked.
        assert launcher.returncode == -signal.SIGTERM, err
        assert err.strip().splitlines()[-1].startswith("tensorbus: stopped by SIGTERM at version ")
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert _left_running(str(spec)) == []


def test_resuming_a_finished_run_makes_no_step_more(tmp_path: Path) -> None:
    """--resume from the checkpoint a run wrote as it reached --steps (or --epochs) ends at
    once, at that version: the workers join and are told to stop, with no push."""
    spec = _spec(tmp_path, "digits_resume")
    for target in (["--steps", "12"], ["--epochs", "1"]):
        ckpt = tmp_path / target[0][2:]
        common = ["local", str(spec), "--workers", "2", *target, "--checkpoint-dir", str(ckpt),
                  *FAST]
        first = _run(common)
        assert first.returncode == 0, first.stderr
        again = _run([*common, "--resume"])
        assert again.returncode == 0, again.stderr
        before, after = json.loads(first.stdout), json.loads(again.stdout)
        assert after["resumed_from"] == before["steps"] > 0
        assert (after["steps"], after["samples"]) == (before["steps"], before["samples"])
        assert after["ended"] == (f"reached {before['ended'].removeprefix('reached ')} before "
                                  "this start (resumed from the end of a run)")
        assert all(w["pushes"] == 0 for w in after["per_worker"].values())
        assert [p.name for p in ckpt.iterdir()] == [f"ckpt-{before['steps']:09d}.pt"]
        assert after["accuracy"] == before["accuracy"]
    assert _left_running(str(spec)) == []


def test_async_pushes_by_reference_and_learns_as_with_bytes(tmp_path: Path) -> None:
    """Async's pipelined workers push both gradient sets from shared memory by default
    (bus.shared), and load versions from the coordinator's (bus.shared.SharedWeightPool); bytes
    both ways with --no-shared-memory; each run learns, and no segment is left."""
    spec = _spec(tmp_path, "digits_async")
    before = segments()
    common = ["local", str(spec), "--workers", "2", "--strategy", "async", "--steps", "150",
              "--batch-size", "16", "--lr", "0.1", "--log-level", "info", *FAST]
    runs, loaded = {}, {}
    for name, extra in (("by reference", []), ("bytes", ["--no-shared-memory"])):
        done = _run([*common, *extra])
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = json.loads(done.stdout)
        # Each worker says at info level: "worker R: N versions loaded by reference (T torn)"
        loaded[name] = [int(n) for n in re.findall(r"(\d+) versions loaded by reference", done.stderr)]
    assert len(loaded["by reference"]) == 2 and min(loaded["by reference"]) >= 1
    assert loaded["bytes"] == [0, 0]
    for name, summary in runs.items():
        assert (summary["strategy"], summary["steps"], summary["dropped"]) == ("async", 150, {}), name
        assert summary["accuracy"] > 0.5, name  # 150 updates of 16 samples: well past chance
        assert sum(w["pushes"] for w in summary["per_worker"].values()) >= 150, name
    assert all(w["by_reference"] == w["pushes"] > 0 for w in runs["by reference"]["per_worker"].values())
    assert all(w["by_reference"] == 0 for w in runs["bytes"]["per_worker"].values())
    assert leaked(before) == set()  # none of these runs' left behind
    assert _left_running(str(spec)) == []


def test_a_spec_without_model_fails_in_one_line(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "no_model", "def data(r, w, b):\n    return []\n\n"
                                       "def loss(o, t):\n    return o\n")
    result = _run(["local", str(spec), "--workers", "2", "--steps", "3", *FAST])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"tensorbus: error: SPEC {spec}: missing model() -> torch.nn.Module: define it "
        "(see examples/digits.py)"
    ]
    assert _left_running(str(spec)) == []


def test_a_dataloader_with_workers_of_its_own_runs_epoch_after_epoch_quietly(tmp_path: Path) -> None:
    """Its workers are forked as each epoch begins: from the worker's main thread (the
    loop's), as nodes.compute.iter_on_loop has it. Forked from the compute's executor thread,
    they exited 1 at their end, and the DataLoader said so in tracebacks."""
    text = DIGITS.read_text() + (
        "\n\n_data = data\n\n\ndef data(rank, world_size, batch_size):\n"
        "    from torch.utils.data import DataLoader, TensorDataset\n"
        "    batches = list(_data(rank, world_size, batch_size))\n"
        "    x = torch.cat([b[0] for b in batches])\n"
        "    y = torch.cat([b[1] for b in batches])\n"
        "    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True,\n"
        "                      drop_last=True, num_workers=2)\n")
    spec = _spec(tmp_path, "loader", text)
    done = _run(["local", str(spec), "--workers", "2", "--epochs", "3", *FAST])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "exited unexpectedly" not in done.stderr and "Traceback" not in done.stderr, \
        done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert summary["steps"] == 3 * 11  # 3 epochs of each rank's 11 training batches of 64


def test_data_that_raises_ends_the_run_in_one_line(tmp_path: Path) -> None:
    text = DIGITS.read_text() + (
        "\n\ndef data(rank, world_size, batch_size):\n"
        "    raise ValueError('no shard here')\n"
    )
    spec = _spec(tmp_path, "bad_data", text)
    result = _run(["local", str(spec), "--workers", "2", "--steps", "3", *FAST])
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("tensorbus: error: worker ")
    assert f"SPEC {spec}: data(rank=" in lines[0] and "world_size=2, batch_size=64)" in lines[0]
    assert lines[0].endswith("raised ValueError: no shard here (--debug shows the traceback)")
    assert _left_running(str(spec)) == []


def test_coordinator_and_workers_by_hand_match_local(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "digits_by_hand")
    training = ["--workers", "2", "--steps", "15", "--batch-size", "16", "--seed", "3"]
    local = _run(["local", str(spec), *training, *FAST])
    assert local.returncode == 0, local.stderr

    metrics = tmp_path / "by_hand.jsonl"
    processes = []
    try:
        coordinator = zygote.shared().popen(
            ["coordinator", str(spec), "--bind", ANY_PORT, "--metrics", str(metrics),
             *training, *FAST],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        processes.append(coordinator)
        endpoint, _ = bound(coordinator, metrics)
        for rank in (1, 0):  # out of order: ranks, not arrival, decide the shards
            processes.append(zygote.shared().popen(
                ["worker", str(spec), "--connect", endpoint, "--rank", str(rank),
                 "--threads", "1"],
                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            ))
        out, err = coordinator.communicate(timeout=120)
        assert coordinator.returncode == 0, err
        for worker in processes[1:]:
            _, worker_err = worker.communicate(timeout=30)
            assert worker.returncode == 0, worker_err
    finally:
        for p in processes:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.communicate()
    by_hand, at_once = json.loads(out), json.loads(local.stdout)
    for key in ("steps", "samples", "final_loss", "accuracy", "test_loss"):
        assert by_hand[key] == at_once[key], key
    assert _left_running(str(spec)) == []
