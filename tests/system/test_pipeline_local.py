"""Multi-process: `tensorbus local --pipeline`, as a user runs it, with real stage workers.

- data x pipeline (2 pipelines of 2 stages) ends on the weights of plain sync on 2
  workers, and its summary has each stage's peak memory, activations held and bubble;
- a stage that dies stops its pipeline with a line naming the stage and the worker; the
  other pipeline goes on, or with none left the run fails with that line; a stage that
  goes silent is lost by its coordinator and stops its pipeline the same way;
- a model whose parameters and gradients exceed a worker's memory (capped with `--fault
  memory`) trains with --pipeline 4 and fails without it, with a line that says why;
- the SPEC and options a pipeline cannot use are refused in one line.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import zygote

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "examples" / "digits_pipeline.py"
FAST = ["--threads", "1", "--no-progress", "--heartbeat", "0.2", "--timeout", "3"]

# A model of 3 stages of 2048 x 2048 and a 2048 x 10 head (48 MB of parameters, 16 MB a
# stage), on random data.
BIG = '''
import torch
import torch.nn.functional as F
from torch import nn

def stages():
    return [nn.Linear(2048, 2048) for _ in range(3)] + [nn.Linear(2048, 10)]

def model():
    return nn.Sequential(*stages())

def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(batch_size, 2048, generator=g), torch.randint(0, 10, (batch_size,), generator=g))
            for _ in range(4)]

def loss(output, target):
    return F.cross_entropy(output, target)
'''
# What each worker may hold beyond what it holds as it starts: a stage (16 MB of weights,
# as many of gradients) fits, the whole model (48 MB, twice that with its gradients) not.
MEMORY_MB = 100


def _local(tmp_path: Path, *argv: str, spec: Path | None = None,
           timeout: float = 90) -> subprocess.CompletedProcess[str]:
    mine = tmp_path / (spec or SPEC).name
    if not mine.exists():
        shutil.copy(spec or SPEC, mine)
        if spec is None:  # (it reads examples/digits.py beside it)
            shutil.copy(SPEC.with_name("digits.py"), tmp_path / "digits.py")
    return zygote.tensorbus("local", str(mine), *FAST, *argv, cwd=ROOT, timeout=timeout)


def _summary(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert done.returncode == 0, done.stderr[-3000:]
    summary: dict[str, Any] = json.loads(done.stdout)
    return summary


def test_data_x_pipeline_ends_on_plain_sync_s_weights_and_says_each_stage_s_memory(
        tmp_path: Path) -> None:
    piped, plain = tmp_path / "piped.pt", tmp_path / "plain.pt"
    summary = _summary(_local(tmp_path, "--workers", "4", "--pipeline", "2", "--micro-batches",
                              "4", "--batch-size", "16", "--steps", "5", "--save", str(piped),
                              "--json", "--metrics", str(tmp_path / "m.jsonl")))
    _summary(_local(tmp_path, "--workers", "2", "--batch-size", "16", "--steps", "5", "--save",
                    str(plain), "--json"))
    a, b = torch.load(piped), torch.load(plain)
    assert list(a) == list(b)  # (model() is nn.Sequential(*stages()): the same names)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
    assert (summary["steps"], summary["workers"]) == (5, 4)
    pipeline = summary["pipeline"]
    assert (pipeline["stages"], pipeline["pipelines"], pipeline["micro_batches"]) == (2, 2, 4)
    assert pipeline["bubble_formula"] == round(1 / 5, 4) and 0 < pipeline["bubble"] < 1
    for stage in pipeline["per_stage"]:
        assert stage["peak_bytes"] > 0 and 0 < stage["busy_s"] < stage["span_s"]
    assert [s["held"] for s in pipeline["per_stage"]] == [2, 1]  # 1f1b: P - s
    last = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[-1])
    assert last["pipeline"] == pipeline  # (written to --metrics too)


def test_a_stage_that_dies_stops_its_pipeline_and_the_other_goes_on(tmp_path: Path) -> None:
    # Worker 1 is stage 1 of pipeline 0; killed at its third step.
    done = _local(tmp_path, "--workers", "4", "--pipeline", "2", "--micro-batches", "2",
                  "--steps", "12", "--fault", "crash:1:3", "--json")
    summary = _summary(done)
    assert ("stage 1 of pipeline 0 (worker 1) was killed by SIGKILL: pipeline 0 stopped; 1 "
            "pipeline(s) go on") in done.stderr
    assert summary["steps"] == 12
    # Stage 1's coordinator lost pipeline 0's worker; stage 0's saw its own leave.
    assert [s["lost"] for s in summary["pipeline"]["per_stage"]] == [[], [0]]


def test_a_pipeline_that_stops_with_none_left_fails_the_run_naming_the_stage(tmp_path: Path) -> None:
    done = _local(tmp_path, "--workers", "2", "--pipeline", "2", "--steps", "12",
                  "--fault", "crash:1:2")
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr.splitlines()[-1] == (
        "tensorbus: error: stage 1 of pipeline 0 (worker 1) was killed by SIGKILL: pipeline 0 "
        "stopped, and no pipeline is left")


def _child(launcher: zygote.Forked, name: str, timeout: float = 60) -> int:
    """The pid of the launcher's child named `name` (as run.children names a worker)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for task in Path(f"/proc/{launcher.pid}/task").iterdir():
            for pid in (task / "children").read_text().split():
                try:
                    if Path(f"/proc/{pid}/comm").read_text().strip() == name:
                        return int(pid)
                except OSError:
                    continue
        time.sleep(0.05)
    raise AssertionError(f"no child named {name!r}")


