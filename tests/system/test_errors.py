"""Every failure a user can cause: one line saying what is wrong and what to do, and an exit
status that is not 0. These are the messages of the README's table, checked word for word
where they are fixed and by their parts where they hold a port or a path.

The mismatches (keys, release, protocol) run against one coordinator with keys, started
once; each refused worker is a real process that must give up at once, not at its timeout.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zygote
from cluster import Cluster

from tensorbus.run import cli

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
DIGITS = str(ROOT / "examples" / "digits.py")


def _tensorbus(*args: str, python: str | None = None,
               timeout: float = 45) -> subprocess.CompletedProcess[str]:
    """`tensorbus ARGS`, or the same after running `python` first (to fake another build)."""
    if python is None:
        return zygote.tensorbus(*args, timeout=timeout)
    code = "import sys; from tensorbus.run.cli import main; sys.exit(main(sys.argv[1:]))"
    return zygote.shared().run(args, code=f"{python}; {code}", capture_output=True, text=True,
                               timeout=timeout)


def _one_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_spec_that_does_not_exist() -> None:
    done = _tensorbus("local", "nope.py", "--workers", "2")
    assert done.returncode == 2
    assert _one_line(done) == ("tensorbus: error: SPEC nope.py: no such file: give a Python "
                               "file's path, or module:object")


@pytest.mark.parametrize(("args", "line"), [
    (["--steps", "3", "--epochs", "2"],
     "tensorbus local: error: argument --epochs: not allowed with argument --steps "
     "(see tensorbus local --help)"),
    (["--strategy", "sync", "--staleness", "2"],
     "tensorbus: error: --staleness is an option of ssp, not of sync: drop it, or choose "
     "--strategy ssp"),
    (["--resume"], "tensorbus: error: --resume and --checkpoint-every need --checkpoint-dir"),
    (["--min-workers", "3"], "tensorbus: error: --min-workers must be in 1..--workers (2), got 3"),
    (["--strategy", "average", "--compress", "bf16"],
     "tensorbus: error: under average workers push weights, which --compress sends as int8 "
     "or int4 only: choose one of those, or sync, ssp or async"),
    (["--strategy", "sync", "--compress", "int4"],
     "tensorbus: error: --compress int8 and int4 quantize the weights average pushes, and "
     "sync pushes gradients: choose bf16, fp16 or topk:R"),
    (["--epochs", "0"], "tensorbus: error: --epochs must be at least 1, got 0"),
    (["--threads", "0"], "tensorbus: error: --threads must be at least 1, got 0"),
    (["--batch-size", "0"], "tensorbus: error: --batch-size must be at least 1, got 0"),
    (["--heartbeat", "0.5", "--timeout", "0"],
     "tensorbus: error: --heartbeat must be above 0 and below --timeout, got 0.5 and 0"),
    # A strategy's own checks, said with the flags, not the Python arguments' names.
    (["--strategy", "average", "--average-every", "0"],
     "tensorbus: error: --average-every must be at least 1, got 0"),
    (["--strategy", "average", "--outer-momentum", "0.9"],
     "tensorbus: error: --outer-momentum or --nesterov needs --outer-lr"),
    (["--eval-every", "0"], "tensorbus: error: --eval-every must be positive, got 0"),
], ids=["steps-and-epochs", "option-of-another-strategy", "resume-without-dir", "min-workers",
        "compress-weights", "quantize-gradients", "no-epochs", "no-threads", "no-batch", "heartbeat-timeout",
        "average-every", "outer-lr", "eval-every"])
def test_a_wrong_combination_of_flags(args: list[str], line: str) -> None:
    done = _tensorbus("local", DIGITS, "--workers", "2", *args)
    assert done.returncode == 2
    assert _one_line(done) == line


def test_an_address_in_use_names_the_port_taken() -> None:
    with socket.socket() as taken, socket.socket() as free:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _tensorbus("coordinator", DIGITS, "--bind", f"tcp://127.0.0.1:{port}",
                          "--workers", "1")
        assert done.returncode == 1
        assert _one_line(done) == (
            f"tensorbus: error: cannot bind the request port, tcp://127.0.0.1:{port} (Address "
            "already in use): stop what holds it (a coordinator still running?), or choose "
            "another port")
        free.bind(("127.0.0.1", 0))
        request = free.getsockname()[1]
        free.close()  # (free again, for the coordinator; its broadcast port is taken)
        done = _tensorbus("coordinator", DIGITS, "--bind", f"tcp://127.0.0.1:{request}",
                          "--pub-port", str(port), "--workers", "1")
        assert done.returncode == 1
        assert _one_line(done) == (
            f"tensorbus: error: cannot bind the broadcast port, tcp://127.0.0.1:{port} (Address "
            "already in use), which is the request port + 1 unless --pub-port says otherwise: "
            "stop what holds it, or give another --pub-port")


def test_workers_that_never_join() -> None:
    # Port 0: a random port, and a random one for broadcasts (a fixed PORT would also need
    # PORT+1 free).
    done = _tensorbus("coordinator", DIGITS, "--bind", "tcp://127.0.0.1:0",
                      "--workers", "2", "--join-timeout", "1")
    assert done.returncode == 1
    assert re.fullmatch(
        r"tensorbus: error: only 0 of 2 workers joined within 1 s: are they started, and "
        r"pointed at tcp://127\.0\.0\.1:\d+\? \(--join-timeout waits longer\)", _one_line(done))


def test_an_interrupt_while_starting_is_one_line_and_status_130() -> None:
    """Ctrl-C while Python still imports torch (run.entry), before any signal handler of
    ours: the same one line and status as an interrupt at any later point."""
    process = subprocess.Popen([sys.executable, "-m", "tensorbus", "local", DIGITS, "--workers", "2"],
                               cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               stdin=subprocess.DEVNULL, text=True)
    try:
        # Once torch's libraries are being loaded, and long before they all are.
        maps = Path(f"/proc/{process.pid}/maps")
        deadline = time.monotonic() + 20
        while "libtorch" not in maps.read_text() and time.monotonic() < deadline:
            time.sleep(0.01)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130, stderr
    assert stderr.strip() == "tensorbus: error: interrupted"


def test_an_interrupt_in_a_finalizer_is_noted_and_not_printed() -> None:
    """Ctrl-C that lands in code whose exceptions Python can only print (a finalizer, or
    importlib's module-lock callback, as seen once in CI during the test above): noted,
    so that the run ends as interrupted in its one line, and not printed."""
    probe = ("import os, signal, sys, time\n"
             "from tensorbus.run import interrupts\n"
             "interrupts.note()\n"
             "class Finalized:\n"
             "    def __del__(self):\n"
             "        os.kill(os.getpid(), signal.SIGINT)\n"
             "        time.sleep(1)\n"
             "Finalized()\n"
             "print(interrupts.noted())\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          text=True, timeout=30, check=False)
    assert (done.returncode, done.stdout, done.stderr) == (0, "True\n", "")


def test_an_interrupt_that_a_spec_library_swallows_is_still_an_interrupt(tmp_path: Path) -> None:
    """Ctrl-C while the SPEC imports, caught by a library's bare `except:`, which then fails
    on its half-made state (a RecursionError, seen once in CI when the interrupt above
    landed there): the run ends as interrupted, not with the library's error."""
    spec = tmp_path / "swallows.py"
    spec.write_text(Path(DIGITS).read_text().replace("from __future__ import annotations", (
        "from __future__ import annotations\n"
        "import os, signal, time\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(5)\n"
        "except:  # noqa: E722 - as the library did\n"
        "    pass\n"
        "raise RecursionError('maximum recursion depth exceeded')\n"), 1))
    done = _tensorbus("local", str(spec), "--workers", "1")
    assert (done.returncode, done.stderr.strip()) == (130, "tensorbus: error: interrupted")


def test_a_public_address_without_keys() -> None:
    done = _tensorbus("coordinator", DIGITS, "--bind", "tcp://0.0.0.0:5555", "--workers", "1")
    assert done.returncode == 2
    assert _one_line(done) == (
        "tensorbus: error: --bind tcp://0.0.0.0:5555 is not a loopback address and no --keys "
        "were given: anyone who can reach it could join and read the weights; make keys with "
        "`tensorbus keys DIR` and pass --keys DIR, or pass --insecure to accept that")


def test_an_unreachable_coordinator() -> None:
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    done = _tensorbus("worker", DIGITS, "--connect", endpoint, "--join-timeout", "1.5")
    assert done.returncode == 1
    assert _one_line(done) == (
        f"error: coordinator at {endpoint} did not answer join within 1.5 s: no connection was "
        "made: is the coordinator running and reachable at that address (check --connect, and "
        "the host's firewall)?")


def test_a_data_shard_empty_for_a_rank(tmp_path: Path) -> None:
    spec = tmp_path / "uneven.py"
    spec.write_text(Path(DIGITS).read_text() + (
        "\n\n_all_data = data\n\n"
        "def data(rank, world_size, batch_size):\n"
        "    return [] if rank == 1 else _all_data(rank, world_size, batch_size)\n"))
    done = _tensorbus("local", str(spec), "--workers", "2", "--steps", "5", "--threads", "1",
                      "--no-progress")
    assert done.returncode == 1
    assert _one_line(done) == (
        f"tensorbus: error: worker 1 failed (exit status 1): SPEC {spec}: data(rank=1, "
        "world_size=2, batch_size=64) yielded no batches: every rank needs at least one; use fewer workers, "
        "a smaller --batch-size, or more data")


def test_a_loss_that_raises_names_the_spec(tmp_path: Path) -> None:
    spec = tmp_path / "bad_loss.py"
    spec.write_text(Path(DIGITS).read_text() + (
        "\n\ndef loss(output, target):\n"
        "    raise RuntimeError('shapes do not match')\n"))
    done = _tensorbus("local", str(spec), "--workers", "2", "--steps", "5", "--threads", "1",
                      "--no-progress")
    assert done.returncode == 1
    line = _one_line(done)
    assert line.startswith("tensorbus: error: worker "), line
    assert line.endswith(f"SPEC {spec}: worker {line.split()[3]}: forward, loss or backward "
                         "raised RuntimeError: shapes do not match (--debug shows the traceback)")


_MISTAKES = {
    "data-none": (
        "def data(rank, world_size, batch_size):\n    return None\n",
        ("SPEC {spec}: data(rank={rank}, world_size=2, batch_size=64) returned NoneType, not an "
         "iterable of (input, target) batches: return a list of them, or a DataLoader")),
    "loss-per-sample": (
        ("import torch.nn.functional as F\n\n\ndef loss(output, target):\n"
         "    return F.cross_entropy(output, target, reduction='none')\n"),
        ("loss(output, target) returned a tensor of shape (64,), not a tensor of one element: "
         "return the loss over the batch as a tensor (its mean, as "
         "torch.nn.functional.cross_entropy gives)")),
    "optimizer-none": (
        "def optimizer(params):\n    return None\n",
        ("optimizer(params) returned NoneType, not a torch.optim.Optimizer: return the "
         "optimizer it makes (or define no optimizer() for SGD with --lr)")),
    "scheduler-none": (
        "def scheduler(optimizer):\n    return None\n",
        ("scheduler(optimizer) returned NoneType, not a torch LR scheduler: return the one it "
         "makes on that optimizer (StepLR(optimizer, ...), say), or {{'scheduler': it, "
         "'interval': 'epoch' or 'step'}}")),
    "evaluate-float": (
        "def evaluate(model):\n    return 0.5\n",
        ("evaluate(model) returned float: it must return a dict of names to numbers, such as "
         "{{'accuracy': 0.91}}")),
}


@pytest.mark.parametrize("mistake", list(_MISTAKES))
def test_a_spec_function_that_returns_the_wrong_thing_is_said_so(tmp_path: Path, mistake: str) -> None:
    """Each is the SPEC's mistake, said in one line with what to return: not an internal
    error, a silent run on garbage (optimizer() returning None), nor a wrong hint."""
    body, says = _MISTAKES[mistake]
    spec = tmp_path / f"{mistake}.py"
    spec.write_text(Path(DIGITS).read_text() + "\n\n" + body)
    # (--steps 20: past the first pass of a rank's 14 batches.)
    done = _tensorbus("local", str(spec), "--workers", "2", "--steps", "20", "--threads", "1",
                      "--no-progress", "--metrics", str(tmp_path / "m.jsonl"))
    assert done.returncode in (1, 2), done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("tensorbus: error: "), last
    assert any(last.endswith(says.format(spec=spec, rank=rank)) for rank in (0, 1)), last
    assert "internal error" not in last and "--debug" not in last
    if mistake == "evaluate-float":  # what training made is kept all the same
        records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
        assert records[-1]["event"] == "summary" and records[-1]["steps"] == 20


def test_a_run_that_diverges_stops_with_what_to_change() -> None:
    done = _tensorbus("local", DIGITS, "--workers", "2", "--lr", "1e30", "--threads", "1",
                      "--no-progress")
    assert done.returncode == 1
    # Above it, the log's warnings and the same error as the coordinator logged it.
    assert done.stderr.strip().splitlines()[-1] == (
        "tensorbus: error: training diverged: every worker's last 8 updates were not finite "
        "(NaN or inf), at version 1: lower --lr, or use a larger --batch-size")


def test_a_loss_that_is_nan_from_the_start_stops_at_once(tmp_path: Path) -> None:
    """Not finite before any step (the SPEC's fault, not the lr's): said within seconds,
    not after --join-timeout as workers that never joined."""
    spec = tmp_path / "nan_loss.py"
    spec.write_text(Path(DIGITS).read_text() + (
        "\n_loss = loss\n\n\ndef loss(output, target):\n"
        "    return _loss(output, target) * float('nan')\n"))
    started = time.monotonic()
    done = _tensorbus("local", str(spec), "--workers", "2", "--threads", "1", "--no-progress")
    assert time.monotonic() - started < 30  # (--join-timeout is 300 s)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "tensorbus: error: every worker's first 8 updates were not finite (NaN or inf), on "
        "the initial weights, before any step: the SPEC's model(), loss() or data() gives "
        "them: check them on one batch")


