"""The consistency models side by side on Fashion-MNIST, with and without a straggler.

Runs `tensorbus local` (through `launch_local`) for each model: sync on 4 workers, sync
with 1 backup on 5, ssp with S = 2, async, periodic averaging with H = 8 (with full and
int8 pushes) and asynchronous averaging with H = 8 (int8), each for the same number of
samples, first with every worker at full speed, then with worker 1 made a
straggler by `--fault slow:1:MS`. MS is measured in the same invocation: twice the step
time of the calm sync run, so that the straggler's steps take about 3x as long. Weight
copies taken every `--eval-every` seconds of training are evaluated afterwards, which gives
accuracy against training time (from the opening of the start gate, so process start-up is
not counted) without slowing the runs.

Writes under benchmarks/results/: convergence.md (the table), convergence.json (every
figure and curve), convergence.png (accuracy against training time, one line per
model, one panel per condition) and convergence-straggler.png (`tensorbus plot` of the
runs with the straggler: loss, accuracy, and each worker's split of time, where the
straggler shows). About 3 minutes on 2 cores:

    python -m benchmarks convergence
    python -m benchmarks convergence --steps 20     # a smoke test: 20 versions a run
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.report import RESULTS, ROOT, Meta, stamp_png, write_json, write_markdown
from tensorbus.run.local import launch_local
from tensorbus.run.options import RunOptions
from tensorbus.run.plot import plot as draw

SPEC = ROOT / "examples" / "fashion_mnist.py"
STRAGGLER = 1


@dataclass(frozen=True)
class Model:
    label: str
    strategy: str
    workers: int
    options: dict[str, Any]
    compress: str = ""


MODELS = (
    Model("sync", "sync", 4, {}),
    Model("sync + 1 backup (5 workers)", "sync", 5, {"backups": 1}),
    Model("ssp S=2", "ssp", 4, {"staleness": 2}),
    Model("async", "async", 4, {}),
    Model("average H=8", "average", 4, {"average_every": 8}),
    Model("average H=8, int8", "average", 4, {"average_every": 8}, "int8"),
    Model("async-average H=8 (int8)", "async-average", 4, {"average_every": 8}),
)


def run(model: Model, args: argparse.Namespace, slow_ms: int | None, workdir: Path) -> dict[str, Any]:
    """One run; its summary, its accuracy curve and the straggler's measured slow-down."""
    metrics = workdir / f"{model.strategy}-{model.workers}-{model.compress}-{slow_ms}.jsonl"
    faults = (f"slow:{STRAGGLER}:{slow_ms}",) if slow_ms else ()
    options = RunOptions(
        workers=model.workers, strategy=model.strategy,
        **({"steps": args.steps} if args.steps else {"epochs": args.epochs}),
        batch_size=args.batch_size, lr=args.lr, metrics=metrics, strategy_options=model.options,
        faults=faults, eval_every_s=args.eval_every, compress=model.compress,
    )
    summary = launch_local(SPEC, options, threads=1)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    curve = sorted((r["train_s"], r["accuracy"]) for r in records if r["event"] == "eval")
    curve.append((summary["train_s"], summary["accuracy"]))  # the final weights
    steps = [r["train_s"] for r in records if r["event"] == "step"]
    reached = next((t for t, acc in curve if acc >= args.target), None)
    return {
        "label": model.label, "strategy": model.strategy, "workers": model.workers,
        "options": model.options, "straggler_ms": slow_ms or 0,
        "accuracy": summary["accuracy"], "samples": summary["samples"],
        "versions": summary["steps"], "train_s": summary["train_s"],
        "time_to_target_s": reached, "dropped": summary["dropped"],
        "max_staleness": summary["max_staleness"], "max_clock_gap": summary["max_clock_gap"],
        "per_worker": summary["per_worker"],
        "median_step_s": statistics.median(b - a for a, b in itertools.pairwise(steps))
        if len(steps) > 2 else None,
        "curve": curve,
        "metrics": str(metrics),  # a temporary file: for `tensorbus plot` below
    }


