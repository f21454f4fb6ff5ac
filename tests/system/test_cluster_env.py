"""Cluster launch: rank, world size, local rank and the coordinator's address from torchrun's,
Open MPI's and Slurm's variables (`run.cluster`), flags first; `worker --workers-per-node`;
examples/slurm.sbatch names only real options.

Unit tests feed `run.cluster` a dict for an environment. The multi-process tests start a
real coordinator and workers that get nothing but a launcher's environment (no --connect,
no --rank), with ranks other than the ones a worker would take by default, and check the
ranks the coordinator saw and each worker reported.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import zygote
from cluster import LIVENESS, ROOT, Cluster
from zygote import Forked

from tensorbus.run import cli, flags
from tensorbus.run.cluster import (
    DEFAULT_PORT,
    Placement,
    child_environment,
    coordinator_port,
    expand_hostlist,
    node_rank,
    placement,
    workers,
)

UNIT = pytest.mark.timeout(10)
SLURM_SCRIPT = ROOT / "examples" / "slurm.sbatch"
# Any launcher's variable in the tests' own environment would confuse what they check.
LAUNCHER = re.compile(r"(SLURM_|OMPI_|PMI_|PMIX_).*|RANK|WORLD_SIZE|LOCAL_RANK|"
                      r"LOCAL_WORLD_SIZE|GROUP_RANK|MASTER_ADDR|MASTER_PORT")


def _clean() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not LAUNCHER.fullmatch(k)}


@contextmanager
def _free_listener() -> Iterator[int]:
    """A loopback port that is bound (so no one else takes it) but never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield int(s.getsockname()[1])


TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29600", "GROUP_RANK": "1"}
OPENMPI = {"OMPI_COMM_WORLD_RANK": "6", "OMPI_COMM_WORLD_SIZE": "16",
           "OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "8"}
SLURM = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
         "SLURM_JOB_NODELIST": "gpu-[007-008]", "SLURM_NNODES": "2"}


# --- run.cluster: one launcher at a time ---------------------------------------------------

@UNIT
def test_torchrun() -> None:
    assert placement(TORCHRUN) == Placement(
        rank=5, world_size=8, local_rank=1, coordinator_host="10.0.0.1",
        coordinator_port=29600, source="torchrun")
    assert placement(TORCHRUN).endpoint() == "tcp://10.0.0.1:29600"


@UNIT
def test_slurm_host_is_the_first_of_the_nodelist() -> None:
    found = placement(SLURM)
    assert found == Placement(rank=3, world_size=4, local_rank=1, coordinator_host="gpu-007",
                              coordinator_port=DEFAULT_PORT, source="slurm")
    assert placement(SLURM, port=7000).endpoint() == "tcp://gpu-007:7000"
    assert placement({**SLURM, "MASTER_PORT": "7001"}).endpoint() == "tcp://gpu-007:7001"
    # Older Slurm only sets SLURM_NODELIST.
    older = {k: v for k, v in SLURM.items() if k != "SLURM_JOB_NODELIST"}
    assert placement({**older, "SLURM_NODELIST": "a1,b[2-3]"}).coordinator_host == "a1"


@UNIT
def test_openmpi_takes_its_address_from_master_addr() -> None:
    found = placement({**OPENMPI, "MASTER_ADDR": "head", "MASTER_PORT": "6000"})
    assert found == Placement(rank=6, world_size=16, local_rank=2, coordinator_host="head",
                              coordinator_port=6000, source="openmpi")
    assert placement(OPENMPI).coordinator_host is None


@UNIT
def test_nothing_set() -> None:
    found = placement({})
    assert found == Placement(rank=-1, world_size=None, local_rank=0, coordinator_host=None,
                              coordinator_port=DEFAULT_PORT, source="flags")
    with pytest.raises(ValueError, match=r"^no coordinator address: give --connect "):
        found.endpoint()


