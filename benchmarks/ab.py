"""This checkout against another commit, side by side: did a change make training faster?

Checks REV out into a temporary git worktree and runs the same cases from both trees,
alternating within each round (old then new, then new then old in the next round), so
that the machine's noise falls on both alike; each case's ratio is taken within a round.
The cases, on `benchmarks/mlp.py`, 2 workers, one torch thread a process:

- async, batch 1, 1M parameters: updates per second (part (c)'s tensorbus case);
- sync with colocated shards, batch 64, 1M and 10M parameters: median ms per version;
- the same at 1M: the median ms shard 0 spends making each version and handing it to its
  sockets (its trace's apply and broadcast spans: `steps.shard_ms`);
- only with `--only ssp`: ssp at staleness 0 and 2, batch 1, 1M: updates per second (a
  run that dropped an update fails);
- only with `--only bf16`: async (updates per second) and colocated sync (ms per version)
  with `--compress bf16`;
- only with `--only start`: seconds from starting `tensorbus local` (4 workers, one version,
  batch 64, 1M) to its exit, with one coordinator and with `--colocate`: what a user waits
  for when the training itself is short.

    python benchmarks/ab.py REV [--rounds 3]      # about 90 s a round
    python benchmarks/ab.py REV --rounds 8 --only "sync colocated, 10M"   # 40 s a round
    python benchmarks/ab.py REV --rounds 4 --only ssp     # 70 s a round
    python benchmarks/ab.py REV --rounds 3 --only bf16    # 90 s a round
    python benchmarks/ab.py REV --rounds 5 --only start   # 30 s a round

Writes benchmarks/results/ab-REV.md and .json (with --only, ab-REV-CASE.md and .json).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import steps

RESULTS = ROOT / "benchmarks" / "results"
GIT_S = 120  # a local git command; past this, something is wrong (a lock held, say)


CASES: dict[str, tuple[Callable[[Path], float], str]] = {
    "async, 1M, batch 1": (lambda tree: steps.tensorbus_async("1M", 3000, tree=tree), "updates/s"),
    "sync colocated, 1M": (lambda tree: 1000 * steps.tensorbus_sync("1M", 400, colocate=True,
                                                                    tree=tree), "ms/version"),
    "sync colocated, 10M": (lambda tree: 1000 * steps.tensorbus_sync("10M", 60, colocate=True,
                                                                     tree=tree), "ms/version"),
    "shard 0's step + broadcast, sync colocated, 1M": (
        lambda tree: steps.shard_ms("1M", 1500, tree=tree), "ms/version"),
    # (only when asked: --only ssp)
    "ssp, staleness 0, 1M, batch 1": (
        lambda tree: steps.tensorbus_ssp("1M", 3000, 0, tree=tree), "updates/s"),
    "ssp, staleness 2, 1M, batch 1": (
        lambda tree: steps.tensorbus_ssp("1M", 3000, 2, tree=tree), "updates/s"),
    # (only when asked: --only bf16)
    "bf16: async, 1M, batch 1": (
        lambda tree: steps.tensorbus_async("1M", 3000, compress="bf16", tree=tree), "updates/s"),
    "bf16: sync colocated, 1M": (
        lambda tree: 1000 * steps.tensorbus_sync("1M", 400, compress="bf16", colocate=True,
                                                 tree=tree), "ms/version"),
    "bf16: sync colocated, 10M": (
        lambda tree: 1000 * steps.tensorbus_sync("10M", 60, compress="bf16", colocate=True,
                                                 tree=tree), "ms/version"),
    # (only when asked: --only start)
    "start: local, 4 workers, 1 version, 1M": (
        lambda tree: steps.local_wall_s("1M", 4, tree=tree), "s"),
    "start: local --colocate, 4 workers, 1 version, 1M": (
        lambda tree: steps.local_wall_s("1M", 4, "--colocate", tree=tree), "s"),
}
OPT_IN = ("ssp", "bf16", "start")  # cases run only when --only names them


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", help="the commit to compare with (the old side)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="", help="only the cases whose name starts so "
                        "('sync colocated, 10M', 'async', ...); the file is then named after it")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    cases = {c: m for c, m in CASES.items() if c.startswith(args.only)
             and (args.only or not c.startswith(OPT_IN))}
    if not cases:
        parser.error(f"--only {args.only!r} names none of: {', '.join(CASES)}")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                          capture_output=True, text=True, timeout=GIT_S).stdout.strip()
    figures: dict[str, dict[str, list[float]]] = {c: {"old": [], "new": []} for c in cases}
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(old), args.rev], cwd=ROOT,
                       check=True, timeout=GIT_S)
        try:
            for r in range(args.rounds):
                for case, (measure, unit) in cases.items():
                    # Which goes first alternates: a slow start or a warm cache falls on both.
                    sides = (("old", old), ("new", ROOT))
                    for side, tree in sides if r % 2 == 0 else sides[::-1]:
                        figures[case][side].append(measure(tree))
                        print(f"round {r + 1}/{args.rounds} {case} {side}: "
                              f"{figures[case][side][-1]:.2f} {unit}", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT,
                           check=False, timeout=GIT_S)
    only = f' --only "{args.only}"' if args.only else ""
    lines = [(f"`python benchmarks/ab.py {args.rev} --rounds {args.rounds}{only}` (new: this "
              f"checkout, {head} and what is not committed; old: {args.rev})"), "",
             "| case | old, median | new, median | new / old: median (min–max) | each round | unit |",
             "|---|---:|---:|---|---|---|"]
    for case, (_, unit) in cases.items():
        o, n = figures[case]["old"], figures[case]["new"]
        ratios = [b / a for a, b in zip(o, n, strict=True)]
        lines.append(f"| {case} | {statistics.median(o):.2f} | {statistics.median(n):.2f} "
                     f"| {statistics.median(ratios):.3f} ({min(ratios):.3f}–{max(ratios):.3f}) "
                     f"| {', '.join(f'{r:.3f}' for r in ratios)} | {unit} |")
    args.out.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", args.only).strip("-")
    name = f"ab-{args.rev}" + (f"-{slug}" if slug else "")
    (args.out / f"{name}.json").write_text(json.dumps({"new": head, "old": args.rev,
                                                       "figures": figures}, indent=1) + "\n")
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
