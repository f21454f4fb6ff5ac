"""A CNN with BatchNorm trained by tensorbus, beside the same training in one process.

examples/batchnorm_cnn.py (two conv-BatchNorm blocks, SGD with momentum) on Fashion-MNIST:

    tensorbus local examples/batchnorm_cnn.py --workers 2 --batch-size 32 --epochs 1 --seed S

against the SPEC's model, data, optimizer and loss in one loop in this process on batches of
64 (each version's 64 samples; BatchNorm normalises over each worker's 32 in the port, as
under DDP without SyncBatchNorm). Both are scored by the SPEC's evaluate(). The port's saved
model is scored once more with its running statistics reset: what evaluate() would score
if the buffers did not travel. Each runs with seeds 1..N (`--seeds`, 4 by default). Writes
benchmarks/results/batchnorm.md and .json:

    python -m benchmarks batchnorm
    python -m benchmarks batchnorm --limit 20 --seeds 1    # a smoke test
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
from torch import nn

from benchmarks import checkout
from benchmarks.report import RESULTS, ROOT, Meta, write_json, write_markdown

SPEC = "examples/batchnorm_cnn.py"


def _spec() -> Any:
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import batchnorm_cnn  # noqa: PLC0415 (from the examples folder)
    finally:
        sys.path.pop(0)
    return batchnorm_cnn


def one_process(limit: int | None, seed: int, threads: int) -> dict[str, Any]:
    spec = _spec()
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    model = spec.model()
    optimizer = spec.optimizer(model.parameters())
    started = time.monotonic()
    model.train()
    for n, (inputs, targets) in enumerate(spec.data(0, 1, 64)):
        if limit is not None and n >= limit:
            break
        optimizer.zero_grad()
        spec.loss(model(inputs), targets).backward()
        optimizer.step()
    seconds = time.monotonic() - started
    model.eval()  # (as tensorbus hands evaluate() the model)
    return {**spec.evaluate(model), "seconds": seconds}


def port(limit: int | None, seed: int) -> dict[str, Any]:
    spec = _spec()
    with tempfile.TemporaryDirectory() as tmp:
        saved = Path(tmp) / "model.pt"
        length = ["--steps", str(limit)] if limit else ["--epochs", "1"]
        done, seconds = checkout.run_tensorbus(
            ["local", SPEC, "--workers", "2", "--batch-size", "32", "--seed", str(seed), *length,
             "--save", str(saved), "--threads", "1", "--json", "--no-progress",
             "--log-level", "error"])
        summary = json.loads(done.stdout)
        model = spec.model()
        model.load_state_dict(torch.load(saved, weights_only=True))
    for layer in model.modules():
        if isinstance(layer, nn.BatchNorm2d):
            layer.reset_running_stats()
    untravelled = spec.evaluate(model.eval())["accuracy"]
    return {"accuracy": summary["accuracy"], "test_loss": summary["test_loss"],
            "seconds": seconds, "versions": summary["steps"],
            "accuracy_statistics_reset": untravelled}


def _mean(runs: list[dict[str, Any]], key: str) -> float:
    return sum(r[key] for r in runs) / len(runs)


def main(argv: Sequence[str], meta: Meta) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks batchnorm",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, help="batches (a smoke test); default one epoch")
    parser.add_argument("--seeds", type=int, default=4, help="runs of each, seeds 1..N")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    seeds = range(1, args.seeds + 1)
    ports, singles = [], []
    for seed in seeds:  # (interleaved: the machine's load falls on both alike)
        ports.append(port(args.limit, seed))
        print(f"tensorbus, seed {seed}: {ports[-1]}", flush=True)
        singles.append(one_process(args.limit, seed, threads=2))
        print(f"one process, seed {seed}: {singles[-1]}", flush=True)
    length = f"--steps {args.limit}" if args.limit else "--epochs 1"
    command = f"tensorbus local {SPEC} --workers 2 --batch-size 32 {length} --seed S"
    lines = [
        ("1 epoch" if not args.limit else f"{args.limit} batches of 64")
        + " of Fashion-MNIST; one process on 2 torch threads, the port on 2 workers of 1",
        "",
        "| run | seed | test accuracy | test loss | accuracy, statistics reset |",
        "|---|---:|---:|---:|---:|",
    ]
    for seed, mine, theirs in zip(seeds, ports, singles, strict=True):
        lines += [
            f"| one process, batch 64 | {seed} | {100 * theirs['accuracy']:.2f} % | "
            f"{theirs['test_loss']:.4f} | |",
            f"| `{command}` | {seed} | {100 * mine['accuracy']:.2f} % | {mine['test_loss']:.4f} "
            f"| {100 * mine['accuracy_statistics_reset']:.2f} % |",
        ]
    ours, base = _mean(ports, "accuracy"), _mean(singles, "accuracy")
    lines += [
        "",
        f"- mean accuracy: the port {100 * ours:.2f} %, one process {100 * base:.2f} %: "
        f"{100 * (ours - base):+.2f} points (within 1 wanted)",
        f"- the port's model with its running statistics reset (the buffers not carried): "
        f"{100 * _mean(ports, 'accuracy_statistics_reset'):.2f} % on average",
    ]
    write_json(args.out / "batchnorm.json", {"one_process": singles, "port": ports}, meta)
    write_markdown(args.out / "batchnorm.md", "\n".join(lines), meta)
    print("\n".join(lines))