@UNIT
@pytest.mark.parametrize(("text", "hosts"), [
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("a1,b[2-3]", ["a1", "b2", "b3"]),
    ("gpu-[001-003]", ["gpu-001", "gpu-002", "gpu-003"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("r[1-2]-n[1,3]", ["r1-n1", "r1-n3", "r2-n1", "r2-n3"]),
    ("x[3],y[01-02]z,solo", ["x3", "y01z", "y02z", "solo"]),
    ("127.0.0.[1-2]", ["127.0.0.1", "127.0.0.2"]),
])
def test_hostlists(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@UNIT
@pytest.mark.parametrize(("text", "why"), [
    ("node[1-", "unbalanced brackets"),
    ("node]1[", "unbalanced brackets"),
    ("n[[1]]", "unbalanced brackets"),
    ("n[3-1]", "'3-1' is neither a number nor a range LOW-HIGH"),
    ("n[a-b]", "'a-b' is neither a number nor a range LOW-HIGH"),
    ("n[]", "'' is neither a number nor a range LOW-HIGH"),
    ("a,,b", "an empty host name"),
])
def test_malformed_hostlists(text: str, why: str) -> None:
    with pytest.raises(ValueError) as raised:
        placement({"SLURM_JOB_NODELIST": text})
    assert str(raised.value) == f"SLURM_JOB_NODELIST={text!r}: {why}"


# --- precedence: torchrun, then Open MPI, then Slurm; flags over all ------------------------

@UNIT
def test_torchrun_inside_slurm_and_openmpi() -> None:
    found = placement({**SLURM, **OPENMPI, **TORCHRUN})
    assert (found.rank, found.world_size, found.local_rank, found.source) == (5, 8, 1, "torchrun")
    assert found.coordinator_host == "10.0.0.1"  # MASTER_ADDR over the nodelist


@UNIT
def test_openmpi_inside_slurm() -> None:
    found = placement({**SLURM, **OPENMPI})
    assert (found.rank, found.world_size, found.local_rank, found.source) == (6, 16, 2, "openmpi")
    assert found.coordinator_host == "gpu-007"  # no MASTER_ADDR: Slurm's nodelist


@UNIT
def test_flags_win() -> None:
    found = placement({**SLURM, **TORCHRUN}, rank=12, port=7000)
    assert (found.rank, found.coordinator_port, found.source) == (12, 7000, "flags")
    assert found.world_size is None  # the environment's numbering is not the flag's
    assert placement(TORCHRUN, rank=-1).rank == -1  # --rank -1: any, as asked


@UNIT
def test_empty_variables_count_as_unset() -> None:
    assert placement({"RANK": "", "SLURM_PROCID": "2", "SLURM_NTASKS": "3",
                      "MASTER_ADDR": " "}).source == "slurm"


@UNIT
@pytest.mark.parametrize(("environ", "message"), [
    ({"RANK": "one", "WORLD_SIZE": "2"}, "RANK='one' is not an integer"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK=-1 must be at least 0"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is not below WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be at least 1"),
    ({"RANK": "0", "LOCAL_RANK": "4", "LOCAL_WORLD_SIZE": "4"},
     "LOCAL_RANK=4 is not below LOCAL_WORLD_SIZE=4"),
    ({"RANK": "0", "LOCAL_RANK": "x"}, "LOCAL_RANK='x' is not an integer"),
    ({"SLURM_PROCID": "4", "SLURM_NTASKS": "4"}, "SLURM_PROCID=4 is not below SLURM_NTASKS=4"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2.5"}, "SLURM_NTASKS='2.5' is not an integer"),
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "2"},
     "OMPI_COMM_WORLD_RANK=3 is not below OMPI_COMM_WORLD_SIZE=2"),
    ({"MASTER_PORT": "http"}, "MASTER_PORT='http' is not an integer"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a port (1..65535)"),
    ({"MASTER_PORT": "0"}, "MASTER_PORT=0 must be at least 1"),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else None)
def test_inconsistent_values(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError) as raised:
        placement(environ)
    assert str(raised.value) == message


@UNIT
def test_node_rank_and_worker_count() -> None:
    assert node_rank({"GROUP_RANK": "2", "SLURM_NODEID": "1"}) == 2
    assert node_rank({"SLURM_NODEID": "1"}) == 1
    assert node_rank({"SLURM_NODEID": "1"}, 3) == 3
    assert node_rank({}) == 0
    with pytest.raises(ValueError, match=r"^--node-rank must be at least 0, got -1$"):
        node_rank({}, -1)
    assert workers({"WORLD_SIZE": "6", "SLURM_NTASKS": "1"}) == 6
    assert workers({"WORLD_SIZE": "6"}, 2) == 2
    with pytest.raises(ValueError, match=r"^the coordinator needs --workers N"):
        workers({"SLURM_NTASKS": "8"})  # a Slurm step's task count is not the workers'
    assert coordinator_port({"MASTER_PORT": "1234"}) == 1234
    with pytest.raises(ValueError, match=r"^--port 0 is not a port"):
        coordinator_port({}, 0)


@UNIT
def test_a_node_worker_environment() -> None:
    child = child_environment({**SLURM, **TORCHRUN, "PATH": "/bin"}, rank=6, local_rank=2,
                              local_world_size=4, node_rank=1)
    assert "WORLD_SIZE" not in child and child["PATH"] == "/bin"
    assert placement(child).rank == 6 and placement(child).local_rank == 2
    assert (child["LOCAL_WORLD_SIZE"], child["GROUP_RANK"]) == ("4", "1")


# --- the command line ------------------------------------------------------------------------

@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    for name in list(os.environ):
        if LAUNCHER.fullmatch(name):
            monkeypatch.delenv(name)
    yield monkeypatch


def _error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert cli.main(list(argv)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@UNIT
@pytest.mark.parametrize(("argv", "environ", "line"), [
    (["worker", "s.py"], {},
     ("error: no coordinator address: give --connect tcp://HOST:PORT, or set MASTER_ADDR (and "
      "MASTER_PORT or --port), or run under Slurm (SLURM_JOB_NODELIST)")),
    (["worker", "s.py"], {"SLURM_PROCID": "2", "SLURM_NTASKS": "2"},
     "error: SLURM_PROCID=2 is not below SLURM_NTASKS=2"),
    (["worker", "s.py", "--connect", "tcp://h:1", "--port", "2"], {},
     ("error: --port goes with an address from the environment (MASTER_ADDR or Slurm's "
      "nodelist): with --connect, give the port in it")),
    (["worker", "s.py", "--workers-per-node", "2", "--rank", "1"], {},
     ("error: --rank and --workers-per-node exclude each other: worker L of a node takes rank "
      "NODE_RANK*G+L (see --node-rank)")),
    (["worker", "s.py", "--node-rank", "1"], {},
     "error: --node-rank numbers the nodes of --workers-per-node: give both, or neither"),
    (["coordinator", "s.py"], {},
     ("tensorbus: error: the coordinator needs --workers N (or WORLD_SIZE=N in its "
      "environment): how many workers to train with")),
    (["coordinator", "s.py", "--bind", "tcp://127.0.0.1:1", "--port", "2"], {"WORLD_SIZE": "2"},
     "tensorbus: error: give --bind tcp://HOST:PORT or --port PORT, not both"),
    # A public bind needs keys (or --insecure).
    (["coordinator", "s.py", "--bind", "tcp://0.0.0.0:6000"], {"WORLD_SIZE": "2"},
     ("tensorbus: error: --bind tcp://0.0.0.0:6000 is not a loopback address and no --keys "
      "were given: anyone who can reach it could join and read the weights; make keys with "
      "`tensorbus keys DIR` and pass --keys DIR, or pass --insecure to accept that")),
], ids=["no-address", "bad-slurm", "port-and-connect", "rank-and-per-node",
        "node-rank-alone", "no-workers", "bind-and-port", "public-bind-needs-keys"])
def test_command_line_errors(argv: list[str], environ: dict[str, str], line: str,
                             no_launcher: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    for name, value in environ.items():
        no_launcher.setenv(name, value)
    assert _error(capsys, *argv) == line


# --- examples/slurm.sbatch -----------------------------------------------------------------

def _tensorbus_commands(script: str) -> list[list[str]]:
    """Every `tensorbus ...` the script runs, its shell variables replaced by `1`."""
    logical = re.sub(r"\\\n", " ", script)
    commands = []
    for line in logical.splitlines():
        if line.lstrip().startswith("#"):
            continue
        line = re.sub(r"\$\(\([^)]*\)\)|\$\([^)]*\)|\$\{[^}]*\}|\$\w+", "1", line)
        words = shlex.split(line, comments=True)
        if "tensorbus" not in words:
            continue
        args = words[words.index("tensorbus") + 1:]
        ends = [i for i, w in enumerate(args) if w in ("&", "&&", "||", ";", "|")]
        commands.append(args[:ends[0]] if ends else args)
    return commands


@pytest.mark.timeout(20)
def test_the_slurm_script_is_valid_bash_and_uses_real_options() -> None:
    subprocess.run(["bash", "-n", str(SLURM_SCRIPT)], check=True, timeout=10)
    commands = _tensorbus_commands(SLURM_SCRIPT.read_text())
    assert sorted(c[0] for c in commands) == ["coordinator", "keys", "worker"]
    for command in commands:
        flags.parser().parse_args(command)  # an unknown option exits: the test fails
    worker = next(c for c in commands if c[0] == "worker")
    assert "--workers-per-node" in worker and "--connect" not in worker


# --- real processes ------------------------------------------------------------------------

class EnvCluster(Cluster):
    """`Cluster`, with processes started in an environment of the test's choosing."""

    def start_in(self, log: str, environ: Mapping[str, str],
                 *args: str) -> Forked:
        with (self.tmp / log).open("a") as stderr:
            process = zygote.shared().popen(
                [*args], cwd=ROOT, text=True, env=dict(environ),
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr,
            )
        self._all.append(process)
        return process

    def coordinator_in(self, environ: Mapping[str, str], *args: str) -> None:
        self.coordinator = self.start_in(
            "coordinator.log", environ, "coordinator", str(self.spec), *self._bind_args(),
            "--no-progress", "--json", "--metrics", str(self.metrics),
            "--steps", "5", "--batch-size", "16", "--max-workers", "4", *LIVENESS,
            "--threads", "1", *args)
        self._learn_ports()

    def worker_in(self, log: str, environ: Mapping[str, str], *args: str) -> Forked:
        return self.start_in(log, environ, "worker", str(self.spec), "--threads", "1",
                             "--log-level", "info", *args)

    def log(self, name: str) -> str:
        return (self.tmp / name).read_text()


def _trained(c: EnvCluster, workers: list[Forked]) -> dict[str, Any]:
    summary, _ = c.finish(timeout=40)
    for worker in workers:
        assert worker.wait(timeout=20) == 0, c.logs()
    assert summary["steps"] == 5
    return summary


@pytest.mark.timeout(60)
def test_workers_placed_by_torchrun_and_slurm_variables(tmp_path: Path) -> None:
    """Ranks 3 and 1 of 4 (not 0 and 1, which a worker left to choose would take)."""
    c = EnvCluster(tmp_path)
    clean = _clean()
    try:
        c.coordinator_in(clean, "--workers", "2")
        torchrun = c.worker_in("torchrun.log", {
            **clean, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(c.port), "RANK": "3",
            "WORLD_SIZE": "4", "LOCAL_RANK": "0"})
        slurm = c.worker_in("slurm.log", {
            **clean, "SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
            "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "127.0.0.[1-2]"}, "--port", str(c.port))
        summary = _trained(c, [torchrun, slurm])
    finally:
        c.reap()
    assert sorted(summary["per_worker"]) == ["1", "3"], c.logs()
    assert "worker 3 done" in c.log("torchrun.log")
    assert "worker 1 done" in c.log("slurm.log")


@pytest.mark.timeout(60)
def test_workers_per_node(tmp_path: Path) -> None:
    """One `worker --workers-per-node 2` on node 1 (SLURM_NODEID): ranks 2 and 3; the
    coordinator's worker count from WORLD_SIZE."""
    c = EnvCluster(tmp_path)
    clean = _clean()
    try:
        c.coordinator_in({**clean, "WORLD_SIZE": "2"})
        node = c.worker_in("node.log", {
            **clean, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(c.port),
            "SLURM_NODEID": "1"}, "--workers-per-node", "2")
        summary = _trained(c, [node])
    finally:
        c.reap()
    assert summary["workers"] == 2
    assert sorted(summary["per_worker"]) == ["2", "3"], c.logs()
    log = c.log("node.log")
    for rank in (2, 3):  # relayed, prefixed, from the worker of that rank
        assert re.search(rf"^\[worker {rank}\] .*worker {rank} done", log, re.MULTILINE), log


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("signal_name", "to"), [
    ("SIGINT", "group"), ("SIGINT", "node"), ("SIGTERM", "node")])
def test_a_signal_on_a_node_reaches_its_workers_which_leave_at_once(
    tmp_path: Path, signal_name: str, to: str
) -> None:
    """Ctrl-C in the node's terminal (SIGINT to its process group) reaches its workers too,
    as it would reach workers it started as subprocesses; a signal to the node alone is
    passed on to them. Each leaves the run on the signal, what it said last is relayed,
    and the node dies of the signal once they have, well within its grace for workers that
    do not leave (5 s)."""
    c = EnvCluster(tmp_path)
    clean = _clean()
    try:
        c.coordinator_in({**clean, "WORLD_SIZE": "2"}, "--steps", "100000")
        node = c.worker_in("node.log", {
            **clean, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(c.port)},
            "--workers-per-node", "2", "--fault", "slow:20")
        c.wait_for("a step with both", lambda rs: any(
            r["event"] == "step" and r["workers"] == [0, 1] for r in rs))
        if to == "group":  # (the zygote's child leads its own group)
            os.killpg(node.pid, signal.Signals[signal_name])
        else:
            node.send_signal(signal.Signals[signal_name])
        interrupted = time.monotonic()
        code = node.wait(timeout=30)
        took = time.monotonic() - interrupted
        # With no worker left the coordinator ends by itself (not killed: its shared memory
        # goes with it), saying so.
        assert c.coordinator is not None and c.coordinator.wait(timeout=30) == 1
    finally:
        c.reap()
    assert code == -signal.Signals[signal_name], c.logs()
    assert took < 4.0, took
    assert "no worker is left" in c.log("coordinator.log")
    log = c.log("node.log")
    for rank in (0, 1):
        assert f"[worker {rank}] worker {rank} left the run on {signal_name}" in log, log
    assert "error" not in log, log  # (a node stopped as asked: no error of its own)


@pytest.mark.timeout(40)
def test_a_node_whose_workers_fail_fails(tmp_path: Path) -> None:
    """No coordinator: both workers give up after --join-timeout; the node says so in one
    line, the first failure's, and exits 1 (not 0, as if its workers had trained)."""
    with _free_listener() as port:  # nothing will answer on it
        done = zygote.shared().run(
            ["worker", str(ROOT / "examples" / "digits.py"),
             "--workers-per-node", "2", "--connect", f"tcp://127.0.0.1:{port}",
             "--join-timeout", "1", "--threads", "1"],
            cwd=ROOT, env=_clean(), capture_output=True, text=True, timeout=35,
            stdin=subprocess.DEVNULL, check=False)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith(f"error: worker 0 failed (exit status 1): coordinator at "
                                f"tcp://127.0.0.1:{port} did not answer join within 1.0 s")
    assert lines[-1].endswith("(2 of this node's 2 workers failed)")
    assert not any(line.startswith("error:") for line in lines[:-1])


@pytest.mark.parametrize(("keys", "host"), [(None, "127.0.0.1"), (Path("k"), "0.0.0.0")])
def test_the_default_bind_is_public_only_with_keys(keys: Path | None, host: str) -> None:
    """`tensorbus coordinator SPEC --workers 2` works as written: loopback, without keys."""
    args = argparse.Namespace(bind=None, port=6000, keys=keys, workers=2)
    assert cli._served(args) == (f"tcp://{host}:6000", 2)