def test_a_silent_stage_is_lost_by_its_coordinator_and_its_pipeline_stops(tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    shutil.copy(SPEC, tmp_path / SPEC.name)
    shutil.copy(SPEC.with_name("digits.py"), tmp_path / "digits.py")
    launcher = zygote.shared().popen(
        ["local", str(tmp_path / SPEC.name), *FAST, "--workers", "4", "--pipeline", "2",
         "--steps", "400", "--json", "--metrics", str(metrics), "--timeout", "1.5"],
        cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stopped = None
    try:
        # (Named as run.children names it, cut to 15 bytes: both pipelines' stage 0 share
        # it, and the first found is one of them.)
        silent = _child(launcher, "tb stage 0 pipe")
        deadline = time.monotonic() + 60
        while not (metrics.exists() and metrics.read_text().count('"event": "step"') >= 5):
            assert time.monotonic() < deadline and launcher.poll() is None
            time.sleep(0.05)
        os.kill(silent, signal.SIGSTOP)
        stopped = silent
        out, err = launcher.communicate(timeout=90)
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 0, err[-3000:]
    # Whichever hears the silence first stops the pipeline, naming the stopped stage: its
    # coordinator (silent for --timeout: removed), or, under load, the next stage, waiting
    # for its activations (silent past --timeout too).
    by_coordinator = "was lost by its coordinator (silent for 1.5 s: removed): pipeline" in err
    by_neighbour = re.search(r"stage 0 of pipeline (\d) was silent for [\d.]+ s while this "
                             r"stage waited for the activations .*: pipeline \1 stopped", err)
    assert by_coordinator or by_neighbour, err[-3000:]
    assert "1 pipeline(s) go on" in err
    assert json.loads(out)["steps"] == 400


def test_a_model_larger_than_a_worker_trains_with_pipeline_4_and_fails_without(
        tmp_path: Path) -> None:
    big = tmp_path / "big.py"
    big.write_text(BIG)
    capped = [f"--fault=memory:{w}:{MEMORY_MB}" for w in range(4)]
    whole = _local(tmp_path, "--workers", "1", "--steps", "2", "--batch-size", "8", capped[0],
                   spec=big)
    assert whole.returncode == 1, whole.stderr[-3000:]
    assert whole.stderr.splitlines()[-1].startswith(
        "tensorbus: error: worker 0 failed (exit status 1): worker 0 ran out of memory: its "
        "parameters take 48.1 MB, and 96.2 MB with their gradients (under average, its "
        "optimizer's state besides), more than this worker may hold: cut the model into "
        "stages (stages() in the SPEC) and run with --pipeline P"), whole.stderr[-3000:]
    piped = _local(tmp_path, "--workers", "4", "--pipeline", "4", "--micro-batches", "2",
                   "--steps", "2", "--batch-size", "8", "--json", *capped, spec=big)
    summary = _summary(piped)
    assert summary["steps"] == 2
    stages = summary["pipeline"]["per_stage"]
    assert [s["parameters"] for s in stages] == [2048 * 2048 + 2048] * 3 + [2048 * 10 + 10]


@pytest.mark.parametrize(("argv", "line"), [
    (["--workers", "3", "--pipeline", "2"],
     "--workers 3 is not a multiple of --pipeline 2: N workers make N/P pipelines of P stages"),
    (["--workers", "2", "--pipeline", "2", "--strategy", "async"],
     "--pipeline serves each stage under sync or average, whose stages step together, not async"),
    (["--workers", "2", "--micro-batches", "2"],
     "--micro-batches cuts each batch for the stages of a pipeline: give --pipeline P too"),
    (["--workers", "5", "--pipeline", "5"],
     "SPEC {spec}: 4 module(s) cannot be cut into 5 pipeline stages: stages() must return at "
     "least as many modules as --pipeline"),
])
def test_what_a_pipeline_cannot_do_is_refused_in_one_line(tmp_path: Path, argv: list[str],
                                                           line: str) -> None:
    done = _local(tmp_path, *argv, "--steps", "1")
    assert done.returncode == 2, done.stderr[-3000:]
    spec = tmp_path / SPEC.name
    assert done.stderr.splitlines()[-1] == f"tensorbus: error: {line.format(spec=spec)}"


def test_a_spec_without_stages_is_told_what_to_define(tmp_path: Path) -> None:
    digits = tmp_path / "digits.py"
    shutil.copy(ROOT / "examples" / "digits.py", digits)
    done = _local(tmp_path, "--workers", "2", "--pipeline", "2", "--steps", "1", spec=digits)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.splitlines()[-1] == (
        f"tensorbus: error: SPEC {digits}: --pipeline 2 needs stages() -> list of "
        "torch.nn.Module, the model cut into modules that run in sequence: define it (see "
        "examples/digits_pipeline.py)")
