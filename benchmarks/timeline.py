"""Where the wall time of a colocated sync version goes, from the run's own trace.

Runs `tensorbus local benchmarks/mlp.py --workers 2 --colocate --strategy sync --trace`
(batch 64, one torch thread a process) and reads, per version, the medians of:

- shard 0's `apply` (the step) and `broadcast` (the snapshot and the send) spans;
- each worker's `compute` span (loading the weights, forward and backward, until its update
  for shard 0 is ready) and `push` span, from then until shard 0's event loop takes the
  update: worker 0 reaches shard 0 in process, worker 1 over TCP;
- the gap from shard 0's broadcast of a version to each worker's compute on it: waiting for
  the other shard's broadcast and receiving both;
- the time from one version's apply to the next's.

Versions of the first third of the run are left out (warm-up). The trace's times are
wall-clock, so every figure includes the waits for a core (2 processes, each with an event
loop, a compute thread and ZeroMQ's I/O thread, on this machine's 2 cores). About 30 s:

    python -m benchmarks timeline [--params 1M] [--steps 1500]
    python -m benchmarks timeline --params 10M --steps 200

Writes benchmarks/results/timeline-PARAMS.md.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import steps
from benchmarks.report import RESULTS, Meta, write_markdown


def timeline(events: list[dict[str, Any]], first: int) -> dict[str, float]:
    """Median ms of each part of a version, from the versions after `first`."""
    apply, broadcast = (steps.spans_by_version(events, 0, n) for n in ("apply", "broadcast"))
    kept = sorted(v for v in apply if v > first and v in broadcast)
    parts: dict[str, list[float]] = {
        "shard 0: apply (the step)": [apply[v]["dur"] for v in kept],
        "shard 0: broadcast (snapshot and send)": [broadcast[v]["dur"] for v in kept],
        "version to version (apply to next apply)": [
            apply[v + 1]["ts"] - apply[v]["ts"] for v in kept if v + 1 in apply],
    }
    ends = {v: broadcast[v]["ts"] + broadcast[v]["dur"] for v in kept}  # of each broadcast
    for rank, how in ((0, "in process"), (1, "over TCP")):
        compute, push = (steps.spans_by_version(events, rank + 1, n) for n in ("compute", "push"))
        parts[f"worker {rank}: compute"] = [compute[v]["dur"] for v in kept if v in compute]
        parts[f"worker {rank}: push to shard 0 ({how})"] = [
            push[v]["dur"] for v in kept if v in push]
        parts[f"worker {rank}: shard 0's broadcast to its next compute"] = [
            compute[v]["ts"] - ends[v] for v in kept if v in compute]
    return {name: statistics.median(us) / 1000 for name, us in parts.items() if us}


def main(argv: Sequence[str], meta: Meta) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks timeline",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="1M", choices=["1M", "10M"])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    figures = timeline(steps.colocated_trace(args.params, args.steps), args.steps // 3)
    lines = [(f"{args.params} model, `local --workers 2 --colocate --strategy sync`, {args.steps} "
              f"versions; medians over versions {args.steps // 3 + 1} to {args.steps}"), "",
             "| part of a version | ms | ÷ version to version |", "|---|---:|---:|"]
    whole = figures["version to version (apply to next apply)"]
    lines += [f"| {name} | {ms:.2f} | {ms / whole:.2f} |" for name, ms in figures.items()]
    write_markdown(args.out / f"timeline-{args.params}.md", "\n".join(lines), meta)
    print("\n".join(lines))
