"""PyTorch's MNIST example as its authors run it, beside its tensorbus port, on the same data.

The original: the training loop of pytorch/examples' mnist/main.py in one process (batch 64,
Adadelta lr 1.0, StepLR gamma 0.7 stepped each epoch, dropout), here on Fashion-MNIST's
Debian files with the model and the functions of examples/pytorch_mnist.py, reading its
batches in the order the port's workers share them. The port:

    tensorbus local examples/pytorch_mnist.py --workers 2 --batch-size 32 --epochs 2

(2 workers of 32: 64 samples a version, as the original's step). Both train 2 epochs from
seed 1 and are scored on the 10k test images; the ratio of their wall times is taken in
the same run. Writes benchmarks/results/pytorch_mnist.md and .json:

    python -m benchmarks pytorch_mnist
    python -m benchmarks pytorch_mnist --epochs 1 --limit 20    # a smoke test
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks import checkout
from benchmarks.report import RESULTS, ROOT, Meta, write_json, write_markdown

SPEC = "examples/pytorch_mnist.py"


def original(epochs: int, limit: int | None, threads: int,
             dropout_seed: int | None = None) -> dict[str, Any]:
    """The original loop: train() and test() of mnist/main.py, in this process; with
    `dropout_seed`, torch's generator is reseeded after the model is built, which changes
    the dropout masks and nothing else."""
    sys.path.insert(0, str(ROOT / "examples"))
    import pytorch_mnist as spec  # noqa: PLC0415 (from the examples folder)

    torch.set_num_threads(threads)
    torch.manual_seed(1)
    model = spec.model()
    if dropout_seed is not None:
        torch.manual_seed(dropout_seed)
    optimizer = spec.optimizer(model.parameters())
    scheduler = spec.scheduler(optimizer)
    # The batches of the port's data() on one rank of 64: each epoch the port's 2 workers
    # take the same 64 samples a version between them (run.shards.Shards), so the two runs
    # differ only where they must, in their dropout masks. (The original's DataLoader
    # shuffles with the global RNG instead: another order, and a last partial batch.)
    shards = spec.data(0, 1, 64)
    started = time.monotonic()
    for _ in range(epochs):
        model.train()
        for n, (inputs, targets) in enumerate(shards):
            if limit is not None and n >= limit:
                break
            optimizer.zero_grad()
            spec.loss(model(inputs), targets).backward()
            optimizer.step()
        scheduler.step()
    seconds = time.monotonic() - started
    model.eval()
    return {**spec.evaluate(model), "seconds": seconds}


def port(epochs: int, limit: int | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, checkout.cli(ROOT) as (tensorbus, env):
        metrics = Path(tmp) / "metrics.jsonl"
        length = ["--steps", str(limit)] if limit else ["--epochs", str(epochs)]
        command = [*tensorbus, "local", SPEC, "--workers", "2", "--batch-size", "32",
                   "--seed", "1", *length, "--metrics", str(metrics), "--threads", "2",
                   "--no-progress", "--log-level", "error"]
        started = time.monotonic()
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=3600, check=False)
        seconds = time.monotonic() - started
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed: {done.stderr[-2000:]}")
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in records if r["event"] == "step"]
    summary = records[-1]
    return {"accuracy": summary["accuracy"], "test_loss": summary["test_loss"],
            "seconds": seconds, "versions": summary["steps"],
            "lr_first": steps[0]["lr"], "lr_last": steps[-1]["lr"]}


def main(argv: Sequence[str], meta: Meta) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks pytorch_mnist",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--limit", type=int, help="batches an epoch (a smoke test)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    mine = port(args.epochs, args.limit)
    print(f"tensorbus: {mine}", flush=True)
    theirs = original(args.epochs, args.limit, threads=2)
    print(f"original: {theirs}", flush=True)
    # The same loop with other dropout masks: how far apart two runs are by chance alone.
    other = original(args.epochs, args.limit, threads=2, dropout_seed=2)
    print(f"original, other dropout masks: {other}", flush=True)
    length = f"--steps {args.limit}" if args.limit else f"--epochs {args.epochs}"
    lines = [
        (f"{args.epochs} epoch(s)" + (f" of {args.limit} batches" if args.limit else "")
         + " of Fashion-MNIST, seed 1, the original on 2 torch threads, the port on 2 "
         "workers of 1 thread"),
        "",
        "| run | test accuracy | test loss | wall s |",
        "|---|---:|---:|---:|",
        f"| original loop, one process, batch 64 | {100 * theirs['accuracy']:.2f} % | "
        f"{theirs['test_loss']:.4f} | {theirs['seconds']:.0f} |",
        f"| the same loop, other dropout masks | {100 * other['accuracy']:.2f} % | "
        f"{other['test_loss']:.4f} | {other['seconds']:.0f} |",
        f"| `tensorbus local {SPEC} --workers 2 --batch-size 32 {length}` | "
        f"{100 * mine['accuracy']:.2f} % | {mine['test_loss']:.4f} | {mine['seconds']:.0f} |",
        "",
        f"- accuracy, port minus original: {100 * (mine['accuracy'] - theirs['accuracy']):+.2f} "
        "points (within 0.3 wanted); the original with other dropout masks minus the "
        f"original: {100 * (other['accuracy'] - theirs['accuracy']):+.2f} points",
        f"- wall time, port ÷ original: {mine['seconds'] / theirs['seconds']:.2f} (the port's "
        "includes starting its processes and scoring)",
        f"- the schedule's lr in the port's metrics: {mine['lr_first']} at the first version, "
        f"{mine['lr_last']:.4g} at the last ({mine['versions']} versions)",
    ]
    write_json(args.out / "pytorch_mnist.json",
               {"original": theirs, "original_other_dropout": other, "port": mine}, meta)
    write_markdown(args.out / "pytorch_mnist.md", "\n".join(lines), meta)
    print("\n".join(lines))
