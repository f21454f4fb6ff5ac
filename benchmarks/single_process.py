"""The single-process baseline: the same SPEC trained in one process, for comparison.

Trains `model()` on `data(0, 1, B)` with the same optimizer, seed and step count that
`tensorbus local` uses, then prints `evaluate()` as JSON (with the run's metadata). With
B = N*b it is the run that sync training with N workers of batch b must match: the README's
quick start (`tensorbus local examples/fashion_mnist.py --workers 4 --strategy sync --epochs
1`) beside

    python -m benchmarks single_process examples/fashion_mnist.py --batch-size 256 --epochs 1

It writes no result file: its figures belong beside that run's.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import asdict

import torch

from benchmarks.report import Meta
from tensorbus.run.spec import load_spec


def main(argv: Sequence[str], meta: Meta) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks single_process",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("spec")
    parser.add_argument("--batch-size", type=int, required=True, help="the global batch, N*b")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int)
    length.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=0.1, help="as tensorbus --lr (default 0.1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    spec = load_spec(args.spec)
    torch.manual_seed(args.seed)
    model = spec.build_model()
    make = spec.optimizer or (lambda params: torch.optim.SGD(params, lr=args.lr))
    optimizer = make(model.parameters())
    shard = spec.data(0, 1, args.batch_size)
    steps = args.steps or args.epochs * len(shard)
    started = time.perf_counter()
    done, loss = 0, float("nan")
    while done < steps:
        for inputs, targets in shard:
            optimizer.zero_grad()
            value = spec.loss(model(inputs), targets)
            value.backward()
            optimizer.step()
            loss, done = float(value.detach()), done + 1
            if done == steps:
                break
    result = {"steps": steps, "batch_size": args.batch_size,
              "wall_s": round(time.perf_counter() - started, 3), "final_loss": loss,
              **(spec.evaluate(model) if spec.evaluate else {})}
    print(json.dumps({"meta": asdict(meta), "result": result}))