def table(results: list[dict[str, Any]], args: argparse.Namespace, slow_ms: int) -> str:
    by = {(r["label"], r["straggler_ms"] > 0): r for r in results}
    sync_calm, sync_slow = by[("sync", False)], by[("sync", True)]

    def cell_time(r: dict[str, Any], sync: dict[str, Any]) -> str:
        t = r["time_to_target_s"]
        if t is None:
            return "not reached"
        ref = sync["time_to_target_s"]
        return f"{t:.1f} s ({ref / t:.2f}x)" if ref else f"{t:.1f} s"

    length = f"{args.steps} versions" if args.steps else f"{args.epochs} epoch(s) of samples"
    intro = (
        f"Fashion-MNIST MLP (784-256-128-10), {length} per run "
        f"({results[0]['samples']} samples in the first), batch {args.batch_size} per worker, "
        f"SGD lr {args.lr}, one torch thread per worker. Straggler: worker "
        f"{STRAGGLER} sleeps {slow_ms} ms in every step (twice the calm sync step). Time is "
        "training time (from the start gate); the ratio in brackets is sync's time to target "
        "in the same condition divided by this model's (above 1: faster than sync)."
    )
    header = (
        f"| model | accuracy | train time | time to {args.target:.0%} | "
        f"accuracy (straggler) | train time (straggler) | time to {args.target:.0%} (straggler) | "
        "dropped (straggler) |"
    )
    lines = [intro, "", header, "|---|---|---|---|---|---|---|---|"]
    for model in MODELS:
        calm, slow = by[(model.label, False)], by[(model.label, True)]
        dropped = ", ".join(f"{k} {v}" for k, v in sorted(slow["dropped"].items())) or "-"
        lines.append(
            f"| {model.label} | {calm['accuracy']:.2%} | {calm['train_s']:.1f} s | "
            f"{cell_time(calm, sync_calm)} | {slow['accuracy']:.2%} | {slow['train_s']:.1f} s | "
            f"{cell_time(slow, sync_slow)} | {dropped} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: list[dict[str, Any]], args: argparse.Namespace, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, slowed in zip(axes, (False, True), strict=True):
        for r in results:
            if (r["straggler_ms"] > 0) != slowed:
                continue
            t, acc = zip(*r["curve"], strict=True)
            ax.plot(t, [100 * a for a in acc], marker=".", label=r["label"])
        ax.axhline(100 * args.target, color="grey", linestyle=":", linewidth=1)
        ax.set_title("one straggler (3x slower)" if slowed else "no straggler")
        ax.set_xlabel("training time (s)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test accuracy (%)")
    axes[0].set_ylim(60, None)
    axes[1].legend(loc="lower right")
    fig.suptitle("Fashion-MNIST, 4 workers: accuracy against training time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str], meta: Meta) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks convergence",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2, help="samples per run, in epochs")
    parser.add_argument("--steps", type=int, help="versions per run, in place of --epochs")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--target", type=float, default=0.80, help="target test accuracy")
    parser.add_argument("--eval-every", type=float, default=0.25, help="seconds of training")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        calm_sync = run(MODELS[0], args, None, workdir)
        slow_ms = max(1, round(2000 * calm_sync["median_step_s"]))
        print(f"calm sync: {calm_sync['median_step_s'] * 1000:.1f} ms a step; "
              f"straggler sleeps {slow_ms} ms", file=sys.stderr)
        results.append(calm_sync)
        # Interleaved: each model calm, then slowed, so that drifts in machine load touch both.
        for model in MODELS:
            for slowed in (False, True):
                if model is MODELS[0] and not slowed:
                    continue
                result = run(model, args, slow_ms if slowed else None, workdir)
                print(f"{model.label:30} straggler={slowed!s:5} acc {result['accuracy']:.4f} "
                      f"train {result['train_s']:.1f} s to-target {result['time_to_target_s']}",
                      file=sys.stderr)
                results.append(result)
        slowed_runs = [r for r in results if r["straggler_ms"]]
        drawn = draw([Path(r["metrics"]) for r in slowed_runs], args.out / "convergence-straggler.png",
                     labels=[r["label"] for r in slowed_runs])
        stamp_png(drawn, meta)
    for r in results:
        del r["metrics"]  # gone with the temporary directory
    for r in results:  # the straggler's slow-down, measured
        pushes = {int(k): v["pushes"] for k, v in r["per_worker"].items()}
        others = [v for k, v in pushes.items() if k != STRAGGLER]
        r["straggler_push_share"] = pushes.get(STRAGGLER, 0) / statistics.mean(others) if others else None
    markdown = table(results, args, slow_ms)
    write_markdown(args.out / "convergence.md", markdown, meta)
    write_json(args.out / "convergence.json",
               {"straggler_ms": slow_ms, "args": {k: str(v) for k, v in vars(args).items()},
                "total_s": round(time.monotonic() - started, 1), "results": results}, meta)
    stamp_png(plot(results, args, args.out / "convergence.png"), meta)
    print(markdown)
