"""Scripts that bring their own training loop (examples/own_loop.py): `tensorbus launch`,
`tensorbus coordinator` with no SPEC, torchrun, a world of one, and a script that dies."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import zygote
from cluster import ANY_PORT, bound_in_log

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "own_loop.py"
DIGITS = ROOT / "examples" / "digits.py"
QUIET = ["--threads", "1", "--no-progress", "--json"]

pytestmark = pytest.mark.timeout(120)


@contextmanager
def _coordinator(tmp_path: Path, *args: str) -> Iterator[tuple[Any, str, Path]]:
    """`tensorbus coordinator ARGS` with no SPEC on a free loopback port, logging at info
    into tmp_path: the process, its endpoint and its log. Killed at the end if still alive."""
    log = tmp_path / "coordinator.log"
    with log.open("w") as logged:
        coordinator = zygote.shared().popen(
            ["coordinator", "--bind", ANY_PORT, *args, *QUIET, "--log-level", "info"],
            cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=logged, text=True)
    try:
        endpoint, _ = bound_in_log(coordinator, log)
        yield coordinator, endpoint, log
    finally:
        if coordinator.poll() is None:
            coordinator.kill()
        coordinator.communicate(timeout=30)  # (reaped, its pipe closed; again: a no-op)


def _launch(*args: str, script: Path = EXAMPLE, timeout: float = 100) -> subprocess.CompletedProcess[str]:
    return zygote.shared().run(["launch", str(script), *args], cwd=ROOT, capture_output=True,
                               text=True, timeout=timeout, check=False)


def _variant(path: Path, *edits: tuple[str, str]) -> Path:
    """The example with `edits` (old, new) made, written to `path` (it finds digits.py
    where the example lies); each old text must be there."""
    text = EXAMPLE.read_text().replace("Path(__file__).resolve().parent", repr(str(EXAMPLE.parent)))
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new)
    path.write_text(text)
    return path


def _accuracies(err: str) -> dict[int, float]:
    """Each rank's last test accuracy, as the example logs it."""
    found = re.findall(r"rank (\d+) epoch \d+: test loss [\d.]+, accuracy ([\d.]+) %", err)
    return {int(rank): float(accuracy) for rank, accuracy in found}


def test_sync_gives_the_weights_of_the_spec_route(tmp_path: Path) -> None:
    """The example under sync with 2 workers, and examples/digits.py as a SPEC run with the
    same model, seed, data order and SGD: the same weights, to 1e-5. Also with
    --accumulate 2 (each batch in two parts, two backward passes a step() under
    backward_passes_per_step=2): the same weights, and as many pushes."""
    spec = zygote.shared().run(
        ["local", str(DIGITS), "--workers", "2", "--epochs", "2", "--batch-size", "16",
         "--lr", "0.1", "--seed", "0", "--save", str(tmp_path / "spec.pt"), *QUIET],
        cwd=ROOT, capture_output=True, text=True, timeout=100, check=False)
    assert spec.returncode == 0, spec.stderr
    theirs = torch.load(tmp_path / "spec.pt")
    for accumulate in ("1", "2"):
        own = _launch("--workers", "2", *QUIET, "--", "--epochs", "2", "--batch-size", "16",
                      "--lr", "0.1", "--seed", "0", "--accumulate", accumulate,
                      "--save", str(tmp_path / "own.pt"))
        assert own.returncode == 0, own.stderr
        summary = json.loads(own.stdout)
        assert summary["steps"] == json.loads(spec.stdout)["steps"] == 92
        assert [w["pushes"] for w in summary["per_worker"].values()] == [92, 92]
        # Counted from what the model took in training mode (its test, in eval mode, not).
        assert summary["samples"] == json.loads(spec.stdout)["samples"] == 92 * 2 * 16
        assert summary["ended"] == "every worker's script has ended"
        ours = torch.load(tmp_path / "own.pt")
        assert list(ours) == list(theirs)
        for name in ours:
            assert torch.allclose(ours[name], theirs[name], rtol=0, atol=1e-5), (accumulate, name)
        # Every rank ends on the same weights, so the same test figures.
        accuracies = _accuracies(own.stderr)
        assert sorted(accuracies) == [0, 1] and accuracies[0] == accuracies[1]


