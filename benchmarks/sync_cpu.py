"""What bounds part (b): the CPU one sync step costs, DDP's and colocated shards', side by side.

Both keep this machine's 2 cores busy (2 processes, one torch thread each, plus gloo's
threads or tensorbus's event loop and ZeroMQ's I/O thread), so a step's wall time follows
the CPU that it costs, all processes together. That cost is measured as
`benchmarks/async_cpu.py` measures an async update's: each contender runs S and 2S steps,
and the CPU time of its reaped processes (user + system, `getrusage`) is differenced, so
that start-up cancels out: (CPU(2S) - CPU(S)) / S. Beside it, the wall ms per step of the
longer run. Interleaved and repeated; medians, min and max. About 2 minutes at 1M:

    python -m benchmarks sync_cpu [--params 1M] [--steps 500] [--rounds 3]

Writes benchmarks/results/sync_cpu-PARAMS.md and .json.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

from benchmarks import steps
from benchmarks.async_cpu import measure, spread
from benchmarks.report import RESULTS, Meta, write_json, write_markdown


def contenders(params: str) -> dict[str, Callable[[int], float]]:
    """Name -> run it for that many steps and return its seconds per step."""
    return {
        "DDP (gloo)": lambda n: steps.ddp(params, n),
        "tensorbus colocated": lambda n: steps.tensorbus_sync(params, n, colocate=True),
    }


def main(argv: Sequence[str], meta: Meta) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks sync_cpu",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="1M", choices=["1M", "10M"])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    table = contenders(args.params)
    figures: dict[str, dict[str, list[float]]] = {n: {"cpu_ms": [], "wall_ms": []} for n in table}
    for r in range(args.rounds):
        for name, run in table.items():
            cpu_ms, seconds = measure(run, args.steps)
            figures[name]["cpu_ms"].append(cpu_ms)
            figures[name]["wall_ms"].append(1000 * seconds)
            print(f"round {r + 1}/{args.rounds} {name}: {cpu_ms:.2f} ms CPU, "
                  f"{1000 * seconds:.2f} ms wall per step", flush=True)
    lines = [(f"{args.params} model, 2 workers, batch 64, {args.steps} and {2 * args.steps} steps, "
              f"{args.rounds} rounds; median (min-max)"), "",
             "| contender | CPU ms per step, all processes | wall ms per step | CPU / wall |",
             "|---|---:|---:|---:|"]
    for name, f in figures.items():
        cpu, wall = f["cpu_ms"], f["wall_ms"]
        lines.append(f"| {name} | {statistics.median(cpu):.2f} ({min(cpu):.2f}-{max(cpu):.2f}) "
                     f"| {statistics.median(wall):.2f} ({min(wall):.2f}-{max(wall):.2f}) "
                     f"| {statistics.median(cpu) / statistics.median(wall):.2f} |")
    ours, ddp = figures["tensorbus colocated"], figures["DDP (gloo)"]
    lines.append("")
    for what, key in (("CPU", "cpu_ms"), ("wall time", "wall_ms")):
        ratios = [a / b for a, b in zip(ours[key], ddp[key], strict=True)]
        lines.append(f"- tensorbus colocated / DDP, {what} per step, within each round: "
                     f"{spread(ratios, '.2f')}")
    name = f"sync_cpu-{args.params}"
    write_json(args.out / f"{name}.json", figures, meta)
    write_markdown(args.out / f"{name}.md", "\n".join(lines), meta)
    print("\n".join(lines))
