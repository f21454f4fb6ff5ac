"""PyTorch's MNIST example as its authors run it, beside its tensorbus port, on the same data.

The original: the training loop of pytorch/examples' mnist/main.py in one process (batch 64,
Adadelta lr 1.0, StepLR gamma 0.7 stepped each epoch, dropout), here on Fashion-MNIST's
Debian files with the model and the functions of examples/pytorch_mnist.py, reading its
batches in the order the port's workers share them. The port:

    tensorbus local examples/pytorch_mnist.py --workers 2 --batch-size 32 --epochs 2

(2 workers of 32: 64 samples a version, as the original's step). Both train 2 epochs and
are scored on the 10k test images. With one seed the two start from the same weights and
differ only in their dropout masks (the port's workers draw theirs from (seed, rank)); so
each runs with several seeds (`--seeds`: the --seed of each), and their means are compared
beside the spread of each. The ratio of their wall times is taken in the same run. Writes
benchmarks/results/pytorch_mnist.md and .json:

    python -m benchmarks pytorch_mnist
    python -m benchmarks pytorch_mnist --epochs 1 --limit 20 --seeds 1    # a smoke test
"""

from __future__ import annotations

import argparse
import json
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


def original(epochs: int, limit: int | None, threads: int, seed: int = 1) -> dict[str, Any]:
    """The original loop: train() and test() of mnist/main.py, in this process, run with
    its `--seed` (the model's initial weights and the dropout masks; the order of the
    batches is the SPEC's, the same whatever the seed)."""
    sys.path.insert(0, str(ROOT / "examples"))
    import pytorch_mnist as spec  # noqa: PLC0415 (from the examples folder)

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    model = spec.model()
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


def port(epochs: int, limit: int | None, seed: int = 1) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        length = ["--steps", str(limit)] if limit else ["--epochs", str(epochs)]
        _, seconds = checkout.run_tensorbus(
            ["local", SPEC, "--workers", "2", "--batch-size", "32", "--seed", str(seed),
             *length, "--metrics", str(metrics), "--threads", "2", "--no-progress",
             "--log-level", "error"])
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in records if r["event"] == "step"]
    summary = records[-1]
    return {"accuracy": summary["accuracy"], "test_loss": summary["test_loss"],
            "seconds": seconds, "versions": summary["steps"],
            "lr_first": steps[0]["lr"], "lr_last": steps[-1]["lr"]}


def _spread(runs: list[dict[str, Any]], key: str) -> tuple[float, float, float]:
    values = [r[key] for r in runs]
    return sum(values) / len(values), min(values), max(values)


def main(argv: Sequence[str], meta: Meta) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks pytorch_mnist",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--limit", type=int, help="batches an epoch (a smoke test)")
    parser.add_argument("--seeds", type=int, default=3, help="runs of each, seeds 1..N")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    seeds = range(1, args.seeds + 1)
    ports, originals = [], []
    for seed in seeds:  # (interleaved: the machine's load falls on both alike)
        ports.append(port(args.epochs, args.limit, seed))
        print(f"tensorbus, seed {seed}: {ports[-1]}", flush=True)
        originals.append(original(args.epochs, args.limit, threads=2, seed=seed))
        print(f"original, seed {seed}: {originals[-1]}", flush=True)
    length = f"--steps {args.limit}" if args.limit else f"--epochs {args.epochs}"
    command = f"tensorbus local {SPEC} --workers 2 --batch-size 32 {length} --seed S"
    lines = [
        (f"{args.epochs} epoch(s)" + (f" of {args.limit} batches" if args.limit else "")
         + f" of Fashion-MNIST, seeds {seeds[0]}..{seeds[-1]}, the original on 2 torch "
         "threads, the port on 2 workers of 1 thread"),
        "",
        "| run | seed | test accuracy | test loss | wall s |",
        "|---|---:|---:|---:|---:|",
    ]
    for seed, mine, theirs in zip(seeds, ports, originals, strict=True):
        lines += [
            f"| original loop, one process, batch 64 | {seed} | {100 * theirs['accuracy']:.2f} % "
            f"| {theirs['test_loss']:.4f} | {theirs['seconds']:.0f} |",
            f"| `{command}` | {seed} | {100 * mine['accuracy']:.2f} % | {mine['test_loss']:.4f} "
            f"| {mine['seconds']:.0f} |",
        ]
    (ours, our_low, our_high), (base, low, high) = (_spread(ports, "accuracy"),
                                                    _spread(originals, "accuracy"))
    seconds = sum(m["seconds"] for m in ports) / sum(t["seconds"] for t in originals)
    lines += [
        "",
        f"- mean accuracy over the seeds: the port {100 * ours:.2f} % ({100 * our_low:.2f} to "
        f"{100 * our_high:.2f}), the original {100 * base:.2f} % ({100 * low:.2f} to "
        f"{100 * high:.2f})",
        f"- port minus original, means: {100 * (ours - base):+.2f} points (within 0.3 wanted)",
        f"- wall time, port ÷ original: {seconds:.2f} (the port's includes starting its "
        "processes and scoring)",
        f"- the schedule's lr in the port's metrics: {ports[0]['lr_first']} at the first "
        f"version, {ports[0]['lr_last']:.4g} at the last ({ports[0]['versions']} versions)",
    ]
    write_json(args.out / "pytorch_mnist.json", {"original": originals, "port": ports}, meta)
    write_markdown(args.out / "pytorch_mnist.md", "\n".join(lines), meta)
    print("\n".join(lines))