@pytest.mark.parametrize(("strategy", "options"), [
    ("sync", ["--backups", "1"]), ("ssp", ["--keys", "KEYS"]), ("async", ["--metrics", "METRICS"]),
    ("average", ["--average-every", "4", "--compress", "int4"]),
    ("async-average", ["--average-every", "4"]),
])
def test_every_strategy_trains_the_example(tmp_path: Path, strategy: str,
                                           options: list[str]) -> None:
    """Each strategy. ssp with CURVE keys: launch gives the scripts the key directory.
    async with StepLR halving the script's lr after each epoch: the coordinator steps each
    push with the rate it carries (92 versions a rate: every push is one)."""
    keys, metrics = tmp_path / "keys", tmp_path / "m.jsonl"
    if "KEYS" in options:
        made = zygote.shared().run(["keys", str(keys)], cwd=ROOT, capture_output=True,
                                   text=True, timeout=60, check=False)
        assert made.returncode == 0, made.stderr
    options = [{"KEYS": str(keys), "METRICS": str(metrics)}.get(o, o) for o in options]
    scheduled = ["--gamma", "0.5"] if strategy == "async" else []
    done = _launch("--workers", "2", "--strategy", strategy, *options, *QUIET, "--",
                   "--epochs", "2", *scheduled)
    assert done.returncode == 0, f"exit status {done.returncode}: {done.stderr}"
    summary = json.loads(done.stdout)
    assert summary["strategy"] == strategy and summary["steps"] > 0
    assert summary["ended"] == "every worker's script has ended"
    accuracies = _accuracies(done.stderr)
    assert sorted(accuracies) == [0, 1]
    # The rank that ends last tests a model of the whole run. One that ends first, under
    # async, tests the model of the versions made by then: seen at 39 % where the other
    # had 81 %, its 92 pushes all made while the other was held up (a loaded machine).
    assert max(accuracies.values()) > 60.0, f"accuracies {accuracies}: {done.stderr[-2000:]}"  # chance: 10 %
    assert min(accuracies.values()) > 25.0, f"accuracies {accuracies}: {done.stderr[-2000:]}"
    if scheduled:
        lrs = [r["lr"] for r in map(json.loads, metrics.read_text().splitlines())
               if r["event"] == "step"]
        assert sorted(lrs) == [0.05] * 92 + [0.1] * 92


