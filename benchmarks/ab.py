"""This checkout against another commit, side by side: did a change make training faster?

Checks REV out into a temporary git worktree and runs the same cases from both trees (each
tree's own `tensorbus` command and benchmarks/mlp.py, old layout or new: benchmarks.checkout),
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

    python -m benchmarks ab REV [--rounds 3]      # about 90 s a round
    python -m benchmarks ab REV --rounds 8 --only "sync colocated, 10M"   # 40 s a round
    python -m benchmarks ab REV --rounds 4 --only ssp     # 70 s a round
    python -m benchmarks ab REV --rounds 3 --only bf16    # 90 s a round
    python -m benchmarks ab REV --rounds 5 --only start   # 30 s a round

Writes benchmarks/results/ab.md and ab.json (the last comparison made; REV is in them).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from benchmarks import steps
from benchmarks.report import GIT_S, RESULTS, ROOT, Meta, write_json, write_markdown

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


def main(argv: Sequence[str], meta: Meta) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks ab",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("rev", help="the commit to compare with (the old side)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="", help="only the cases whose name starts so "
                        f"('sync colocated, 10M', 'async', ...); {', '.join(OPT_IN)}: only when named")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    cases = {c: m for c, m in CASES.items() if c.startswith(args.only)
             and (args.only or not c.startswith(OPT_IN))}
    if not cases:
        parser.error(f"--only {args.only!r} names none of: {', '.join(CASES)}")
    found = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{args.rev}^{{commit}}"],
                           cwd=ROOT, capture_output=True, text=True, timeout=GIT_S, check=False)
    if found.returncode != 0:
        parser.error(f"{args.rev!r} names no commit of this repository")
    old_commit = found.stdout.strip()
    figures: dict[str, dict[str, list[float]]] = {c: {"old": [], "new": []} for c in cases}
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(old), old_commit], cwd=ROOT,
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
    lines = [(f"new: this checkout (the commit above); old: {args.rev}, commit {old_commit}; "
              f"{args.rounds} rounds, the order of the two alternating"), "",
             "| case | old, median | new, median | new / old: median (min–max) | each round | unit |",
             "|---|---:|---:|---|---|---|"]
    for case, (_, unit) in cases.items():
        o, n = figures[case]["old"], figures[case]["new"]
        ratios = [b / a for a, b in zip(o, n, strict=True)]
        lines.append(f"| {case} | {statistics.median(o):.2f} | {statistics.median(n):.2f} "
                     f"| {statistics.median(ratios):.3f} ({min(ratios):.3f}–{max(ratios):.3f}) "
                     f"| {', '.join(f'{r:.3f}' for r in ratios)} | {unit} |")
    write_json(args.out / "ab.json", {"old": old_commit, "rev": args.rev, "only": args.only,
                                      "figures": figures}, meta)
    write_markdown(args.out / "ab.md", "\n".join(lines), meta)
    print("\n".join(lines))
