"""The cost of bringing your own loop: its step time against a SPEC run's, side by side.

The same model, data, batch and SGD (examples/fashion_mnist.py's MLP, 2 workers of 64,
sync), trained for --steps versions two ways, alternating, --rounds times:

- the SPEC route: `tensorbus local examples/fashion_mnist.py --workers 2 --steps N`;
- the own loop: `tensorbus launch` of a plain loop over the same model(), data() and loss()
  with `tensorbus.DistributedOptimizer` (written to a temporary file).

A step's time is the median gap between consecutive versions in the coordinator's metrics
(after the first --skip versions), so start-up does not count. Each round times both routes
with same-host shared memory, then both without (MEMORY). Reported: each route's median,
and own ÷ SPEC per round and overall, for each. Writes benchmarks/results/own_loop.md and .json:

    python -m benchmarks own_loop
    python -m benchmarks own_loop --steps 30 --rounds 1     # a smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import checkout
from benchmarks.report import RESULTS, ROOT, Meta, write_json, write_markdown

SPEC = "examples/fashion_mnist.py"
SCRIPT = f'''
import sys
import torch
sys.path.insert(0, {str(ROOT / "examples")!r})
import fashion_mnist as spec
import tensorbus

steps = int(sys.argv[1])
torch.set_num_threads(1)
ctx = tensorbus.init()
torch.manual_seed(0)
model = spec.model()
optimizer = tensorbus.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
done = 0
while done < steps:
    for x, y in spec.data(ctx.rank, ctx.world_size, 64):
        optimizer.zero_grad()
        spec.loss(model(x), y).backward()
        optimizer.step()
        done += 1
        if done == steps:
            break
'''


def _step_s(metrics: Path, skip: int) -> float:
    times = [r["train_s"] for r in map(json.loads, metrics.read_text().splitlines())
             if r["event"] == "step"][skip:]
    return statistics.median(b - a for a, b in zip(times, times[1:], strict=False))


def spec_route(steps: int, skip: int, extra: Sequence[str] = ()) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.jsonl"
        checkout.run_tensorbus(["local", SPEC, "--workers", "2", "--batch-size", "64", "--lr",
                                "0.1", "--steps", str(steps), "--metrics", str(metrics),
                                "--threads", "1", "--no-progress", "--log-level", "error",
                                *extra])
        return _step_s(metrics, skip)


def own_route(steps: int, skip: int, extra: Sequence[str] = ()) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        metrics, script = Path(tmp) / "m.jsonl", Path(tmp) / "loop.py"
        script.write_text(SCRIPT)
        checkout.run_tensorbus(["launch", str(script), "--workers", "2", "--metrics",
                                str(metrics), "--threads", "1", "--no-progress", "--log-level",
                                "error", *extra, "--", str(steps)])
        return _step_s(metrics, skip)


# Same-host shared memory on (the default), then off: a SPEC worker computes on the
# coordinator's weight set in place, which a script cannot (its own code may write the
# model between its steps), so the second isolates the wrapper from that difference.
MEMORY = {"shared": (), "no-shared": ("--no-shared-memory",)}


def main(argv: Sequence[str], meta: Meta) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks own_loop")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--skip", type=int, default=50, help="first versions not timed")
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    rounds: list[dict[str, Any]] = []
    for i in range(args.rounds):
        row: dict[str, Any] = {}
        for memory, extra in MEMORY.items():
            # (Alternating which goes first: a drift of the machine's load falls on both.)
            first, second = (spec_route, own_route) if i % 2 == 0 else (own_route, spec_route)
            a, b = first(args.steps, args.skip, extra), second(args.steps, args.skip, extra)
            spec, own = (a, b) if first is spec_route else (b, a)
            row[memory] = {"spec_ms": spec * 1e3, "own_ms": own * 1e3, "ratio": own / spec}
            print(f"round {i + 1}, {memory}: SPEC {spec * 1e3:.2f} ms, own loop "
                  f"{own * 1e3:.2f} ms a step, own/SPEC {own / spec:.3f}", flush=True)
        rounds.append(row)
    ratios = {m: statistics.median(r[m]["ratio"] for r in rounds) for m in MEMORY}
    result = {"steps": args.steps, "skip": args.skip, "rounds": rounds, "median_ratio": ratios}
    lines = ["# Own loop against a SPEC run: sync step time", "",
             f"examples/fashion_mnist.py's MLP, 2 workers of 64, sync, {args.steps} versions, "
             f"the first {args.skip} not timed; the median gap between versions. Each round "
             "runs both routes with same-host shared memory (the default: a SPEC worker "
             "computes on the coordinator's weight set in place, a script on its own copy), "
             "then both with `--no-shared-memory` (both on their own copy).", "",
             "| round | SPEC ms | own loop ms | own ÷ SPEC | SPEC ms, no shared | own loop ms, "
             "no shared | own ÷ SPEC, no shared |", "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rounds):
        cells = [f"{r[m]['spec_ms']:.2f} | {r[m]['own_ms']:.2f} | {r[m]['ratio']:.3f}"
                 for m in MEMORY]
        lines.append(f"| {i + 1} | {' | '.join(cells)} |")
    lines += ["", f"Median own ÷ SPEC: **{ratios['shared']:.3f}** with shared memory, "
              f"**{ratios['no-shared']:.3f}** without.", ""]
    args.out.mkdir(parents=True, exist_ok=True)
    write_markdown(args.out / "own_loop.md", "\n".join(lines), meta)
    write_json(args.out / "own_loop.json", result, meta)
    print(f"median own/SPEC {ratios['shared']:.3f} shared, {ratios['no-shared']:.3f} not")