def test_ctrl_c_reaches_every_script_as_it_would_alone(tmp_path: Path) -> None:
    """Ctrl-C in the terminal (SIGINT to the launcher's process group) reaches each script,
    forked or not, as it reaches `python SCRIPT`: it handles its KeyboardInterrupt and runs
    its atexit handlers; launch ends as interrupted, and nothing is left running."""
    script = tmp_path / "forever.py"
    script.write_text(textwrap.dedent(f"""\
        import atexit, os, pathlib, time, torch, tensorbus
        ctx = tensorbus.init()
        atexit.register(lambda: print(f"rank {{ctx.rank}} at exit", flush=True))
        model = torch.nn.Linear(4, 2)
        optimizer = tensorbus.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
        optimizer.zero_grad(); model(torch.randn(2, 4)).sum().backward(); optimizer.step()
        pathlib.Path({str(tmp_path)!r}, f"pid-{{ctx.rank}}").write_text(str(os.getpid()))
        try:
            while True:
                optimizer.zero_grad(); model(torch.randn(2, 4)).sum().backward(); optimizer.step()
                time.sleep(0.05)
        except KeyboardInterrupt:
            print(f"rank {{ctx.rank}} interrupted", flush=True)
            raise
    """))
    launcher = zygote.shared().popen(["launch", str(script), "--workers", "2", *QUIET], cwd=ROOT,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(pids := [p.read_text() for p in tmp_path.glob("pid-*")]) < 2:
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
            time.sleep(0.1)
        os.killpg(launcher.pid, signal.SIGINT)  # (the zygote's child leads its own group)
        out, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 130, err
    assert err.strip().splitlines()[-1] == "tensorbus: error: interrupted"
    for rank in (0, 1):
        assert f"rank {rank} interrupted" in out and f"rank {rank} at exit" in out, (out, err)
    assert [pid for pid in pids if Path(f"/proc/{pid}").exists()] == []


@pytest.mark.parametrize("how", ["raises", "killed"])
def test_a_script_that_dies_leaves_the_others_training(tmp_path: Path, how: str) -> None:
    """Rank 1 raises after its 31st step (its traceback is its own, and it leaves the run
    with its error), or is killed there (the launcher sees it die and removes it at once):
    rank 0 trains to its end alone. The summary is printed either way; a script that
    failed fails the launch at the end (exit 1), as a worker that failed fails `local`,
    and one that was killed was removed, as under `local`."""
    end = ("raise RuntimeError('rank 1 gives up')" if how == "raises"
           else "__import__('os').kill(__import__('os').getpid(), 9)")
    script = _variant(tmp_path / "dies.py", (
        "            optimizer.step()\n",
        "            optimizer.step()\n"
        "            if ctx.rank == 1 and epoch == 1 and i == 30:\n"
        f"                {end}\n"))
    done = _launch("--workers", "2", *QUIET, "--log-level", "info", "--", "--epochs", "2",
                   script=script)
    assert done.returncode == (1 if how == "raises" else 0), done.stderr
    summary = json.loads(done.stdout)
    assert summary["steps"] == 92  # rank 0 went on through both its epochs
    assert summary["per_worker"]["1"]["pushes"] == 31
    assert 0 in _accuracies(done.stderr) and 1 not in _accuracies(done.stderr)
    if how == "raises":
        assert "RuntimeError: rank 1 gives up" in done.stderr  # its traceback, in its output
        assert re.search(r"worker 1 .* left \(error: RuntimeError: rank 1 gives up\)",
                         done.stderr)
        assert summary["lost"] == []
        (failed,) = summary["failed"]
        assert failed["rank"] == 1 and failed["why"] == "RuntimeError: rank 1 gives up", failed
        assert done.stderr.splitlines()[-1] == (
            "tensorbus: error: the script of rank 1 exited with status 1 (its output says why); "
            "the run went on without it to its end")
    else:
        assert [w["rank"] for w in summary["lost"]] == [1] and summary["failed"] == []
        assert "(its script) died of SIGKILL: removed" in done.stderr


def test_a_rank_with_another_model_is_refused_in_one_line(tmp_path: Path) -> None:
    """Rank 1 builds a wider model: DistributedOptimizer raises there, saying so; the run
    cannot start, and rank 0, whose model the run took (it described it first), is told."""
    script = _variant(tmp_path / "other.py", (
        "    model = digits.model()\n",
        "    if ctx.rank == 1:\n"
        "        __import__('time').sleep(3)  # (rank 0 describes first)\n"
        "        digits.NUM_FEATURES = 65\n"
        "    model = digits.model()\n"))
    done = _launch("--workers", "2", *QUIET, "--", "--epochs", "1", script=script)
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == (
        "tensorbus: error: the script of rank 1 exited with status 1 before it joined (its "
        "output says why): the run cannot start with 2 workers")
    assert "RejectedError: rejected (layout): this script's model (layout " in done.stderr
    assert "is not the run's (layout " in done.stderr
    assert "every rank must build the same model" in done.stderr
    # Rank 0, which had joined, is told why the run ended, and does not wait to be ended.
    assert ("RunFailedError: the coordinator at tcp://127.0.0.1:" in done.stderr
            and "ended the run with an error: the script of rank 1 exited" in done.stderr)


def test_a_lost_coordinator_makes_step_raise_after_the_reconnect_deadline(tmp_path: Path) -> None:
    """SIGKILL the coordinator mid-run: each script's step() raises PeerTimeoutError once
    its link has been silent for --timeout and rejoining has failed for reconnect_timeout_s
    (counted from when it was last heard), and not long after."""
    script = _variant(tmp_path / "lost.py", (
        "backward_passes_per_step=args.accumulate)",
        "backward_passes_per_step=args.accumulate, reconnect_timeout_s=3.0)"), (
        "            optimizer.step()\n",
        "            try:\n"
        "                optimizer.step()\n"
        "            except tensorbus.PeerTimeoutError as e:\n"
        "                print('lost:', e, flush=True)\n"
        "                raise SystemExit(3)\n"))
    with _coordinator(tmp_path, "--workers", "2", "--heartbeat", "0.2",
                      "--timeout", "1") as (coordinator, endpoint, log):
        environ = {**os.environ, "TENSORBUS_COORDINATOR": endpoint, "WORLD_SIZE": "2",
                   "OMP_NUM_THREADS": "1"}
        scripts = [zygote.shared().popen(["--epochs", "1000"], script=script, cwd=ROOT,
                                         env={**environ, "RANK": str(r), "LOCAL_RANK": str(r)},
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                   for r in range(2)]
        try:
            deadline = time.monotonic() + 60
            while "first step with workers" not in log.read_text():
                assert time.monotonic() < deadline and coordinator.poll() is None, log.read_text()
                time.sleep(0.05)
            coordinator.kill()
            killed = time.monotonic()
            outputs = [script.communicate(timeout=30) for script in scripts]
            took = time.monotonic() - killed
        finally:
            for process in scripts:
                if process.poll() is None:
                    process.kill()
                process.communicate()
    for script, (out, err) in zip(scripts, outputs, strict=True):
        assert script.returncode == 3, err[-2000:]
        assert out.startswith("lost: "), out
    assert 3.0 < took < 15.0


def test_alone_the_script_is_a_plain_pytorch_script() -> None:
    environ = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "TENSORBUS_COORDINATOR")}
    done = subprocess.run([sys.executable, str(EXAMPLE), "--epochs", "1"], cwd=ROOT, env=environ,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert sorted(_accuracies(done.stderr)) == [0]


def test_torchrun_against_a_coordinator_started_by_hand(tmp_path: Path) -> None:
    """`tensorbus coordinator` with no SPEC, and torchrun's two processes finding it from
    TENSORBUS_COORDINATOR."""
    with _coordinator(tmp_path, "--workers", "2") as (coordinator, endpoint, log):
        environ = {**os.environ, "TENSORBUS_COORDINATOR": endpoint, "OMP_NUM_THREADS": "1"}
        ran = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
             str(EXAMPLE), "--epochs", "1"],
            cwd=ROOT, env=environ, capture_output=True, text=True, timeout=90, check=False)
        assert ran.returncode == 0, ran.stderr[-3000:]
        out, _ = coordinator.communicate(timeout=30)
    assert coordinator.returncode == 0, log.read_text()
    summary = json.loads(out)
    assert summary["steps"] == 46 and sorted(summary["per_worker"]) == ["0", "1"]
    assert sorted(_accuracies(ran.stderr + ran.stdout)) == [0, 1]


