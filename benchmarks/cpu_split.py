"""Where the CPU of a colocated sync step goes, thread by thread (what limits b/ at 1M).

Starts `tensorbus local benchmarks/mlp.py --workers 2 --colocate --strategy sync` (batch 64,
one torch thread a process), lets it warm up, then reads the launcher's threads' CPU time
from /proc over a window and divides by the versions taken in it. The launcher is worker 0
and shard 0, as every process of the run is a worker and a shard. Threads are grouped by
what runs on them: the event loop (the main thread: sockets, codec, the shard's reduce and
step), ZeroMQ's I/O threads (`ZMQbg/IO/*`: the kernel's socket work), and the other threads
(the compute thread: loading weights, forward, backward, filling the outbox; and pyzmq's
zero-copy garbage collector). For the baseline it runs the single-process step of the same
model in the same invocation. Linux only. About a minute:

    python -m benchmarks cpu_split [--params 1M] [--seconds 8]

Writes benchmarks/results/cpu_split-PARAMS.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from benchmarks import checkout, steps
from benchmarks.report import RESULTS, ROOT, Meta, write_json, write_markdown

TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far (user + system), summed per group of the process's threads."""
    groups: dict[str, float] = defaultdict(float)
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        seconds = (int(fields[11]) + int(fields[12])) / TICK  # utime, stime
        if int(tid) == pid:
            groups["event loop (main thread)"] += seconds
        elif name.startswith("ZMQbg/IO"):
            groups["ZeroMQ I/O threads"] += seconds
        else:
            groups["compute and other threads"] += seconds
    return groups


def last_version(metrics: Path) -> int:
    versions = [json.loads(line)["version"] for line in metrics.read_text().splitlines()
                if '"event": "step"' in line]
    return versions[-1] if versions else 0


@contextmanager
def running(arguments: list[str], params: str, metrics: Path, warm: int
            ) -> Iterator[subprocess.Popen[str]]:
    """`tensorbus local SPEC *arguments --metrics metrics` on the `params` model, from once it
    has made `warm` versions to a graceful stop at the end of the block."""
    with checkout.cli(ROOT) as (tensorbus, env):  # its link lives as long as the run
        command = [*tensorbus, "local", steps.SPEC, *arguments, "--metrics", str(metrics),
                   "--no-progress", "--log-level", "error"]
        launcher = subprocess.Popen(command, cwd=ROOT, env={**env, "BENCH_PARAMS": params},
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 120
            while not (metrics.exists() and last_version(metrics) >= warm):
                if launcher.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the run did not get going: {stop(launcher)[-2000:]}")
                time.sleep(0.2)
            yield launcher
        finally:
            if launcher.returncode is None:
                stop(launcher)


def stop(launcher: subprocess.Popen[str]) -> str:
    """A graceful stop (the metrics summary is written), or a kill after a minute; what the
    run wrote to stderr."""
    launcher.send_signal(signal.SIGTERM)
    try:
        return launcher.communicate(timeout=60)[1]
    except subprocess.TimeoutExpired:
        launcher.kill()
        return launcher.communicate()[1]


def measure(params: str, seconds: float) -> dict[str, float]:
    """Per-version CPU milliseconds of the launcher's thread groups."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        with running(["--workers", "2", "--colocate", "--strategy", "sync", "--steps", "1000000",
                      "--threads", "1"], params, metrics, 100) as launcher:
            before, v0, t0 = thread_cpu(launcher.pid), last_version(metrics), time.monotonic()
            time.sleep(seconds)
            after, v1, t1 = thread_cpu(launcher.pid), last_version(metrics), time.monotonic()
    versions = v1 - v0
    split = {group: 1000 * (after[group] - before.get(group, 0.0)) / versions for group in after}
    return {**split, "total": sum(split.values()), "wall": 1000 * (t1 - t0) / versions}


def main(argv: Sequence[str], meta: Meta) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks cpu_split",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="1M", choices=["1M", "10M"])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    split = measure(args.params, args.seconds)
    single = 1000 * steps.single(args.params, 200)
    title = (f"{args.params} model: the launcher of `local --workers 2 --colocate`, per version, over "
             f"{args.seconds:g} s; beside it, one process's step of the same model and batch")
    lines = [title, "",
             "| where | CPU ms per version |", "|---|---:|"]
    lines += [f"| {group} | {ms:.2f} |" for group, ms in split.items() if group not in ("total", "wall")]
    lines += [f"| all threads of the process | {split['total']:.2f} |",
              f"| wall time per version | {split['wall']:.2f} |",
              f"| single-process step, same model and batch (wall) | {single:.2f} |",
              f"| wall time per version ÷ single-process step | {split['wall'] / single:.2f} |"]
    name = f"cpu_split-{args.params}"
    write_json(args.out / f"{name}.json", {**split, "single": single}, meta)
    write_markdown(args.out / f"{name}.md", "\n".join(lines), meta)
    print("\n".join(lines))
