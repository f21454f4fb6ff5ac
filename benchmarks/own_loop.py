"""The cost of bringing your own loop: its step time against a SPEC run's, side by side.

The same model, data, batch and SGD (examples/fashion_mnist.py's MLP, 2 workers of 64,
sync), trained for --steps versions two ways, alternating, --rounds times:

- the SPEC route: `tensorbus local examples/fashion_mnist.py --workers 2 --steps N`;
- the own loop: `tensorbus launch` of a plain loop over the same model(), data() and loss()
  with `tensorbus.DistributedOptimizer` (written to a temporary file).

A step's time is the median gap between consecutive versions in the coordinator's metrics
(after the first --skip versions), so start-up does not count. Reported: each route's
median, and own ÷ SPEC per round and overall. Writes benchmarks/results/own_loop.md and .json:

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


def spec_route(steps: int, skip: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.jsonl"
        checkout.run_tensorbus(["local", SPEC, "--workers", "2", "--batch-size", "64", "--lr",
                                "0.1", "--steps", str(steps), "--metrics", str(metrics),
                                "--threads", "1", "--no-progress", "--log-level", "error"])
        return _step_s(metrics, skip)


def own_route(steps: int, skip: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        metrics, script = Path(tmp) / "m.jsonl", Path(tmp) / "loop.py"
        script.write_text(SCRIPT)
        checkout.run_tensorbus(["launch", str(script), "--workers", "2", "--metrics",
                                str(metrics), "--threads", "1", "--no-progress", "--log-level",
                                "error", "--", str(steps)])
        return _step_s(metrics, skip)


def main(argv: Sequence[str], meta: Meta) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks own_loop")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--skip", type=int, default=50, help="first versions not timed")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    rounds: list[dict[str, Any]] = []
    for i in range(args.rounds):
        # (Alternating which goes first: a drift of the machine's load falls on both.)
        first, second = (spec_route, own_route) if i % 2 == 0 else (own_route, spec_route)
        a, b = first(args.steps, args.skip), second(args.steps, args.skip)
        spec, own = (a, b) if first is spec_route else (b, a)
        rounds.append({"spec_ms": spec * 1e3, "own_ms": own * 1e3, "ratio": own / spec})
        print(f"round {i + 1}: SPEC {spec * 1e3:.2f} ms, own loop {own * 1e3:.2f} ms a step, "
              f"own/SPEC {own / spec:.3f}", flush=True)
    ratio = statistics.median(r["ratio"] for r in rounds)
    result = {"steps": args.steps, "skip": args.skip, "rounds": rounds, "median_ratio": ratio}
    lines = ["# Own loop against a SPEC run: sync step time", "",
             f"examples/fashion_mnist.py's MLP, 2 workers of 64, sync, {args.steps} versions, "
             f"the first {args.skip} not timed; the median gap between versions.", "",
             "| round | SPEC ms | own loop ms | own ÷ SPEC |", "|---|---|---|---|"]
    lines += [f"| {i + 1} | {r['spec_ms']:.2f} | {r['own_ms']:.2f} | {r['ratio']:.3f} |"
              for i, r in enumerate(rounds)]
    lines += ["", f"Median own ÷ SPEC: **{ratio:.3f}**.", ""]
    args.out.mkdir(parents=True, exist_ok=True)
    write_markdown(args.out / "own_loop.md", "\n".join(lines), meta)
    write_json(args.out / "own_loop.json", result, meta)
    print(f"median own/SPEC {ratio:.3f}")