def test_with_keys_only_a_script_with_the_run_s_keys_gets_in(tmp_path: Path) -> None:
    """`tensorbus coordinator --keys DIR` with no SPEC: a script without keys is refused at
    the CURVE handshake and says so; one given the directory in TENSORBUS_KEYS trains."""
    keys = tmp_path / "keys"
    made = zygote.shared().run(["keys", str(keys)], cwd=ROOT, capture_output=True, text=True,
                               timeout=60, check=False)
    assert made.returncode == 0, made.stderr
    script = tmp_path / "tiny.py"
    script.write_text(
        "import torch, tensorbus\n"
        "tensorbus.init()\n"
        "model = torch.nn.Linear(4, 2)\n"
        "optimizer = tensorbus.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),"
        " model)\n"
        "for _ in range(5):\n"
        "    optimizer.zero_grad()\n"
        "    model(torch.ones(8, 4)).pow(2).mean().backward()\n"
        "    optimizer.step()\n")
    with _coordinator(tmp_path, "--workers", "1", "--keys", str(keys)) as (
            coordinator, endpoint, log):
        environ = {k: v for k, v in os.environ.items() if not k.startswith("TENSORBUS_")}
        environ.update(TENSORBUS_COORDINATOR=endpoint, RANK="0", WORLD_SIZE="1",
                       OMP_NUM_THREADS="1")
        plain = zygote.shared().run([], script=script, cwd=ROOT, env=environ,
                                    capture_output=True, text=True, timeout=60)
        assert plain.returncode != 0
        assert "HandshakeError" in plain.stderr, plain.stderr[-2000:]
        assert "one side uses CURVE keys and the other does not" in plain.stderr
        assert "(a script's keys: the directory in TENSORBUS_KEYS)" in plain.stderr
        keyed = zygote.shared().run([], script=script, cwd=ROOT,
                                    env={**environ, "TENSORBUS_KEYS": str(keys)},
                                    capture_output=True, text=True, timeout=60)
        assert keyed.returncode == 0, keyed.stderr[-2000:]
        out, _ = coordinator.communicate(timeout=30)
    assert coordinator.returncode == 0, log.read_text()
    summary = json.loads(out)
    assert summary["steps"] == 5 and sorted(summary["per_worker"]) == ["0"]
    assert summary["rejected"].get("handshake", 0) >= 1, summary["rejected"]