@pytest.mark.parametrize("strategy", [["--strategy", "sync"], ["--strategy", "ssp", "--staleness", "0"]],
                         ids=["sync", "ssp"])
def test_one_rank_whose_updates_are_nan_stops_the_run_and_is_named(
        tmp_path: Path, strategy: list[str]) -> None:
    """The others wait on it with finite updates (at the barrier, or held by ssp's bound)
    and push no more: it is named within seconds, where the run spun for ever."""
    spec = tmp_path / "nan_rank.py"
    spec.write_text(Path(DIGITS).read_text() + (
        "\n_data = data\n\n\ndef data(rank, world_size, batch_size):\n"
        "    batches = list(_data(rank, world_size, batch_size))\n"
        "    if rank != 1:\n        return batches\n"
        "    return [(x * float('nan'), y) for x, y in batches]\n"))
    started = time.monotonic()
    done = _tensorbus("local", str(spec), "--workers", "3", "--steps", "50", *strategy,
                      "--threads", "1", "--no-progress")
    assert time.monotonic() - started < 30
    assert done.returncode == 1
    line = done.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        r"tensorbus: error: the (first|last) 8 updates of worker 1 were not finite \(NaN or "
        r"inf\), (on the initial weights, before any step|at version \d+), while workers 0 "
        r"and 2 wait for it with finite ones: the SPEC's data\(\) for that rank \(or the "
        r"model or loss on its batches\) gives them: check it on one batch"
        r"(; or training is diverging: lower --lr( \(with momentum correction on: the "
        r"stale-update remedies are momentum correction, the default, and --staleness-lr\))?)?",
        line), line


