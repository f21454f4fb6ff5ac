"""The single-process baseline: the same SPEC trained in one process, for comparison.

Trains `model()` on `data(0, 1, B)` with the same optimizer, seed and step count that
`tensorbus local` uses, then prints `evaluate()` as JSON. With B = N*b it is the run that
sync training with N workers of batch b must match, e.g.:

    python benchmarks/single_process.py examples/fashion_mnist.py --batch-size 256 --epochs 1
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from run.spec import load_spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec")
    parser.add_argument("--batch-size", type=int, required=True, help="the global batch, N*b")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int)
    length.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=0.1, help="as tensorbus --lr (default 0.1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
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
    result = {"steps": steps, "batch_size": args.batch_size, "wall_s": round(time.perf_counter() - started, 3),
              "final_loss": loss, **(spec.evaluate(model) if spec.evaluate else {})}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
