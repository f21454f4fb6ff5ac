"""What a sharded parameter server buys on this machine: a 50M-parameter model, 2 workers.

    python -m benchmarks shards [--rounds 3] [--steps 12] [--shards 1 2 3]    # about 3 minutes
    python -m benchmarks shards --params 1M --rounds 1 --steps 4 --shards 1 2  # a smoke test

Each case is real processes on loopback: S coordinator processes (`tensorbus coordinator
--shard I/S`; S = 1: one plain coordinator) and 2 `tensorbus worker` processes, sync, batch
1 per worker (the 49.5M-parameter MLP of benchmarks/mlp.py, BENCH_PARAMS=50M: compute is
a few tens of ms, so the step is communication: every worker pushes 198 MB and pulls 198 MB
a step). Rounds interleave the cases. Reported per case: the step time (median of the
per-version times after the first quarter, from the first shard's metrics) and each
worker's communication time per push (push + pull, from the workers' own telemetry), with
their ratios to the first case's (one coordinator's) in the same round. It writes
benchmarks/results/shards.json and shards.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks import checkout, mlp
from benchmarks.report import RESULTS, ROOT, Meta, write_json, write_markdown
from benchmarks.throughput import free_port

SPEC = str(ROOT / "benchmarks" / "mlp.py")


def case(shards: int, steps: int, workers: int = 2, params: str = "50M") -> dict[str, float]:
    """One run with `shards` coordinator processes; its step and push+pull times."""
    ports = [free_port() for _ in range(2 * shards)]
    endpoints = [f"tcp://127.0.0.1:{ports[2 * i]}" for i in range(shards)]
    processes: list[subprocess.Popen[str]] = []
    with tempfile.TemporaryDirectory() as tmp, checkout.cli(ROOT) as (run, env):
        env = {**env, "BENCH_PARAMS": params}
        metrics = Path(tmp) / "metrics.jsonl"
        try:
            for i in range(shards):
                shard = ["--shard", f"{i}/{shards}"] if shards > 1 else []
                processes.append(subprocess.Popen(
                    [*run, "coordinator", SPEC, "--bind", endpoints[i], "--pub-port",
                     str(ports[2 * i + 1]), "--workers", str(workers), "--steps", str(steps),
                     "--batch-size", "1", "--threads", "1", "--no-progress", "--log-level",
                     "error", "--timeout", "60", *shard, *(["--metrics", str(metrics)] if i == 0 else [])],
                    cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
            for rank in range(workers):
                processes.append(subprocess.Popen(
                    [*run, "worker", SPEC, "--connect", ",".join(endpoints), "--rank", str(rank),
                     "--threads", "1", "--log-level", "error"],
                    cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
            for p in processes:
                _, err = p.communicate(timeout=900)
                if p.returncode != 0:
                    raise RuntimeError(f"{' '.join(p.args)} failed: {err[-2000:]}")  # type: ignore[arg-type]
        finally:
            for p in processes:
                if p.poll() is None:
                    p.kill()
                p.communicate()
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
    at = [r["train_s"] for r in records if r["event"] == "step"]
    times = [b - a for a, b in itertools.pairwise(at)]
    summary = records[-1]
    per = summary["per_worker"]
    comm = statistics.mean(w["comm_s"] / max(w["pushes"], 1) for w in per.values())
    compute = statistics.mean(w["compute_s"] / max(w["pushes"], 1) for w in per.values())
    return {"step_s": statistics.median(times[len(times) // 4:]), "comm_s": comm,
            "compute_s": compute}


def main(argv: Sequence[str], meta: Meta) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks shards",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--params", default="50M", choices=sorted(mlp.HIDDEN))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    rounds: list[dict[str, dict[str, float]]] = []
    started = time.monotonic()
    for r in range(args.rounds):
        figures = {}
        for s in args.shards:
            figures[str(s)] = case(s, args.steps, params=args.params)
            print(f"round {r + 1}: {s} shard(s): {figures[str(s)]}", file=sys.stderr, flush=True)
        rounds.append(figures)
    base = str(args.shards[0])
    rows = []
    for s in args.shards:
        key = str(s)
        step = [f[key]["step_s"] for f in rounds]
        comm = [f[key]["comm_s"] for f in rounds]
        ratio = [f[key]["step_s"] / f[base]["step_s"] for f in rounds]
        rows.append(f"| {s} | {min(step) * 1e3:.0f} / {statistics.median(step) * 1e3:.0f} | "
                    f"{min(comm) * 1e3:.0f} / {statistics.median(comm) * 1e3:.0f} | "
                    f"{statistics.median(ratio):.2f} [{min(ratio):.2f}, {max(ratio):.2f}] |")
    table = "\n".join([
        (f"Sharded parameter server, the {args.params} model, 2 workers, sync, batch 1; "
         f"{args.rounds} rounds, {args.steps} versions each; {(time.monotonic() - started) / 60:.1f} min."),
        "",
        (f"| shards | step ms (min / median) | push+pull ms per push (min / median) | "
        f"step ÷ {base} shard(s), same round (median [min, max]) |"),
        "|---|---|---|---|",
        *rows,
    ])
    write_json(args.out / "shards.json", {"rounds": rounds, "steps": args.steps, "params": args.params},
               meta)
    write_markdown(args.out / "shards.md", table, meta)
    print(table)
