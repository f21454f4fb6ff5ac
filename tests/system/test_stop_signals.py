"""System: a worker started by hand leaves at once on SIGTERM or Ctrl-C, wherever its
training is, and its coordinator says that it left, interrupted.

The workers are forked from one launcher that has imported tensorbus (run.children), each
then exactly `tensorbus worker ...`: thirty starts of a fresh interpreter would take
minutes of this machine's two cores.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import zygote

ROOT = Path(__file__).resolve().parents[2]
DIGITS = str(ROOT / "examples" / "digits.py")

pytestmark = pytest.mark.timeout(150)

# Ranks 1 and 2 are each started TRIES times beside a worker 0 that trains throughout, and
# signalled at a random point of their training, once they have joined.
LAUNCHER = """
import asyncio, json, random, re, signal, sys, time
import tensorbus.run.cli  # imported once here, as `tensorbus local` does before it forks
from tensorbus.run.children import Forks

spec, tries, sig = sys.argv[1], int(sys.argv[2]), signal.Signals[sys.argv[3]]
forks = Forks(2 + 2 * tries)
common = ["--threads", "1", "--log-level", "info"]


async def lines_until(stream, pattern, log):
    while True:
        line = (await stream.readline()).decode()
        if not line:
            raise RuntimeError(f"ended before {pattern!r}: {log[-5:]}")
        log.append(line)
        found = re.search(pattern, line)
        if found:
            return found


async def drain(stream, log):
    while line := (await stream.readline()).decode():
        log.append(line)


async def cycle(rank, connect, results):
    random.seed(rank)
    for _ in range(tries):
        log = []
        worker = await forks.start(f"tb worker {rank}", "tensorbus", [
            "worker", spec, "--connect", connect, "--rank", str(rank), *common])
        await lines_until(worker.stderr, f"worker {rank} joined", log)
        reading = asyncio.ensure_future(drain(worker.stderr, log))
        await asyncio.sleep(random.uniform(0.0, 1.0))
        signalled = time.monotonic()
        worker.send_signal(sig)
        try:
            code = await asyncio.wait_for(worker.wait(), 10.0)
        except asyncio.TimeoutError:
            worker.send_signal(signal.SIGKILL)
            code = await worker.wait()
        await reading
        results.append({"rank": rank, "s": time.monotonic() - signalled, "code": code,
                        "last": log[-1].strip() if log else ""})


async def main():
    coordinator_log = []
    coordinator = await forks.start("tb coordinator", "tensorbus", [
        "coordinator", spec, "--bind", "tcp://127.0.0.1:0", "--workers", "3",
        "--steps", "100000000", "--no-progress", "--heartbeat", "0.2", "--timeout", "5",
        *common])
    found = await lines_until(coordinator.stderr, r"listening on (tcp://[0-9.:]+)",
                              coordinator_log)
    connect = found.group(1)
    reading = asyncio.ensure_future(drain(coordinator.stderr, coordinator_log))
    steady = await forks.start("tb worker 0", "tensorbus", [
        "worker", spec, "--connect", connect, "--rank", "0", *common])
    steady_log = []
    steady_reading = asyncio.ensure_future(drain(steady.stderr, steady_log))
    results = []
    try:
        await asyncio.gather(cycle(1, connect, results), cycle(2, connect, results))
    finally:
        coordinator.send_signal(signal.SIGTERM)
        await asyncio.wait_for(coordinator.wait(), 30)
        await asyncio.wait_for(steady.wait(), 30)
        await reading
        await steady_reading
        forks.close()
    print(json.dumps({"results": results, "coordinator": coordinator_log}))


asyncio.run(main())
"""


@pytest.mark.exclusive  # its figures need the machine to itself
@pytest.mark.parametrize(("signal_name", "tries"), [("SIGTERM", 6), ("SIGINT", 3)])
def test_a_worker_leaves_at_once_on_a_signal_wherever_it_is(signal_name: str,
                                                            tries: int) -> None:
    done = zygote.shared().run([DIGITS, str(tries), signal_name], code=LAUNCHER,
                               capture_output=True, text=True, timeout=140)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    results = report["results"]
    assert len(results) == 2 * tries
    number = {"SIGTERM": 15, "SIGINT": 2}[signal_name]
    for r in results:
        assert r["code"] == -number, r  # it dies of the signal, as its launcher asked
        assert r["s"] < 2.0, r
        assert r["last"] == f"worker {r['rank']} left the run on {signal_name}", r
    left = [line for line in report["coordinator"]
            if re.search(rf"WARNING worker [12] .* left \(interrupted: {signal_name}\)$",
                         line.strip())]
    assert len(left) == 2 * tries, report["coordinator"][-20:]


def _wait_for_a_step(metrics: Path, process: zygote.Forked, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not (metrics.exists() and '"step"' in metrics.read_text()):
        assert process.poll() is None and time.monotonic() < deadline, "no step came"
        time.sleep(0.05)


@pytest.mark.parametrize("when", ["training", "before training"])
def test_ctrl_c_on_local_stops_saves_says_how_to_go_on_and_exits_130(tmp_path: Path,
                                                                     when: str) -> None:
    """The first Ctrl-C stops gracefully: the update in flight finished, a checkpoint
    written, the summary printed; then the launcher says where it stopped, what was saved
    and how to go on, and dies of SIGINT (a shell's status 130). Before training began
    there is nothing to evaluate: the initial weights are not scored."""
    metrics, checkpoints = tmp_path / "m.jsonl", tmp_path / "ck"
    spec = tmp_path / "slow_to_load.py"
    # Before training: rank 1 still loading its data holds the start gate shut.
    spec.write_text(f"import sys, time\nsys.path.insert(0, {str(Path(DIGITS).parent)!r})\n"
                    "from digits import model, loss, evaluate, data as _data\n"
                    "def data(rank, world_size, batch_size):\n"
                    f"    if rank == 1 and {when == 'before training'}:\n"
                    "        time.sleep(60)\n"
                    "    return _data(rank, world_size, batch_size)\n")
    launcher = zygote.shared().popen(
        ["local", str(spec), "--workers", "2", "--steps", "100000", "--threads", "1", "--no-progress",
         "--json", "--metrics", str(metrics), "--checkpoint-dir", str(checkpoints),
         "--log-level", "info"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    said = []
    try:
        if when == "training":
            _wait_for_a_step(metrics, launcher)
        else:  # both workers in, the start gate waiting for the third
            assert launcher.stderr is not None
            while not any("worker 0 joined (" in line for line in said) or not any(
                    "worker 1 joined (" in line for line in said):
                said.append(launcher.stderr.readline())
                assert said[-1], said
        launcher.send_signal(signal.SIGINT)
        out, err = launcher.communicate(timeout=60)
        err = "".join(said) + err
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == -signal.SIGINT, err[-2000:]
    summary = json.loads(out)
    assert summary["stopped_by"] == "SIGINT"
    last = err.strip().splitlines()[-1]
    if when == "training":
        assert summary["steps"] > 0 and "accuracy" in summary
        assert last == (f"tensorbus: stopped by SIGINT at version {summary['steps']}: checkpoint "
                        f"{checkpoints}/ckpt-{summary['steps']:09d}.pt: run the same command "
                        "with --resume to go on")
    else:
        assert summary["steps"] == 0 and "accuracy" not in summary
        assert "stopping before training began" in err and "update in flight" not in err
        assert last == ("tensorbus: stopped by SIGINT at version 0: nothing was saved "
                        "(--checkpoint-dir DIR keeps a run's state)")
