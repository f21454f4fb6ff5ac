"""Sync against async on Fashion-MNIST, drawn: `tensorbus plot` of two runs side by side.

Runs the Fashion-MNIST example with 2 workers, one torch thread each, default batch 64 and
lr 0.1, an evaluation point every second of training, once with `--strategy sync` and
once with `--strategy async`, then draws both with `tensorbus plot`: training loss by
version and by training time, test accuracy by training time, and each worker's time split
into computing, communicating and waiting. Writes benchmarks/results/plot.png and plot.md
(each run's accuracy, training time and waiting share, and async's time over sync's).
About a minute on 2 cores:

    python -m benchmarks plot
    python -m benchmarks plot --steps 20     # a smoke test: 20 versions a run
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import checkout
from benchmarks.report import RESULTS, ROOT, Meta, stamp_png, write_markdown
from tensorbus.run.plot import plot as draw

STRATEGIES = ("sync", "async")


def run(strategy: str, length: list[str], metrics: Path) -> dict[str, Any]:
    """One run of the example; its closing summary."""
    with checkout.cli(ROOT) as (tensorbus, env):
        command = [*tensorbus, "local", "examples/fashion_mnist.py", "--workers", "2", "--strategy",
                   strategy, *length, "--eval-every", "1", "--threads", "1", "--metrics",
                   str(metrics), "--no-progress", "--log-level", "error"]
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=900, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr[-2000:]}")
    summary = json.loads(metrics.read_text().splitlines()[-1])
    if summary["event"] != "summary":
        raise RuntimeError(f"{' '.join(command)}: its metrics end without a summary: {summary}")
    return summary


def waiting_share(summary: dict[str, Any]) -> float:
    """The share of the workers' time spent waiting, all workers together."""
    per = summary["per_worker"].values()
    total = sum(w["compute_s"] + w["comm_s"] + w["wait_s"] for w in per)
    return sum(w["wait_s"] for w in per) / total if total else 0.0


def main(argv: Sequence[str], meta: Meta) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks plot",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--steps", type=int, help="versions per run, in place of --epochs")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    length = ["--steps", str(args.steps)] if args.steps else ["--epochs", str(args.epochs)]
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        paths = [Path(tmp) / f"{s}.jsonl" for s in STRATEGIES]
        summaries = {s: run(s, length, path) for s, path in zip(STRATEGIES, paths, strict=True)}
        stamp_png(draw(paths, args.out / "plot.png", labels=list(STRATEGIES)), meta)
    lines = [(f"`tensorbus local examples/fashion_mnist.py --workers 2 --strategy S {' '.join(length)} "
              "--eval-every 1 --threads 1`, S = sync then async, drawn by `tensorbus plot` into "
              "plot.png: training loss by version and by training time, test accuracy by training "
              "time (the last point is the final model), each worker's time split into computing, "
              "communicating and waiting."), "",
             "| strategy | versions | test accuracy | training time | workers' time waiting |",
             "|---|---:|---:|---:|---:|"]
    for strategy, s in summaries.items():
        lines.append(f"| {strategy} | {s['steps']} | {100 * s['accuracy']:.2f} % | {s['train_s']:.1f} s "
                     f"| {100 * waiting_share(s):.0f} % |")
    ratio = summaries["async"]["train_s"] / summaries["sync"]["train_s"]
    lines += ["", f"Async's training time ÷ sync's, same invocation: {ratio:.2f}."]
    write_markdown(args.out / "plot.md", "\n".join(lines), meta)
    print("\n".join(lines))
