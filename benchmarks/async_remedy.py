"""Async and ssp with the optimizer people use: which remedy for stale gradients keeps them
from diverging, measured beside sync on the same data.

The setting of issue 37: Fashion-MNIST's MLP (examples/fashion_mnist.py) with the SPEC's own
SGD(lr=0.05, momentum=0.9), 4 workers of batch 32, one epoch. Each strategy runs without a
remedy, with the staleness-aware learning rate (each step divided by 1 + its staleness:
Zhang, Gupta, Lian and Liu, IJCAI 2016), and with momentum correction, the default (the
optimizer's momentum lowered by the 1 - 1/W that W workers' stale pushes add, and each
gradient scaled by 1/W: after Mitliagkas, Zhang, Hadjis and Ré, 2016); the test accuracy
of each beside sync's, in one invocation. Writes
benchmarks/results/async_remedy.md and .json:

    python -m benchmarks async_remedy
    python -m benchmarks async_remedy --steps 20 --rounds 1      # a smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import checkout
from benchmarks.report import RESULTS, ROOT, Meta, write_json, write_markdown

SPEC = f'''
import sys
sys.path.insert(0, {str(ROOT / "examples")!r})
import torch
from fashion_mnist import model, data, loss, evaluate


def optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)
'''

RUNS: dict[str, list[str]] = {  # label -> options
    "sync": ["--strategy", "sync"],
    "async, no remedy": ["--strategy", "async", "--no-momentum-correction"],
    "async, staleness-aware lr": ["--strategy", "async", "--no-momentum-correction",
                                  "--staleness-lr"],
    "async, momentum correction (default)": ["--strategy", "async"],
    "ssp S=2, no remedy": ["--strategy", "ssp", "--staleness", "2", "--no-momentum-correction"],
    "ssp S=2, staleness-aware lr": ["--strategy", "ssp", "--staleness", "2",
                                    "--no-momentum-correction", "--staleness-lr"],
    "ssp S=2, momentum correction (default)": ["--strategy", "ssp", "--staleness", "2"],
}


def run(spec: Path, options: list[str], length: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, checkout.cli(ROOT) as (tensorbus, env):
        metrics = Path(tmp) / "metrics.jsonl"
        command = [*tensorbus, "local", str(spec), "--workers", "4", "--batch-size", "32",
                   *length, *options, "--metrics", str(metrics), "--threads", "2",
                   "--no-progress", "--log-level", "error"]
        started = time.monotonic()
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=1800, check=False)
        seconds = time.monotonic() - started
        records = ([json.loads(line) for line in metrics.read_text().splitlines()]
                   if metrics.exists() else [])
    summary = records[-1] if records and records[-1]["event"] == "summary" else {}
    last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
    return {"ok": done.returncode == 0, "accuracy": summary.get("accuracy"),
            "steps": summary.get("steps", 0), "seconds": seconds,
            "max_staleness": summary.get("max_staleness"),
            "error": "" if done.returncode == 0 else last}


def main(argv: Sequence[str], meta: Meta) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks async_remedy",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, help="versions a run (default: one epoch)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="each run this many times, in turn (async's staleness, so its "
                             "accuracy, moves with the machine's timing)")
    parser.add_argument("--only", nargs="+", choices=list(RUNS), help="these runs only")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    length = ["--steps", str(args.steps)] if args.steps else ["--epochs", "1"]
    chosen = {label: options for label, options in RUNS.items()
              if not args.only or label in args.only}
    rounds: list[dict[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "momentum_mlp.py"
        spec.write_text(SPEC)
        for number in range(args.rounds):
            rows = {}
            for label, options in chosen.items():
                rows[label] = {"options": options, **run(spec, options, length)}
                print(f"round {number + 1}: {label}: {rows[label]}", flush=True)
            rounds.append(rows)
    lines = [f"Fashion-MNIST MLP, SGD(lr=0.05, momentum=0.9) from the SPEC, 4 workers of "
             f"batch 32, `{' '.join(length)}`, {args.rounds} round(s); median (min-max) over "
             "the rounds, the points below sync taken within each round", "",
             "| run | options | test accuracy | points below sync | diverged | max staleness |",
             "|---|---|---:|---:|---:|---:|"]
    for label, options in chosen.items():
        runs = [r[label] for r in rounds]
        accuracies = [100 * r["accuracy"] for r in runs if r["accuracy"] is not None]
        below = [100 * (r["sync"]["accuracy"] - r[label]["accuracy"]) for r in rounds
                 if "sync" in r and r["sync"]["accuracy"] is not None
                 and r[label]["accuracy"] is not None]
        stale = [r["max_staleness"] for r in runs if r["max_staleness"] is not None]
        lines.append(f"| {label} | `{' '.join(options)}` | {_spread(accuracies, '%')} | "
                     f"{_spread(below, '')} | {sum(not r['ok'] for r in runs)} of {len(runs)} "
                     f"| {max(stale) if stale else '-'} |")
    errors = sorted({r[label]["error"] for r in rounds for label in r if r[label]["error"]})
    if errors:
        lines += ["", "What the runs that failed said:", ""] + [f"- `{e}`" for e in errors]
    write_json(args.out / "async_remedy.json", rounds, meta)
    write_markdown(args.out / "async_remedy.md", "\n".join(lines), meta)
    print("\n".join(lines))


def _spread(values: list[float], unit: str) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    middle = statistics.median(ordered)
    suffix = f" {unit}" if unit else ""
    return f"{middle:.2f}{suffix} ({ordered[0]:.2f}-{ordered[-1]:.2f})"
