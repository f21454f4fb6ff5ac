"""Where part (b)'s CPU goes, by library and by function: `perf` samples of colocated shards
and of DDP, side by side (2 workers, batch 64, one torch thread a process).

Both contenders keep this machine's 2 cores busy, so a step's time follows the CPU it costs
(`benchmarks/sync_cpu.py`); this says what that CPU is. Each contender runs in the
background; after a warm-up, `perf record` samples its processes only (every thread) for a
fixed window, and `perf report` splits the samples by shared object (torch's kernels, the
Python interpreter, the OS kernel: loopback TCP copies and page faults, ZeroMQ, gloo...)
and by function. A share becomes CPU ms per step: its samples divided by the sampling
frequency and by the steps the window held (the window over the run's own wall time per
step, measured by the run). The contenders alternate over the rounds; medians.

Needs `perf` (Debian's linux-perf) and leave to sample (root, or
/proc/sys/kernel/perf_event_paranoid at most 1). About 1 minute a round at 1M, 2 at 10M:

    python -m benchmarks cpu_profile [--params 1M] [--seconds 10] [--rounds 2]

Writes benchmarks/results/cpu_profile-PARAMS.md and .json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from benchmarks import checkout
from benchmarks.report import RESULTS, ROOT, Meta, write_json, write_markdown

FREQUENCY = 999  # samples a second per CPU (odd: not in step with timers)
WARMUP_S = {"1M": 8.0, "10M": 15.0}
# Steps that outlast the warm-up, the window and a margin on this kind of machine; a run that
# ends before its window does is an error (raise them).
STEPS = {"1M": 3000, "10M": 400}
_ROW = re.compile(r"^\s*([\d.]+)%\s+(\d+)\s+(.*?)\s*$")


def _commands(params: str, steps: int, metrics: Path, cli: list[str]) -> dict[str, list[str]]:
    """Each contender's command; `cli` starts the checkout's tensorbus (benchmarks.checkout)."""
    tensorbus = [*cli, "local", str(ROOT / "benchmarks" / "mlp.py"),
                 "--workers", "2", "--strategy", "sync", "--colocate", "--steps", str(steps),
                 "--threads", "1", "--no-progress", "--log-level", "error",
                 "--metrics", str(metrics)]
    ddp = [sys.executable, "-c", ("from benchmarks import steps; "
           f"print('step_s', steps.ddp({params!r}, {steps}))")]
    return {"DDP (gloo)": ddp, "tensorbus colocated": tensorbus}


def _descendants(pid: int) -> list[int]:
    """pid and every process below it (from /proc: no third-party package)."""
    found, queue = [], [pid]
    while queue:
        p = queue.pop()
        found.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                queue += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass  # it ended meanwhile
    return sorted(set(found))


def _report(data: Path, key: str) -> list[tuple[str, int]]:
    """(name, samples) by `key` (dso or sym), most first."""
    out = subprocess.run(["perf", "report", "-i", str(data), "--stdio", "--no-children",
                          "--sort", key, "--show-nr-samples", "-q"],
                         capture_output=True, text=True, check=True, timeout=300).stdout
    rows = [(m.group(3), int(m.group(2))) for line in out.splitlines() if (m := _ROW.match(line))]
    return sorted(rows, key=lambda r: -r[1])


def _short(symbol: str) -> str:
    """A readable name for a function: torch's kernel names are long templates."""
    symbol = symbol.removeprefix("[.] ").removeprefix("[k] ").strip()
    kernel = re.search(r"(\w+_kernel)\(at::TensorIterator", symbol)
    if kernel:
        return f"torch {kernel.group(1)}"
    return symbol if len(symbol) <= 60 else symbol[:57] + "..."


