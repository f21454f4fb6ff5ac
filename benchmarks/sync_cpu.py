"""What bounds part (b): the CPU one sync step costs, DDP's and colocated shards', side by side.

Both keep this machine's 2 cores busy (2 processes, one torch thread each, plus gloo's
threads or tensorbus's event loop and ZeroMQ's I/O thread), so a step's wall time follows
the CPU that it costs, all processes together. That cost is measured as
`benchmarks/async_cpu.py` measures an async update's: each contender runs S and 2S steps,
and the CPU time of its reaped processes (user + system, `getrusage`) is differenced, so
that start-up cancels out: (CPU(2S) - CPU(S)) / S. Beside it, the wall ms per step of the
longer run. Interleaved and repeated; medians, min and max. About 2 minutes at 1M:

    python benchmarks/sync_cpu.py [--params 1M] [--steps 500] [--rounds 3]

Writes benchmarks/results/sync_cpu-PARAMS.md and .json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import steps
from benchmarks.async_cpu import measure

RESULTS = ROOT / "benchmarks" / "results"


def contenders(params: str) -> dict[str, Callable[[int], float]]:
    """Name -> run it for that many steps and return its seconds per step."""
    return {
        "DDP (gloo)": lambda n: steps.ddp(params, n),
        "tensorbus colocated": lambda n: steps.tensorbus_sync(params, n, colocate=True),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="1M", choices=["1M", "10M"])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    table = contenders(args.params)
    figures: dict[str, dict[str, list[float]]] = {n: {"cpu_ms": [], "wall_ms": []} for n in table}
    for r in range(args.rounds):
        for name, run in table.items():
            cpu_ms, seconds = measure(run, args.steps)
            figures[name]["cpu_ms"].append(cpu_ms)
            figures[name]["wall_ms"].append(1000 * seconds)
            print(f"round {r + 1}/{args.rounds} {name}: {cpu_ms:.2f} ms CPU, "
                  f"{1000 * seconds:.2f} ms wall per step", flush=True)
    lines = [(f"`python benchmarks/sync_cpu.py --params {args.params} --steps {args.steps} "
              f"--rounds {args.rounds}` (2 workers, batch 64; median (min-max))"), "",
             "| contender | CPU ms per step, all processes | wall ms per step | CPU / wall |",
             "|---|---:|---:|---:|"]
    for name, f in figures.items():
        cpu, wall = f["cpu_ms"], f["wall_ms"]
        lines.append(f"| {name} | {statistics.median(cpu):.2f} ({min(cpu):.2f}-{max(cpu):.2f}) "
                     f"| {statistics.median(wall):.2f} ({min(wall):.2f}-{max(wall):.2f}) "
                     f"| {statistics.median(cpu) / statistics.median(wall):.2f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"sync_cpu-{args.params}"
    (args.out / f"{name}.json").write_text(json.dumps(figures, indent=1) + "\n")
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