def test_under_async_one_rank_whose_updates_are_nan_contributes_nothing(tmp_path: Path) -> None:
    """Nobody waits on it under async: its updates are dropped and counted, it is warned
    of (once every 10 s), and the run goes on with the others to its end."""
    spec = tmp_path / "nan_rank.py"
    spec.write_text(Path(DIGITS).read_text() + (
        "\n_data = data\n\n\ndef data(rank, world_size, batch_size):\n"
        "    batches = list(_data(rank, world_size, batch_size))\n"
        "    if rank != 1:\n        return batches\n"
        "    return [(x * float('nan'), y) for x, y in batches]\n"))
    # (The others slowed, so that rank 1 pushes before they have made the 60 versions.)
    done = _tensorbus("local", str(spec), "--workers", "3", "--steps", "60", "--strategy",
                      "async", "--threads", "1", "--no-progress", "--json",
                      "--fault", "slow:0:30", "--fault", "slow:2:30")
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout)
    assert summary["steps"] == 60 and summary["dropped"]["not_finite"] >= 1
    assert summary["per_worker"]["1"]["applied"] == 0
    assert summary["per_worker"]["1"]["dropped"] == summary["dropped"]["not_finite"]
    warned = [line for line in done.stderr.splitlines() if "non-finite update" in line]
    assert len(warned) == 1 and "worker 1 pushed a non-finite update" in warned[0]


