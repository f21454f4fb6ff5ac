"""What --compress costs in accuracy on Fashion-MNIST, and what --colocate changes (nothing).

Runs the README's Quick start command (`tensorbus local examples/fashion_mnist.py --workers
4 --strategy sync --epochs 1`: 234 versions of batch 4 x 64 from seed 0) once per setting:
no compression, bf16, fp16, top-k at 10% and at 1%, and no compression on colocated shards.
Each run's test accuracy, test loss and final training loss come from its closing summary.
Writes benchmarks/results/compression.md and compression.json. About 2 minutes on 2 cores:

    python benchmarks/compression.py
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
COMMAND = ["local", "examples/fashion_mnist.py", "--workers", "4", "--strategy", "sync", "--epochs", "1"]
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
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        command = [sys.executable, "-m", "run", *COMMAND, *options, "--metrics", str(metrics),
                   "--no-progress", "--log-level", "error"]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900,
                              check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed: {done.stderr[-2000:]}")
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
    summary = records[-1]
    assert summary["event"] == "summary", summary
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    started = time.monotonic()
    rows = {}
    for label, options in SETTINGS.items():
        summary = run(options)
        rows[label] = {"options": options, "steps": summary["steps"],
                       "accuracy": summary["accuracy"], "test_loss": summary["test_loss"],
                       "final_loss": summary["final_loss"]}
        print(f"{label}: {rows[label]}", flush=True)
    title = (f"`python benchmarks/compression.py` (`tensorbus {' '.join(COMMAND)}` and the options "
             f"below; {time.monotonic() - started:.0f} s)")
    lines = [title, "",
             "| setting | versions | test accuracy | test loss | final train loss |",
             "|---|---:|---:|---:|---:|"]
    for label, row in rows.items():
        lines.append(f"| `{label}` | {row['steps']} | {100 * row['accuracy']:.2f} % | "
                     f"{row['test_loss']:.4f} | {row['final_loss']:.4f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compression.json").write_text(json.dumps(rows, indent=1) + "\n")
    (args.out / "compression.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
