"""The speed benchmark: tensorbus against its baselines, side by side, in one run.

    python -m benchmarks bench                      # 3 rounds, 10 to 13 minutes on 2 cores
    python -m benchmarks bench --rounds 1 --quick   # a smoke test
    python -m benchmarks bench --only b/10M         # the cases whose name starts so

Every round runs every case once, in the same order, so that a noisy neighbour slows all
of them alike; each case's minimum and median over the rounds are reported, and each ratio
is taken within a round, then its median over the rounds. The cases:

(a) bus throughput for 1, 16 and 128 MB: tensorbus against raw pyzmq (one frame, 1 MiB
    frames as the bus sends, 512 KiB frames; each also with the receiver keeping freed
    memory, as tensorbus's does: "-kept") and memcpy (benchmarks/throughput.py); a ratio
    to raw pyzmq's "best" takes its fastest way in the same round;
(b) a training step of the 1M- and 10M-parameter MLPs with 2 workers, batch 64 each,
    against one process and PyTorch DDP on gloo (benchmarks/steps.py): tensorbus sync with
    one central coordinator, and with a coordinator shard in each worker (--colocate);
(c) async updates per second for the 1M model, batch 1, against the naive
    one-push-one-reply parameter server;
(d) scaling: the 1M model's sync step with 1, 2 and 4 workers (colocated from 2 on).

It writes benchmarks/results/bench.json (every figure of every round) and bench.md (the
tables of docs/performance.md).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks import steps, throughput
from benchmarks.report import RESULTS, Meta, write_json, write_markdown

MB = 1 << 20


def cases(quick: bool) -> dict[str, Callable[[], float]]:
    """Name -> a function measuring it once. Throughput in GB/s, steps in seconds, rates
    in updates per second."""
    n = 20 if quick else 60  # steps per timed run (a quarter of them warm-up)
    table: dict[str, Callable[[], float]] = {}
    for size in (1, 16, 128):
        repeats = max(4, 256 // size) if quick else max(8, 1024 // size)
        table[f"a/{size}MB/memcpy"] = lambda s=size, r=repeats: throughput.memcpy(s * MB, r)
        for kept in (False, True):
            end = "-kept" if kept else ""
            for name, chunk in (("1frame", None), ("chunked", throughput.CHUNK), ("512K", MB // 2)):
                table[f"a/{size}MB/zmq-{name}{end}"] = (
                    lambda s=size, r=repeats, c=chunk, k=kept: throughput.raw_zmq(s * MB, r, chunk=c, kept=k))
        table[f"a/{size}MB/tensorbus"] = lambda s=size, r=repeats: throughput.tensorbus(s * MB, r)
    for params in ("1M", "10M"):
        k = n if params == "10M" else 4 * n
        table[f"b/{params}/single"] = lambda p=params, k=k: steps.single(p, k)
        table[f"b/{params}/ddp"] = lambda p=params, k=k: steps.ddp(p, k)
        table[f"b/{params}/tensorbus-sync"] = lambda p=params, k=k: steps.tensorbus_sync(p, k)
        table[f"b/{params}/tensorbus-colocated"] = lambda p=params, k=k: steps.tensorbus_sync(
            p, k, colocate=True)
        table[f"b/{params}/tensorbus-colocated-bf16"] = lambda p=params, k=k: steps.tensorbus_sync(
            p, k, compress="bf16", colocate=True)
    pushes = 200 if quick else 600
    table["c/1M/naive-ps"] = lambda: steps.naive_ps("1M", pushes // 2)
    table["c/1M/tensorbus-async"] = lambda: steps.tensorbus_async("1M", pushes)
    table["c/1M/tensorbus-async-bf16"] = lambda: steps.tensorbus_async("1M", pushes, compress="bf16")
    table["c/1M/tensorbus-async-topk"] = lambda: steps.tensorbus_async("1M", pushes, compress="topk:0.01")
    for workers in (1, 2, 4):
        table[f"d/1M/ddp-{workers}w"] = lambda w=workers: steps.ddp("1M", 4 * n, w)
        if workers == 1:  # one worker: nothing to colocate with
            table["d/1M/tensorbus-sync-1w"] = lambda: steps.tensorbus_sync("1M", 4 * n, 1)
        else:
            table[f"d/1M/tensorbus-colocated-{workers}w"] = lambda w=workers: steps.tensorbus_sync(
                "1M", 4 * n, w, colocate=True)
    return table


# name -> (numerator, denominator, what it says); a tuple of denominators: the largest of
# them in the same round (raw pyzmq's best frame size).
BEST_CHUNKED = ("a/128MB/zmq-chunked", "a/128MB/zmq-512K", "a/128MB/zmq-chunked-kept",
                "a/128MB/zmq-512K-kept")
ONE_FRAME = ("a/128MB/zmq-1frame", "a/128MB/zmq-1frame-kept")
RATIOS: dict[str, tuple[str, str | tuple[str, ...], str]] = {
    "b/1M: tensorbus colocated / DDP": ("b/1M/tensorbus-colocated", "b/1M/ddp",
                                        "step time; <= 1.1 wanted"),
    "b/10M: tensorbus colocated / DDP": ("b/10M/tensorbus-colocated", "b/10M/ddp",
                                         "step time; <= 1.0 wanted"),
    "b/1M: tensorbus central / DDP": ("b/1M/tensorbus-sync", "b/1M/ddp", "one coordinator"),
    "b/10M: tensorbus central / DDP": ("b/10M/tensorbus-sync", "b/10M/ddp", "one coordinator"),
    "b/1M: colocated bf16 / DDP": ("b/1M/tensorbus-colocated-bf16", "b/1M/ddp", "--compress bf16"),
    "b/10M: colocated bf16 / DDP": ("b/10M/tensorbus-colocated-bf16", "b/10M/ddp", "--compress bf16"),
    "b/1M: DDP / single": ("b/1M/ddp", "b/1M/single", "what DDP itself costs"),
    "b/10M: DDP / single": ("b/10M/ddp", "b/10M/single", "what DDP itself costs"),
    "a/128MB: tensorbus / zmq best chunked": ("a/128MB/tensorbus", BEST_CHUNKED, ">= 0.8 wanted"),
    "a/128MB: tensorbus / zmq 1 MiB frames": ("a/128MB/tensorbus", "a/128MB/zmq-chunked",
                                              "the bus's frame size"),
    "a/128MB: tensorbus / zmq one frame": ("a/128MB/tensorbus", ONE_FRAME, ">= 2.5 wanted"),
    "a/128MB: zmq 1 MiB frames, kept / not": ("a/128MB/zmq-chunked-kept", "a/128MB/zmq-chunked",
                                              "what keeping freed memory is worth"),
    "a/16MB: tensorbus / zmq chunked": ("a/16MB/tensorbus", "a/16MB/zmq-chunked", ""),
    "a/1MB: tensorbus / zmq chunked": ("a/1MB/tensorbus", "a/1MB/zmq-chunked", ""),
    "c/1M: tensorbus async / naive PS": ("c/1M/tensorbus-async", "c/1M/naive-ps", "updates/s; >= 4 wanted"),
    "c/1M: tensorbus async bf16 / naive PS": ("c/1M/tensorbus-async-bf16", "c/1M/naive-ps",
                                              "updates/s, --compress bf16"),
    "c/1M: tensorbus async top-1% / naive PS": ("c/1M/tensorbus-async-topk", "c/1M/naive-ps",
                                                "updates/s, --compress topk:0.01"),
    "d/1M: 2 workers, colocated / DDP": ("d/1M/tensorbus-colocated-2w", "d/1M/ddp-2w", "step time"),
    "d/1M: 4 workers, colocated / DDP": ("d/1M/tensorbus-colocated-4w", "d/1M/ddp-4w", "step time"),
}


def main(argv: Sequence[str], meta: Meta) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks bench",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="shorter runs (a smoke test)")
    parser.add_argument("--only", default="", help="run only cases whose name starts so (a, b/10M, ...)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    table = {k: f for k, f in cases(args.quick).items() if k.startswith(args.only)}
    if not table:
        parser.error(f"--only {args.only!r} names no case: their names start a/, b/, c/ or d/ "
                     "(a/128MB/tensorbus, b/10M/ddp, ...)")
    rounds: list[dict[str, float]] = []
    started = time.monotonic()
    for r in range(args.rounds):
        figures: dict[str, float] = {}
        for name, measure in table.items():
            figures[name] = measure()
            print(f"round {r + 1}/{args.rounds} {name}: {figures[name]:.4g}", flush=True)
        rounds.append(figures)
    report = summarize(rounds, time.monotonic() - started)
    write_json(args.out / "bench.json", report, meta)
    write_markdown(args.out / "bench.md", markdown(report), meta)
    print(markdown(report))


def summarize(rounds: list[dict[str, float]], seconds: float) -> dict[str, Any]:
    """Each case's minimum, median and maximum over the rounds, and each ratio's, taken
    within each round that has its numerator and all its denominators."""
    per_case: dict[str, list[float]] = defaultdict(list)
    for figures in rounds:
        for name, value in figures.items():
            per_case[name].append(value)
    ratios = {}
    for label, (num, den, note) in RATIOS.items():
        dens = den if isinstance(den, tuple) else (den,)
        values = [f[num] / max(f[d] for d in dens) for f in rounds
                  if num in f and all(d in f for d in dens)]
        if values:
            ratios[label] = {"median": statistics.median(values), "min": min(values),
                             "max": max(values), "note": note}
    return {
        "seconds": round(seconds, 1),
        "rounds": rounds,
        "cases": {k: {"min": min(v), "median": statistics.median(v), "max": max(v)}
                  for k, v in per_case.items()},
        "ratios": ratios,
    }


def markdown(report: dict[str, Any]) -> str:
    cases_ = report["cases"]
    lines = [f"{len(report['rounds'])} rounds, {report['seconds']:.0f} s; each ratio taken within a round.",
             ""]

    def unit(name: str) -> tuple[str, float]:
        if name.startswith("a/"):
            return "GB/s", 1.0
        if name.startswith("c/"):
            return "updates/s", 1.0
        return "ms", 1000.0

    lines += ["| case | min | median | max | unit |", "|---|---:|---:|---:|---|"]
    for name, c in cases_.items():
        u, scale = unit(name)
        lines.append(f"| {name} | {c['min'] * scale:.3g} | {c['median'] * scale:.3g} | "
                     f"{c['max'] * scale:.3g} | {u} |")
    lines += ["", "| ratio (same round) | median | min | max | note |", "|---|---:|---:|---:|---|"]
    for label, r in report["ratios"].items():
        lines.append(f"| {label} | {r['median']:.2f} | {r['min']:.2f} | {r['max']:.2f} | {r['note']} |")
    return "\n".join(lines) + "\n"
