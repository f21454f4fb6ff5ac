"""What --compress costs in accuracy on Fashion-MNIST, and what --colocate changes (nothing).

Runs the README's Quick start command (`tensorbus local examples/fashion_mnist.py --workers
4 --strategy sync --epochs 1`: 234 versions of batch 4 x 64 from seed 0) once per setting:
no compression, bf16, fp16, top-k at 10% and at 1%, and no compression on colocated shards.
Each run's test accuracy, test loss and final training loss come from its closing summary,
beside the uncompressed run's in the same invocation. Writes benchmarks/results/compression.md
and compression.json. About 70 seconds on 2 cores:

    python -m benchmarks compression
    python -m benchmarks compression --steps 5     # a smoke test: 5 versions a setting
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import checkout
from benchmarks.report import RESULTS, ROOT, Meta, write_json, write_markdown

COMMAND = ["local", "examples/fashion_mnist.py", "--workers", "4", "--strategy", "sync"]
SETTINGS: dict[str, list[str]] = {  # label -> the options added to COMMAND
    "(none)": [],
    "bf16": ["--compress", "bf16"],
    "fp16": ["--compress", "fp16"],
    "topk:0.1": ["--compress", "topk:0.1"],
    "topk:0.01": ["--compress", "topk:0.01"],
    "(none), --colocate": ["--colocate"],
}


def run(options: list[str]) -> dict[str, Any]:
    """One training run: its closing summary."""
    with tempfile.TemporaryDirectory() as tmp, checkout.cli(ROOT) as (tensorbus, env):
        metrics = Path(tmp) / "metrics.jsonl"
        command = [*tensorbus, *COMMAND, *options, "--metrics", str(metrics),
                   "--no-progress", "--log-level", "error"]
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=900, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed: {done.stderr[-2000:]}")
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
    summary = records[-1]
    if summary["event"] != "summary":
        raise RuntimeError(f"{' '.join(command)}: its metrics end without a summary: {summary}")
    return summary


def main(argv: Sequence[str], meta: Meta) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks compression",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, help="versions a run (default: one epoch, 234)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    length = ["--steps", str(args.steps)] if args.steps else ["--epochs", "1"]
    started = time.monotonic()
    rows = {}
    for label, options in SETTINGS.items():
        summary = run([*length, *options])
        rows[label] = {"options": options, "steps": summary["steps"],
                       "accuracy": summary["accuracy"], "test_loss": summary["test_loss"],
                       "final_loss": summary["final_loss"]}
        print(f"{label}: {rows[label]}", flush=True)
    title = (f"`tensorbus {' '.join([*COMMAND, *length])}` with the options below "
             f"({time.monotonic() - started:.0f} s in all)")
    base = rows["(none)"]
    lines = [title, "",
             ("| setting | versions | test accuracy | test loss | final train loss "
              "| accuracy, points above uncompressed |"),
             "|---|---:|---:|---:|---:|---:|"]
    for label, row in rows.items():
        lines.append(f"| `{label}` | {row['steps']} | {100 * row['accuracy']:.2f} % | "
                     f"{row['test_loss']:.4f} | {row['final_loss']:.4f} | "
                     f"{100 * (row['accuracy'] - base['accuracy']):+.2f} |")
    write_json(args.out / "compression.json", rows, meta)
    write_markdown(args.out / "compression.md", "\n".join(lines), meta)
    print("\n".join(lines))
