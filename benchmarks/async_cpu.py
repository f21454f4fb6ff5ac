"""What bounds part (c): the CPU that one async update costs, against the naive server's.

Part (c) of `benchmarks/bench.py` counts updates per second of async SGD (batch 1, 2
workers, the 1M model) against the naive one-push-one-reply parameter server. On a
machine whose cores the coordinator and the workers share, the rate cannot pass

    cores / (CPU seconds that one update costs, all processes together)

however the work is overlapped. This measures that cost the same way for every
contender: each runs twice, with U and with 2U updates, and the CPU time of all its
processes (user + system, from `getrusage` of the reaped children: the launcher, the
workers it reaps, the server) is differenced, so that start-up (imports, loading data)
cancels out: (CPU(2U) - CPU(U)) / U. Beside it, each contender's measured rate (the
second run's, as `benchmarks/steps.py` takes it) and the rate the cost allows on this
machine's cores. Interleaved and repeated; medians, min and max. Then, once, where
tensorbus async's CPU goes: thread by thread over an 8-second window of one run (`/proc`,
grouped as `benchmarks/cpu_split.py` groups them), and how many versions it broadcast per
version made (the metrics summary's `broadcasts`); and the step of one process alone,
batch 1: the least a worker spends per update. About 8 minutes:

    python -m benchmarks async_cpu [--updates 2000] [--rounds 3] [--seconds 8]

Writes benchmarks/results/async_cpu.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from benchmarks import steps
from benchmarks.cpu_split import last_version, running, thread_cpu
from benchmarks.report import RESULTS, Meta, write_json, write_markdown


def contenders() -> dict[str, Callable[[int], float]]:
    """Name -> run it for that many updates in all and return its updates per second."""
    return {
        "naive PS": lambda updates: steps.naive_ps("1M", updates // 2),  # pushes per worker
        "tensorbus async": lambda updates: steps.tensorbus_async("1M", updates),
        "tensorbus async bf16": lambda updates: steps.tensorbus_async("1M", updates, compress="bf16"),
        "tensorbus async top-1%": lambda updates: steps.tensorbus_async("1M", updates,
                                                                        compress="topk:0.01"),
    }


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(run: Callable[[int], float], updates: int) -> tuple[float, float]:
    """CPU milliseconds per update, all processes together, and the updates per second."""
    at = children_cpu()
    run(updates)
    short = children_cpu() - at
    at = children_cpu()
    rate = run(2 * updates)
    long = children_cpu() - at
    return 1000 * (long - short) / updates, rate


def split(seconds: float = 8.0) -> tuple[dict[str, float], float]:
    """Tensorbus async's CPU milliseconds per update by process and thread group, over a
    window after warm-up, and the broadcasts per version of the whole run."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        # Stopped gracefully at the block's end: the summary is written.
        with running(["--workers", "2", "--strategy", "async", "--steps", "1000000", "--threads",
                      "1", "--batch-size", "1", "--lr", "0.01"], "1M", metrics, 500) as launcher:
            processes = {"coordinator (the launcher)": launcher.pid,
                         **{f"worker {i}": pid for i, pid in enumerate(_children(launcher.pid))}}
            before = {name: thread_cpu(pid) for name, pid in processes.items()}
            v0 = last_version(metrics)
            time.sleep(seconds)
            after = {name: thread_cpu(pid) for name, pid in processes.items()}
            v1 = last_version(metrics)
        summary = json.loads(metrics.read_text().splitlines()[-1])
    updates = v1 - v0
    table = {f"{name}: {group}": 1000 * (after[name][group] - before[name].get(group, 0.0)) / updates
             for name in processes for group in after[name]}
    return table, summary["broadcasts"] / max(summary["steps"], 1)


def _children(pid: int) -> list[int]:
    """The worker processes the launcher started: not multiprocessing's resource tracker,
    which shared memory (bus.shared) starts beside them."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            if (entry.isdigit() and int(Path(f"/proc/{entry}/stat").read_text()
                                        .rsplit(")", 1)[1].split()[1]) == pid
                    and b"resource_tracker" not in Path(f"/proc/{entry}/cmdline").read_bytes()):
                found.append(int(entry))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return sorted(found)


def main(argv: Sequence[str], meta: Meta) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks async_cpu",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0, help="the thread split's window")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    cores = len(os.sched_getaffinity(0))
    table = contenders()
    figures: dict[str, dict[str, list[float]]] = {n: {"cpu_ms": [], "rate": []} for n in table}
    for r in range(args.rounds):
        for name, run in table.items():
            cpu_ms, rate = measure(run, args.updates)
            figures[name]["cpu_ms"].append(cpu_ms)
            figures[name]["rate"].append(rate)
            print(f"round {r + 1}/{args.rounds} {name}: {cpu_ms:.2f} CPU ms per update, "
                  f"{rate:.0f} updates/s", flush=True)
    lines = [(f"1M model, batch 1, 2 workers, {cores} cores, {args.updates} and {2 * args.updates} "
              f"updates, {args.rounds} rounds; median (min-max) over the rounds"), "",
             ("| contender | CPU ms per update, all processes | updates/s the cores allow "
              "| updates/s measured | measured / allowed | measured ÷ naive PS's, same round |"),
             "|---|---:|---:|---:|---:|---:|"]
    naive = figures["naive PS"]["rate"]
    for name, f in figures.items():
        costs, rates = f["cpu_ms"], f["rate"]
        allowed = [1000 * cores / c for c in costs]
        used = [r / a for r, a in zip(rates, allowed, strict=True)]
        versus = [r / n for r, n in zip(rates, naive, strict=True)]
        lines.append(f"| {name} | {spread(costs, '.2f')} | {spread(allowed, '.0f')} "
                     f"| {spread(rates, '.0f')} | {spread(used, '.2f')} | {spread(versus, '.2f')} |")
    threads, broadcasts = split(args.seconds)
    alone = 1000 * steps.single("1M", 2000, batch=1)
    lines += ["", ("Tensorbus async, one run, CPU per version made (all of the coordinator's and "
                   f"the workers' updates) over {args.seconds:g} s:"), "",
              "| process: threads | CPU ms per update |", "|---|---:|"]
    lines += [f"| {name} | {ms:.2f} |" for name, ms in threads.items()]
    lines += [f"| all | {sum(threads.values()):.2f} |", "",
              f"Broadcasts per version made, whole run: {broadcasts:.2f}.", "",
              f"One process alone, batch 1 (forward, backward, SGD step): {alone:.2f} ms a step."]
    write_json(args.out / "async_cpu.json",
               {"cores": cores, "updates": args.updates, "figures": figures, "threads": threads,
                "broadcasts_per_version": broadcasts, "single_batch1_ms": alone}, meta)
    write_markdown(args.out / "async_cpu.md", "\n".join(lines), meta)
    print("\n".join(lines))


def spread(values: list[float], form: str) -> str:
    """Median (min-max)."""
    return f"{statistics.median(values):{form}} ({min(values):{form}}-{max(values):{form}})"