def test_workers_that_joined_but_never_pushed(tmp_path: Path) -> None:
    """Every worker joined, and no version came within --join-timeout: said so, not
    counted as workers that never joined."""
    spec = tmp_path / "slow_data.py"
    spec.write_text(Path(DIGITS).read_text() + (
        "\n_data = data\n\n\ndef data(rank, world_size, batch_size):\n"
        "    import time\n    time.sleep(5)\n    return _data(rank, world_size, batch_size)\n"))
    done = _tensorbus("local", str(spec), "--workers", "2", "--threads", "1", "--no-progress",
                      "--join-timeout", "3")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "tensorbus: error: every worker joined, but no version was made within 3 s: no push "
        "came (still loading data? --join-timeout waits longer)")


@pytest.mark.parametrize(("flag", "path", "line"), [
    ("--checkpoint-dir", "/proc/nope", "tensorbus: error: cannot write checkpoints in "
     "/proc/nope: No such file or directory: give a folder you can write in"),
    ("--metrics", "/nonexistent/dir/m.jsonl", "tensorbus: error: cannot write the metrics file "
     "/nonexistent/dir/m.jsonl: No such file or directory: give a path in a folder you can "
     "write in"),
])
def test_a_path_that_cannot_be_written(flag: str, path: str, line: str) -> None:
    """Said before any worker starts, not at the first checkpoint or record."""
    done = _tensorbus("local", DIGITS, "--workers", "2", "--steps", "5", "--no-progress",
                      flag, path)
    assert done.returncode == 2
    assert _one_line(done) == line


