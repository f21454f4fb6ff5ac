"""The one entry point of the benchmarks: list them, run one, run them all, or smoke-test them.

Run from the top of the checkout, with this checkout's tensorbus installed (pip install -e .):

    python -m benchmarks                     # the list: name, minutes, what against what
    python -m benchmarks NAME [OPTIONS]      # one benchmark; NAME --help for its options
    python -m benchmarks all [--dry-run]     # every benchmark at its defaults, into results/
    python -m benchmarks smoke [NAME ...]    # each at its smallest settings, into a temporary folder

A benchmark writes its results under benchmarks/results/ (or --out), each file opening
with the run's metadata (benchmarks/report.py). `all` and `smoke` run each benchmark as
`python -m benchmarks NAME ...` in a process of its own and go on past one that fails.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.report import ROOT, Meta, read_markdown_meta, read_png_meta

RUN_S = 3600  # the longest one benchmark of `all` may take; a smoke run gets a tenth of it


@dataclass(frozen=True, kw_only=True)
class Benchmark:
    name: str  # also its module, benchmarks/NAME.py
    measures: str
    baseline: str  # what it is measured against, in the same run
    minutes: str  # at its default settings, on 2 cores
    runs: tuple[tuple[str, ...], ...]  # the options of each of its runs in `all` (none: not in it)
    smoke: tuple[str, ...]  # its smallest settings
    writes: bool = True  # whether it writes result files (and so takes --out)


BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in (
    Benchmark(name="bench", measures="bus throughput, sync step, async updates/s, scaling",
              baseline="raw pyzmq, memcpy, one process, DDP on gloo, a naive parameter server",
              minutes="13", runs=((),), smoke=("--rounds", "1", "--quick", "--only", "a/1MB")),
    Benchmark(name="throughput", measures="128 MiB over raw pyzmq by frame size, and the bus",
              baseline="raw pyzmq at each frame size", minutes="3", runs=((),),
              smoke=("--mb", "1", "--rounds", "1")),
    Benchmark(name="sync_cpu", measures="CPU and wall time of a sync step, all processes",
              baseline="DDP on gloo", minutes="2", runs=((),),
              smoke=("--steps", "20", "--rounds", "1")),
    Benchmark(name="async_cpu", measures="CPU of an async update, and where it goes",
              baseline="a naive parameter server, one process", minutes="8", runs=((),),
              smoke=("--updates", "40", "--rounds", "1", "--seconds", "1")),
    Benchmark(name="async_floor", measures="async updates/s of a bare shared-memory server",
              baseline="a naive parameter server (and tensorbus async)", minutes="12", runs=((),),
              smoke=("--updates", "60", "--rounds", "1")),
    Benchmark(name="cpu_split", measures="CPU of a colocated sync version, thread by thread",
              baseline="one process's step", minutes="1 each",
              runs=(("--params", "1M"), ("--params", "10M")),
              smoke=("--params", "1M", "--seconds", "1")),
    Benchmark(name="cpu_profile", measures="CPU of a sync step by library and function (perf)",
              baseline="DDP on gloo", minutes="3 each", runs=(("--params", "1M"), ("--params", "10M")),
              smoke=("--params", "1M", "--seconds", "1", "--rounds", "1")),
    Benchmark(name="timeline", measures="the parts of a colocated sync version, from its trace",
              baseline="the whole version", minutes="1 each",
              runs=(("--params", "1M"), ("--params", "10M", "--steps", "200")),
              smoke=("--params", "1M", "--steps", "60")),
    Benchmark(name="shards", measures="sync step of a 50M model with 1, 2, 3 coordinator shards",
              baseline="one coordinator", minutes="3", runs=((),),
              smoke=("--params", "1M", "--rounds", "1", "--steps", "4", "--shards", "1", "2")),
    Benchmark(name="compression", measures="test accuracy with each --compress, and --colocate",
              baseline="no compression", minutes="1", runs=((),), smoke=("--steps", "5")),
    Benchmark(name="convergence", measures="accuracy against time of the 5 consistency models",
              baseline="sync, with and without a straggler", minutes="4", runs=((),),
              smoke=("--steps", "20")),
    Benchmark(name="pytorch_mnist", measures="PyTorch's MNIST example ported: accuracy, 2 epochs",
              baseline="the original training loop in one process, 3 seeds each", minutes="20",
              runs=((),), smoke=("--epochs", "1", "--limit", "20", "--seeds", "1")),
    Benchmark(name="batchnorm", measures="a CNN with BatchNorm: accuracy, 1 epoch, 4 seeds",
              baseline="the same training in one process", minutes="7", runs=((),),
              smoke=("--limit", "20", "--seeds", "1")),
    Benchmark(name="async_remedy", measures="async and ssp with momentum SGD: each remedy's accuracy",
              baseline="sync on the same data", minutes="10", runs=((),),
              smoke=("--steps", "20", "--rounds", "1")),
    Benchmark(name="plot", measures="sync and async runs drawn by tensorbus plot",
              baseline="sync", minutes="1", runs=((),), smoke=("--steps", "20")),
    Benchmark(name="own_loop", measures="a script's own loop (DistributedOptimizer): sync step",
              baseline="the SPEC route, same model and data, alternating", minutes="5",
              runs=((),), smoke=("--steps", "30", "--skip", "5", "--rounds", "1")),
    Benchmark(name="slow_links", measures="time to target and bytes a step over 100 Mbit/s links",
              baseline="DDP on gloo over the same links", minutes="9", runs=((),),
              smoke=("--seconds", "5", "--methods", "sync", "average-int4:16",
                     "streaming-int4:16")),
    Benchmark(name="standby", measures="a sync step with a standby coordinator following",
              baseline="the same run without one, alternating", minutes="6", runs=((),),
              smoke=("--params", "1M", "--steps", "30", "--skip", "5", "--rounds", "1")),
    Benchmark(name="takeover", measures="accuracy of runs whose coordinator is killed, each strategy",
              baseline="calm runs of the same options, alternating", minutes="12", runs=((),),
              smoke=("--strategies", "sync", "--steps", "60", "--rounds", "1")),
    Benchmark(name="pipeline", measures="a pipeline's step and bubble against (P-1)/(M+P-1)",
              baseline="torch.distributed.pipelining on gloo, same stages and micro-batches",
              minutes="10", runs=((),),
              smoke=("--stages", "2", "--micro-batches", "2", "--steps", "8", "--rounds", "1",
                     "--width", "256")),
    Benchmark(name="gpu", measures="Fashion-MNIST on CUDA workers, sync step, host-device copies",
              baseline="CPU workers; one process and DDP on gloo on the same GPU; pageable memory",
              minutes="4", runs=(),
              smoke=("--device", "cpu", "--quick", "--steps", "20", "--rounds", "1")),
    Benchmark(name="ab", measures="this checkout's training speed against commit REV's",
              baseline="REV, from a git worktree", minutes="1.5 a round", runs=(),
              smoke=("HEAD", "--rounds", "1", "--only", "start")),
    Benchmark(name="single_process", measures="a SPEC trained in one process (prints JSON)",
              baseline="nothing: it is the run that sync on N workers must match", minutes="1", runs=(),
              smoke=("examples/fashion_mnist.py", "--batch-size", "256", "--steps", "5"),
              writes=False),
)}


def listing() -> str:
    """The usage and the benchmarks, for the terminal."""
    usage = "\n\n".join(__doc__.split("\n\n")[1:3])
    lines = [usage, "", "The benchmarks (minutes at their defaults on 2 cores; what; against what):", ""]
    width = max(map(len, BENCHMARKS))
    for b in BENCHMARKS.values():
        lines += [f"  {b.name:{width}}  {b.minutes:>11}  {b.measures}",
                  f"  {'':{width}}  {'':>11}  against {b.baseline}"]
    lines += ["", "Not in `all`: ab (it needs REV), gpu (it needs a CUDA device) and "
              "single_process (it writes no result)."]
    return "\n".join(lines)


def tensorbus_here() -> str:
    """Why this checkout's tensorbus cannot be measured ("": it can)."""
    try:
        import tensorbus
    except ImportError:
        return f"tensorbus is not importable: install this checkout (pip install -e {ROOT})"
    where = Path(tensorbus.__file__).resolve().parent
    if where != ROOT:
        return (f"tensorbus is imported from {where}, not from this checkout ({ROOT}): the "
                f"benchmarks would measure that code. Install this one: pip install -e {ROOT}")
    return ""


