"""A coordinator killed mid-run under each strategy: the run its standby finishes, against
calm runs of the same options.

Fashion-MNIST's MLP (examples/fashion_mnist.py, its 10k test images), 2 workers of 32, on
this machine, as separate processes: `tensorbus coordinator`, two `tensorbus worker`s and,
in a killed run, a `tensorbus coordinator --standby-of` started before the workers. Once
the coordinator has made --kill-at of the versions, it is killed with SIGKILL; the standby
takes over after --timeout and the workers move to it by themselves. Calm and killed runs
alternate, --rounds of each a strategy. Under async strategies the order updates come in
is the run's own, so two calm runs differ too: their spread is the yardstick.

Each row says the test accuracy of the calm and the killed runs (mean, and min–max), the
difference of the means, whether every killed run made the calm run's versions and
samples, and the longest time from the kill to the standby's first new version.

    python -m benchmarks takeover
    python -m benchmarks takeover --strategies sync --steps 60 --rounds 1     # a smoke test

    python -m benchmarks takeover --strategies async --rounds 8 --tag async

Writes benchmarks/results/takeover.md and takeover.json (takeover-TAG.* with --tag).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.report import RESULTS, ROOT, Meta, write_json, write_markdown
from benchmarks.standby import nodes, records, wait_for

SPEC = str(ROOT / "examples" / "fashion_mnist.py")
STRATEGIES: dict[str, list[str]] = {
    "sync": ["--strategy", "sync"],
    "average": ["--strategy", "average", "--average-every", "4"],
    "async": ["--strategy", "async"],
    "ssp": ["--strategy", "ssp", "--staleness", "2"],
    "async-average": ["--strategy", "async-average", "--average-every", "4"],
}
TIMEOUT_S = 2.0
LIVENESS = ["--heartbeat", "0.2", "--timeout", str(TIMEOUT_S)]


def _summary(out: str) -> dict[str, Any]:
    summary: dict[str, Any] = json.loads(out[out.index("{"):])
    return summary


def run(strategy: str, steps: int, lr: float, *, kill_at: int | None) -> dict[str, Any]:
    """One run, its coordinator killed at version `kill_at` (None: a calm one): the
    summary of whoever finished it, and, if killed, when the takeover came."""
    options = ["--workers", "2", *STRATEGIES[strategy], "--steps", str(steps), "--batch-size",
               "32", "--lr", str(lr), "--threads", "1", "--no-progress", "--log-level", "error",
               *LIVENESS]
    with nodes() as (tmp, start):
        metrics, kept = tmp / "coordinator.jsonl", tmp / "standby.jsonl"
        coordinator = start("coordinator", SPEC, "--bind", "tcp://127.0.0.1:0", "--json",
                            "--metrics", str(metrics), *options)
        endpoint = wait_for(metrics, lambda r: r["event"] == "listening", coordinator,
                            "listening")["endpoint"]
        standby = None
        if kill_at is not None:
            standby = start("coordinator", SPEC, "--bind", "tcp://127.0.0.1:0", "--json",
                            "--standby-of", endpoint, "--metrics", str(kept), *options)
            wait_for(metrics, lambda r: r["event"] == "standby", coordinator, "a standby")
        for rank in range(2):
            start("worker", SPEC, "--connect", endpoint, "--rank", str(rank), "--threads",
                  "1", "--log-level", "error")
        if standby is None:
            out, _ = coordinator.communicate(timeout=900)
            if coordinator.returncode != 0:
                raise RuntimeError(f"the coordinator failed ({coordinator.returncode})")
            return {"summary": _summary(out)}
        wait_for(metrics, lambda r: r["event"] == "step" and r["version"] >= kill_at,
                 coordinator, f"version {kill_at}")
        coordinator.send_signal(signal.SIGKILL)
        coordinator.wait(timeout=10)
        out, _ = standby.communicate(timeout=900)
        if standby.returncode != 0:
            raise RuntimeError(f"the standby failed ({standby.returncode})")
        kept_records = records(kept)
        takeover = next(r for r in kept_records if r["event"] == "takeover")
        first = next(r for r in kept_records if r["event"] == "step"
                     and r["version"] == takeover["version"] + 1)
        # (From when the standby last heard the killed one, no later than the kill, to
        # its first new version: an upper bound, on the standby's own clock.)
        return {"summary": _summary(out), "takeover": takeover,
                "first_new_s": takeover["silent_s"] + first["wall_s"] - takeover["wall_s"]}


def _spread(values: list[float]) -> str:
    return (f"{100 * statistics.mean(values):.2f} ({100 * min(values):.2f}–"
            f"{100 * max(values):.2f})")


def main(argv: Sequence[str], meta: Meta) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks takeover")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--kill-at", type=float, default=0.4, help="share of --steps")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--tag", default="", help="written as takeover-TAG.md and .json")
    args = parser.parse_args(argv)
    name = f"takeover-{args.tag}" if args.tag else "takeover"
    kill_at = max(1, int(args.steps * args.kill_at))
    rows: dict[str, dict[str, Any]] = {}
    for strategy in args.strategies:
        calm: list[dict[str, Any]] = []
        killed: list[dict[str, Any]] = []
        for i in range(args.rounds):
            # (Alternating which goes first: a drift of the machine's load falls on both.)
            for kill in ((False, True) if i % 2 == 0 else (True, False)):
                got = run(strategy, args.steps, args.lr, kill_at=kill_at if kill else None)
                (killed if kill else calm).append(got)
                print(f"{strategy} round {i + 1} {'killed' if kill else 'calm'}: accuracy "
                      f"{100 * got['summary']['accuracy']:.2f} %"
                      + (f", first new version {got['first_new_s']:.2f} s after the kill"
                         if kill else ""), flush=True)
        want = {(c["summary"]["steps"], c["summary"]["samples"]) for c in calm}
        rows[strategy] = {
            "calm": [c["summary"]["accuracy"] for c in calm],
            "killed": [k["summary"]["accuracy"] for k in killed],
            "same_versions": all((k["summary"]["steps"], k["summary"]["samples"]) in want
                                 for k in killed),
            "first_new_s": [k["first_new_s"] for k in killed],
            "resumed_from": [k["summary"]["resumed_from"] for k in killed],
        }
        row = rows[strategy]
        row["difference"] = statistics.mean(row["killed"]) - statistics.mean(row["calm"])
    lines = ["# A coordinator killed mid-run: its standby's run against calm runs", "",
             f"Fashion-MNIST's MLP, 2 workers of 32, {args.steps} versions at --lr {args.lr}, "
             f"--timeout {TIMEOUT_S:g} s; the coordinator killed with SIGKILL at version "
             f"{kill_at}, and its standby finishing the run; {args.rounds} calm and "
             f"{args.rounds} killed runs a strategy, alternating. Test accuracy on the 10k "
             "test images, %: mean (min–max).", "",
             "| strategy | calm | killed | killed − calm, points | same versions and samples "
             "| kill to first new version, s (most) |", "|---|---|---|---|---|---|"]
    for strategy, row in rows.items():
        lines.append(f"| {strategy} | {_spread(row['calm'])} | {_spread(row['killed'])} | "
                     f"{100 * row['difference']:+.2f} | {'yes' if row['same_versions'] else 'no'} "
                     f"| {max(row['first_new_s']):.2f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    write_markdown(args.out / f"{name}.md", "\n".join(lines), meta)
    write_json(args.out / f"{name}.json", {"steps": args.steps, "kill_at": kill_at,
                                            "lr": args.lr, "rounds": args.rounds,
                                            "strategies": rows}, meta)
    print("\n".join(lines))