def profile(name: str, command: list[str], params: str, seconds: float, tmp: Path,
            env: dict[str, str]) -> dict[str, dict[str, float]]:
    """CPU ms per step of one contender, by dso and by function."""
    env = {**env, "BENCH_PARAMS": params}
    data = tmp / f"{name.split()[0]}.data"
    metrics = Path(command[command.index("--metrics") + 1]) if "--metrics" in command else None
    run = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(WARMUP_S[params])
        if run.poll() is not None:
            raise RuntimeError(f"{name} ended during the warm-up: {run.communicate()[1][-2000:]}")
        pids = ",".join(str(p) for p in _descendants(run.pid))
        subprocess.run(["perf", "record", "-q", "-F", str(FREQUENCY), "-p", pids, "-o",
                        str(data), "--", "sleep", str(seconds)],
                       check=True, capture_output=True, timeout=seconds + 120)
        if run.poll() is not None:
            raise RuntimeError(f"{name} ended before the sampling window did: raise STEPS")
        stdout, stderr = run.communicate(timeout=900)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    if run.returncode != 0:
        raise RuntimeError(f"{name} failed: {stderr[-2000:]}")
    step_s = _step_s(stdout, metrics)
    per_step = 1000.0 / FREQUENCY / (seconds / step_s)  # ms of CPU per sample, per step
    by: dict[str, dict[str, float]] = {"step_ms": {"wall": 1000 * step_s}}
    for key in ("dso", "sym"):
        by[key] = {}
        for label, samples in _report(data, key):
            label = _short(label) if key == "sym" else label
            by[key][label] = by[key].get(label, 0.0) + samples * per_step
    by["step_ms"]["cpu"] = sum(by["dso"].values())
    return by


def _step_s(stdout: str, metrics: Path | None) -> float:
    """The run's own steady seconds per step: DDP prints it; tensorbus's from its metrics
    (the median gap between versions over the last two thirds of the run)."""
    if metrics is None:
        return float(next(line.split()[1] for line in stdout.splitlines()
                          if line.startswith("step_s")))
    at = [r["train_s"] for line in metrics.read_text().splitlines()
          if (r := json.loads(line))["event"] == "step"]
    gaps = [b - a for a, b in itertools.pairwise(at)]
    return statistics.median(gaps[len(gaps) // 3:])


def _table(results: dict[str, list[dict[str, dict[str, float]]]], key: str, top: int) -> list[str]:
    names = list(results)
    medians = {n: {label: statistics.median(r[key].get(label, 0.0) for r in results[n])
                   for label in set().union(*(r[key] for r in results[n]))} for n in names}
    labels = sorted({label for n in names for label in medians[n]},
                    key=lambda label: -max(medians[n].get(label, 0.0) for n in names))[:top]
    lines = [f"| {key} | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for label in labels:
        lines.append(f"| {label} | " + " | ".join(f"{medians[n].get(label, 0.0):.2f}"
                                                  for n in names) + " |")
    return lines


def main(argv: Sequence[str], meta: Meta) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks cpu_profile",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--params", choices=sorted(STEPS), default="1M")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if shutil.which("perf") is None:
        sys.exit("cpu_profile needs perf (Debian: apt-get install linux-perf)")
    started = time.monotonic()
    results: dict[str, list[dict[str, dict[str, float]]]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp, checkout.cli(ROOT) as (cli, env):
        for r in range(args.rounds):
            runs = _commands(args.params, STEPS[args.params], Path(tmp) / f"m{r}.jsonl", cli)
            for name, command in runs.items():
                results[name].append(profile(name, command, args.params, args.seconds, Path(tmp),
                                             env))
                step = results[name][-1]["step_ms"]
                print(f"round {r}: {name}: {step['wall']:.2f} ms a step, {step['cpu']:.2f} ms "
                      "of CPU sampled", flush=True)
    lines = [(f"{args.params} model, 2 workers, batch 64; {args.rounds} rounds of {args.seconds:g} s "
              f"sampled per contender, {time.monotonic() - started:.0f} s; CPU ms per step, medians"), ""]
    lines += _table(results, "step_ms", 2) + [""] + _table(results, "dso", 8) + [""]
    lines += _table(results, "sym", 12)
    write_markdown(args.out / f"cpu_profile-{args.params}.md", "\n".join(lines), meta)
    write_json(args.out / f"cpu_profile-{args.params}.json", results, meta)
    print("\n".join(lines))