def run_one(name: str, argv: Sequence[str]) -> None:
    """Run benchmark `name` in this process with its options `argv`."""
    if problem := tensorbus_here():
        sys.exit(problem)
    module = importlib.import_module(f"benchmarks.{name}")
    meta = Meta.collect(shlex.join(["python", "-m", "benchmarks", name, *argv]))
    module.main(list(argv), meta)


def _child(argv: Sequence[str], timeout_s: float) -> tuple[bool, float]:
    """`python -m benchmarks *argv` in a process of its own, its output passed through:
    whether it succeeded, and its seconds."""
    started = time.monotonic()
    print(f"$ python -m benchmarks {shlex.join(argv)}", flush=True)
    try:
        done = subprocess.run([sys.executable, "-m", "benchmarks", *argv], cwd=ROOT, check=False,
                              timeout=timeout_s)
        ok = done.returncode == 0
    except subprocess.TimeoutExpired:
        print(f"(stopped after {timeout_s:.0f} s)", flush=True)
        ok = False
    return ok, time.monotonic() - started


def _summary(outcomes: list[tuple[str, bool, float]]) -> int:
    print("\n| run | outcome | seconds |\n|---|---|---:|")
    for command, ok, seconds in outcomes:
        print(f"| `{command}` | {'ok' if ok else 'FAILED'} | {seconds:.0f} |")
    return 0 if all(ok for _, ok, _ in outcomes) else 1


