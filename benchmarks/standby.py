"""The price of a standby coordinator: a sync step with one following, and without.

The 10M-parameter MLP of benchmarks/mlp.py (BENCH_PARAMS), sync, 2 workers of 64, on this
machine: `tensorbus coordinator` and two `tensorbus worker`s, and in the other case a
`tensorbus coordinator --standby-of` too, started before the workers (a coordinator
replicates every version to its standby before publishing it: nodes.replication). The
two alternate, --rounds times. A step's time is the median gap between consecutive
versions in the coordinator's metrics, the first --skip versions left out; the summary
says how long the replicas took in all.

    python -m benchmarks standby
    python -m benchmarks standby --params 1M --steps 30 --rounds 1     # a smoke test

Writes benchmarks/results/standby.md and standby.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks import checkout, mlp
from benchmarks.report import RESULTS, ROOT, Meta, write_json, write_markdown

SPEC = str(ROOT / "benchmarks" / "mlp.py")
START_S = 120.0  # a node's start (imports, model, binding), as a deadline
Start = Callable[..., subprocess.Popen[str]]  # nodes(): starts `tensorbus ARGS`


def records(path: Path) -> list[dict[str, Any]]:
    """The metrics file's records so far (none before it exists)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def wait_for(path: Path, found: Callable[[dict[str, Any]], bool],
             process: subprocess.Popen[str], what: str) -> dict[str, Any]:
    """The first record of `path` that `found` accepts, within START_S; an error if
    `process` ends first."""
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        record = next((r for r in records(path) if found(r)), None)
        if record is not None:
            return record
        if process.poll() is not None:
            raise RuntimeError(f"a node ended ({process.returncode}) before {what}")
        time.sleep(0.02)
    raise RuntimeError(f"no {what} in {path} within {START_S:.0f} s")


@contextlib.contextmanager
def nodes(env: dict[str, str] | None = None) -> Iterator[tuple[Path, Start]]:
    """A temporary folder, and `start(*args)`: `tensorbus ARGS` of this checkout, its
    stdout a pipe; every node started is killed, if still running, and reaped at the end."""
    processes: list[subprocess.Popen[str]] = []
    with tempfile.TemporaryDirectory() as tmp, checkout.cli() as (tensorbus, base):

        def start(*args: str) -> subprocess.Popen[str]:
            process = subprocess.Popen([*tensorbus, *args], cwd=ROOT, env={**base, **(env or {})},
                                       text=True, stdout=subprocess.PIPE,
                                       stderr=subprocess.DEVNULL)
            processes.append(process)
            return process

        try:
            yield Path(tmp), start
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait(timeout=10)


def run(params: str, steps: int, *, standby: bool) -> dict[str, Any]:
    """One run: the coordinator's records and summary."""
    run_options = ["--workers", "2", "--strategy", "sync", "--steps", str(steps),
                   "--batch-size", "64", "--threads", "1", "--no-progress", "--log-level", "error"]
    with nodes({"BENCH_PARAMS": params}) as (tmp, start):
        metrics = tmp / "coordinator.jsonl"
        coordinator = start("coordinator", SPEC, "--bind", "tcp://127.0.0.1:0", "--json",
                            "--metrics", str(metrics), *run_options)
        endpoint = wait_for(metrics, lambda r: r["event"] == "listening", coordinator,
                            "listening")["endpoint"]
        others = []
        if standby:
            others.append(start("coordinator", SPEC, "--bind", "tcp://127.0.0.1:0",
                                "--standby-of", endpoint, "--metrics",
                                str(tmp / "standby.jsonl"), *run_options))
            wait_for(metrics, lambda r: r["event"] == "standby", coordinator, "a standby")
        others += [start("worker", SPEC, "--connect", endpoint, "--rank", str(rank),
                         "--threads", "1", "--log-level", "error") for rank in range(2)]
        out, _ = coordinator.communicate(timeout=600)
        if coordinator.returncode != 0:
            raise RuntimeError(f"the coordinator failed ({coordinator.returncode})")
        for process in others:  # (the standby ends with the run it follows)
            process.wait(timeout=60)
        return {"records": records(metrics), "summary": json.loads(out[out.index("{"):])}


def step_s(records: list[dict[str, Any]], skip: int) -> float:
    times = [r["train_s"] for r in records if r["event"] == "step"][skip:]
    return statistics.median(b - a for a, b in zip(times, times[1:], strict=False))


def main(argv: Sequence[str], meta: Meta) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks standby")
    parser.add_argument("--params", default="10M", choices=sorted(mlp.HIDDEN))
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--skip", type=int, default=30, help="first versions not timed")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    rounds: list[dict[str, Any]] = []
    for i in range(args.rounds):
        row: dict[str, Any] = {}
        # (Alternating which goes first: a drift of the machine's load falls on both.)
        for standby in ((False, True) if i % 2 == 0 else (True, False)):
            got = run(args.params, args.steps, standby=standby)
            row["standby" if standby else "alone"] = step_s(got["records"], args.skip)
            if standby:
                kept = got["summary"]["standby"]
                row["replicate_ms"] = 1e3 * kept["replicate_s"] / max(kept["replicated"], 1)
        row["ratio"] = row["standby"] / row["alone"]
        print(f"round {i + 1}: alone {row['alone'] * 1e3:.1f} ms, with a standby "
              f"{row['standby'] * 1e3:.1f} ms a step (a replica {row['replicate_ms']:.1f} ms), "
              f"ratio {row['ratio']:.3f}", flush=True)
        rounds.append(row)
    ratio = statistics.median(r["ratio"] for r in rounds)
    result = {"params": args.params, "steps": args.steps, "skip": args.skip, "rounds": rounds,
              "median_ratio": ratio}
    lines = ["# A standby coordinator's price: sync step time", "",
             f"The {args.params} MLP, sync, 2 workers of 64, {args.steps} versions, the first "
             f"{args.skip} not timed; the median gap between versions, with a standby following "
             "(every version replicated to it before it is published) and without, alternating.",
             "", "| round | alone, ms | with a standby, ms | a replica, ms | with ÷ alone |",
             "|---|---|---|---|---|"]
    for i, r in enumerate(rounds):
        lines.append(f"| {i + 1} | {r['alone'] * 1e3:.1f} | {r['standby'] * 1e3:.1f} | "
                     f"{r['replicate_ms']:.1f} | {r['ratio']:.3f} |")
    spread = [r["ratio"] for r in rounds]
    lines += ["", f"Median with ÷ alone: **{ratio:.3f}** ({min(spread):.3f}–{max(spread):.3f})."]
    args.out.mkdir(parents=True, exist_ok=True)
    write_markdown(args.out / "standby.md", "\n".join(lines), meta)
    write_json(args.out / "standby.json", result, meta)
    print(f"median with/alone {ratio:.3f}")