def test_resuming_a_checkpoint_of_another_run(tmp_path: Path) -> None:
    """Of another strategy: refused. Of as many workers with other batches: warned that
    the run will not retrace the one it resumes, and resumed."""
    ckpt = tmp_path / "ckpt"
    common = ["local", DIGITS, "--threads", "1", "--no-progress", "--checkpoint-dir", str(ckpt)]
    assert _tensorbus(*common, "--workers", "2", "--steps", "3").returncode == 0
    done = _tensorbus(*common, "--workers", "2", "--steps", "6", "--resume", "--strategy", "async")
    assert done.returncode == 2
    assert _one_line(done) == (
        f"tensorbus: error: {ckpt}/ckpt-000000003.pt was written by strategy sync, not async: "
        "resume with --strategy sync, or give another --checkpoint-dir")
    done = _tensorbus(*common, "--workers", "2", "--batch-size", "32", "--steps", "4", "--resume")
    assert done.returncode == 0, done.stderr
    assert ("resuming a run of 2 workers with batches of 64 as one of 2 with batches of 32: "
            "each rank's data goes on from where that rank had got to in its old shard, so "
            "the run does not retrace the one it resumes (same --workers and --batch-size "
            "would)") in done.stderr


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A coordinator with keys for worker `alice`, waiting for a worker that never comes."""
    tmp = tmp_path_factory.mktemp("keyed")
    assert _tensorbus("keys", str(tmp / "keys"), "--worker", "alice").returncode == 0
    assert _tensorbus("keys", str(tmp / "other"), "--worker", "alice").returncode == 0
    c = Cluster(tmp)
    try:
        c.start_coordinator("--workers", "1", "--steps", "5", "--keys", str(tmp / "keys"))
        yield c
    finally:
        c.reap()


def _worker_of(c: Cluster, *args: str, python: str | None = None) -> tuple[str, float]:
    started = time.monotonic()
    done = _tensorbus("worker", str(c.spec), "--connect", c.endpoint, "--join-timeout", "30",
                      *args, python=python)
    assert done.returncode == 1, done.stderr
    return _one_line(done), time.monotonic() - started


def test_a_worker_key_the_coordinator_does_not_list(keyed: Cluster) -> None:
    line, seconds = _worker_of(keyed, "--keys", str(keyed.tmp / "other"), "--key-name", "alice")
    assert line == (
        f"error: cannot talk to coordinator at {keyed.endpoint}: the coordinator refused the "
        "CURVE handshake: its authorized/ directory lacks this worker's public key (--key-name "
        "picks which), or the coordinator.key given is not the coordinator's")
    assert seconds < 15  # told at once, not after --join-timeout


def test_a_worker_without_keys_for_a_coordinator_with_them(keyed: Cluster) -> None:
    line, seconds = _worker_of(keyed)
    assert line == (
        f"error: cannot talk to coordinator at {keyed.endpoint}: one side uses CURVE keys and the "
        "other does not: give --keys to both the coordinator and the worker, or to neither")
    assert seconds < 15


def test_a_worker_of_another_release(keyed: Cluster) -> None:
    line, _ = _worker_of(keyed, "--keys", str(keyed.tmp / "keys"), "--key-name", "alice",
                         python=("import tensorbus.nodes.link as link; "
                                 "link.BUILD = '9.9.9'"))
    from tensorbus.bus.messages import BUILD
    assert line == (f"error: rejected (build): the worker runs tensorbus 9.9.9, the coordinator "
                    f"{BUILD}: install the same release on both")


def test_a_worker_of_another_protocol(keyed: Cluster) -> None:
    line, seconds = _worker_of(keyed, "--keys", str(keyed.tmp / "keys"), "--key-name", "alice",
                               python=("import tensorbus.bus.codec as codec; "
                                       "codec.PROTOCOL_VERSION = 1"))
    from tensorbus.bus.messages import PROTOCOL_VERSION
    assert line == (
        f"error: rejected (protocol): the coordinator speaks protocol {PROTOCOL_VERSION}, this "
        "worker 1: run the same tensorbus release on the coordinator and every worker")
    assert seconds < 15


def test_a_bug_is_one_line_and_its_traceback_is_for_debug(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path,
) -> None:
    def broken(args: object) -> int:
        raise KeyError("oops")

    monkeypatch.setattr(cli, "_keys", broken)
    assert cli.main(["keys", str(tmp_path)]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "tensorbus: error: internal error: KeyError: 'oops' (a bug in tensorbus: run again with "
        "--debug and report the traceback)"]
    assert cli.main(["keys", str(tmp_path), "--debug"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and "in broken" in err
    assert err.splitlines()[-1].startswith("tensorbus: error: internal error: KeyError")


def test_an_error_in_the_specs_code_offers_its_traceback(tmp_path: Path) -> None:
    spec = tmp_path / "raising.py"
    spec.write_text(Path(DIGITS).read_text() + "\n\ndef model():\n    return 1 / 0\n")
    done = _tensorbus("coordinator", str(spec), "--bind", "tcp://127.0.0.1:0", "--workers", "1")
    assert done.returncode == 2
    assert _one_line(done) == (f"tensorbus: error: SPEC {spec}: model() raised "
                               "ZeroDivisionError: division by zero (--debug shows the traceback)")
    done = _tensorbus("coordinator", str(spec), "--bind", "tcp://127.0.0.1:0", "--workers", "1",
                      "--debug")
    assert done.returncode == 2 and "in model\n" in done.stderr and "return 1 / 0" in done.stderr


@pytest.mark.parametrize(("args", "line"), [
    (["local", "s.py", "--workers", "2", "--stratgy", "sync"],
     "tensorbus: error: unrecognized arguments: --stratgy sync; did you mean --strategy? (see "
     "tensorbus --help)"),
    (["local", "s.py", "--workers", "2", "--strategy", "synk"],
     "tensorbus local: error: argument --strategy: invalid choice: 'synk' (choose from 'async', "
     "'async-average', 'average', 'ssp', 'sync'); did you mean sync? (see tensorbus local "
     "--help)"),
    # Never abbreviated: --worker is not taken for --workers.
    (["local", "s.py", "--worker", "2"],
     "tensorbus local: error: the following arguments are required: --workers (see tensorbus "
     "local --help)"),
], ids=["typo", "choice", "no-abbreviation"])
def test_an_argument_error_comes_at_once_with_what_was_meant(args: list[str], line: str) -> None:
    """Parsed before torch is imported: the answer takes a fraction of a second."""
    probe = ("import sys, time\nfrom tensorbus.run import entry\nsys.argv = ['tensorbus', *sys.argv[1:]]\n"
             "started = time.monotonic()\n"
             "try:\n    entry.main()\nexcept SystemExit as e:\n"
             "    print(e.code, 'torch' in sys.modules, time.monotonic() - started)\n")
    done = subprocess.run([sys.executable, "-c", probe, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=30, check=False)
    code, torch_imported, seconds = done.stdout.split()
    assert (code, torch_imported) == ("2", "False")
    assert float(seconds) < 0.5
    assert _one_line(done) == line


def test_lr_beside_a_spec_optimizer_is_refused_and_says_which_wins(tmp_path: Path) -> None:
    spec = tmp_path / "own_optimizer.py"
    spec.write_text(Path(DIGITS).read_text() + (
        "\n\nimport torch\n\n\ndef optimizer(params):\n"
        "    return torch.optim.SGD(params, lr=0.05, momentum=0.9)\n"))
    done = _tensorbus("local", str(spec), "--workers", "2", "--lr", "0.5")
    assert done.returncode == 2
    assert _one_line(done) == (
        f"tensorbus: error: --lr sets the learning rate of the default SGD, and SPEC {spec} "
        "defines optimizer(), whose own wins: set the lr there, or drop --lr")


def test_a_standby_of_a_shard_is_refused_in_one_line_before_anything_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """(In process: the refusal comes before the SPEC is loaded or anything binds.)"""
    assert cli.main(["coordinator", str(ROOT / "examples" / "digits.py"), "--bind",
                     "tcp://127.0.0.1:0", "--standby-of", "tcp://127.0.0.1:5555",
                     "--workers", "2", "--shard", "1/2"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "tensorbus: error: --standby-of follows one coordinator of a SPEC, without --shard, and "
        "this one has --shard: a standby of such runs is not built yet"]