def run_all(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks all",
                                     description="every benchmark at its defaults, into benchmarks/results/")
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    parser.add_argument("--skip", nargs="+", default=[], choices=sorted(BENCHMARKS), metavar="NAME")
    args = parser.parse_args(argv)
    plan = [[b.name, *options] for b in BENCHMARKS.values() if b.name not in args.skip
            for options in b.runs]
    if args.dry_run:
        print("\n".join(f"python -m benchmarks {shlex.join(p)}" for p in plan))
        return 0
    outcomes = [(shlex.join(p), *_child(p, RUN_S)) for p in plan]
    return _summary(outcomes)


def smoke(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks smoke",
                                     description="each benchmark at its smallest settings: does it "
                                                 "run end to end and write its results with metadata?")
    parser.add_argument("names", nargs="*", metavar="NAME", help="these only (default: all of them)")
    parser.add_argument("--out", type=Path, help="write here (default: a temporary folder)")
    args = parser.parse_args(argv)
    if unknown := [n for n in args.names if n not in BENCHMARKS]:
        parser.error(f"no benchmark {', '.join(unknown)}: choose from {', '.join(BENCHMARKS)}")
    names = args.names or list(BENCHMARKS)
    with tempfile.TemporaryDirectory(prefix="benchmarks-smoke-") as tmp:
        out = (args.out or Path(tmp)).resolve()
        outcomes = []
        for name in names:
            b = BENCHMARKS[name]
            where = out / name
            command = [name, *b.smoke, *(["--out", str(where)] if b.writes else [])]
            ok, seconds = _child(command, RUN_S / 10)
            if ok and b.writes:
                missing = unstamped(where)
                if missing:
                    print(f"{name}: wrote no result, or results without metadata: {missing}")
                    ok = False
            outcomes.append((shlex.join(command), ok, seconds))
        return _summary(outcomes)


def unstamped(folder: Path) -> list[str]:
    """The result files under `folder` that lack their run's metadata (["(none)"]: no file)."""
    files = sorted(p for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else []
    if not files:
        return ["(none)"]
    lacking = []
    for path in files:
        if path.suffix == ".md":
            found = read_markdown_meta(path.read_text())
        elif path.suffix == ".png":
            found = read_png_meta(path)
        elif path.suffix == ".json":
            found = json.loads(path.read_text()).get("meta", {})
        else:
            found = {}
        if "commit" not in found:
            lacking.append(str(path))
    return lacking


def main(argv: Sequence[str]) -> int:
    if not argv or argv[0] in ("list", "-h", "--help"):
        print(listing())
        return 0
    name, rest = argv[0], argv[1:]
    if name == "all":
        return run_all(rest)
    if name == "smoke":
        return smoke(rest)
    if name not in BENCHMARKS:
        print(f"no benchmark {name!r}\n\n{listing()}", file=sys.stderr)
        return 2
    run_one(name, rest)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
