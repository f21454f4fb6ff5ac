"""Pipeline stages: the bubble against (P-1)/(M+P-1), and a step beside torch.distributed.pipelining.

One pipeline of P stages (benchmarks/pipeline_mlp.py: P stages of Linear(W, W) and ReLU),
one torch thread a process, batch B cut into M micro-batches, trained two ways alternately
in each round:

- `tensorbus local --workers P --pipeline P --micro-batches M --schedule S`: P stage
  workers and a coordinator a stage (sync, plain SGD); its summary's bubble is measured
  from each stage's seconds in forward and backward against the first stage's span of
  each step (run.pipelines), beside the formula (P-1)/(M+P-1);
- torch.distributed.pipelining on gloo: P ranks, a PipelineStage each, ScheduleGPipe or
  Schedule1F1B with the same M, and each rank's SGD step after the schedule's step.

A step's time is the median of the steps after the first quarter (warm-up), for tensorbus
from its metrics' step records, for torch from rank 0's clock. Every figure is beside the
other's of the same round; the ratio is taken within each round. Defaults (about 15
minutes on 2 cores, most of it processes starting):

    python -m benchmarks pipeline [--stages 2 4] [--micro-batches 4 8] [--schedule 1f1b]
                                  [--width 1024] [--batch-size 64] [--steps 40] [--rounds 3]

On 2 cores, 4 stage processes share 2 cores: what is measured there is how each side
shares them, not the pipeline's overlap. Writes benchmarks/results/pipeline.md and .json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import queue as queue_module
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks import pipeline_mlp
from benchmarks.report import RESULTS, ROOT, Meta, write_json, write_markdown
from benchmarks.throughput import free_port
from tensorbus.nodes.pipeline_order import bubble

SPEC = ROOT / "benchmarks" / "pipeline_mlp.py"


def _steady(times: list[float]) -> float:
    return statistics.median(times[len(times) // 4:])


def _env(stages: int, width: int) -> dict[str, str]:
    return {**os.environ, "BENCH_PIPE_STAGES": str(stages), "BENCH_PIPE_WIDTH": str(width)}


def tensorbus(stages: int, micro: int, schedule: str, width: int, batch: int, steps: int
              ) -> dict[str, Any]:
    """Seconds per step of `tensorbus local --pipeline`, and its bubble as measured."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        command = [sys.executable, "-m", "tensorbus", "local", str(SPEC), "--workers", str(stages),
                   "--pipeline", str(stages), "--micro-batches", str(micro), "--schedule",
                   schedule, "--steps", str(steps), "--batch-size", str(batch), "--lr", "0.01",
                   "--threads", "1", "--metrics", str(metrics), "--no-progress", "--log-level",
                   "error"]
        done = subprocess.run(command, cwd=ROOT, env=_env(stages, width), capture_output=True,
                              text=True, timeout=600, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed: {done.stderr[-2000:]}")
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
    at = [r["train_s"] for r in records if r["event"] == "step"]
    pipeline = records[-1]["pipeline"]
    return {"step_s": _steady([b - a for a, b in itertools.pairwise(at)]),
            "bubble": pipeline["bubble"],
            "busy": [round(s["busy_s"] / s["span_s"], 4) for s in pipeline["per_stage"]]}


def _rank(rank: int, stages: int, port: int, micro: int, schedule: str, width: int, batch: int,
          steps: int, out: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    os.environ.update(BENCH_PIPE_STAGES=str(stages), BENCH_PIPE_WIDTH=str(width),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=stages)
    try:
        torch.manual_seed(0)
        module = pipeline_mlp.stages()[rank]  # (all built, as the SPEC builds them: same init)
        x, y = pipeline_mlp.images()
        example = (x[:batch // micro] if rank == 0
                   else torch.zeros(batch // micro, width))
        stage = PipelineStage(module, rank, stages, torch.device("cpu"), input_args=(example,))
        kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        run = kind(stage, n_microbatches=micro, loss_fn=pipeline_mlp.loss)
        optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
        times: list[float] = []
        last = time.perf_counter()
        for step in range(steps):
            begin = (step * batch) % (len(x) - batch)
            optimizer.zero_grad()
            if rank == 0:
                run.step(x[begin:begin + batch])
            elif rank == stages - 1:
                run.step(target=y[begin:begin + batch])
            else:
                run.step()
            optimizer.step()
            now = time.perf_counter()
            times.append(now - last)
            last = now
        if rank == 0:
            out.put(times)
    finally:
        dist.destroy_process_group()


def torch_pipelining(stages: int, micro: int, schedule: str, width: int, batch: int,
                     steps: int) -> float:
    """Seconds per step of torch.distributed.pipelining on gloo, P ranks."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    processes = [context.Process(target=_rank, args=(r, stages, port, micro, schedule, width,
                                                     batch, steps, queue))
                 for r in range(stages)]
    for p in processes:
        p.start()
    try:
        deadline = time.monotonic() + 600
        while True:  # (a rank that fails ends without a result: said, not waited for)
            try:
                times = queue.get(timeout=1.0)
                break
            except queue_module.Empty:
                if any(p.exitcode not in (None, 0) for p in processes) or time.monotonic() > deadline:
                    raise RuntimeError("torch.distributed.pipelining's ranks ended without a "
                                       f"result (exit codes {[p.exitcode for p in processes]})") from None
    finally:
        for p in processes:
            p.join(60)
            if p.is_alive():
                p.kill()
    return _steady(times)


def main(argv: Sequence[str], meta: Meta) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks pipeline",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    # (torch's Schedule1F1B refuses fewer micro-batches than stages: M from 4.)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    cases = [(p, m) for p in args.stages for m in args.micro_batches]
    figures: dict[str, dict[str, list[Any]]] = {
        f"P={p} M={m}": {"tensorbus_s": [], "torch_s": [], "bubble": [], "busy": []}
        for p, m in cases}
    for r in range(args.rounds):
        for p, m in cases:
            f = figures[f"P={p} M={m}"]
            if args.schedule == "1f1b" and m < p:
                parser.error(f"--micro-batches {m} with --stages {p}: torch.distributed."
                             "pipelining's 1F1B needs at least as many micro-batches as stages")
            ours = tensorbus(p, m, args.schedule, args.width, args.batch_size, args.steps)
            theirs = torch_pipelining(p, m, args.schedule, args.width, args.batch_size, args.steps)
            f["tensorbus_s"].append(ours["step_s"])
            f["torch_s"].append(theirs)
            f["bubble"].append(ours["bubble"])
            f["busy"].append(ours["busy"])
            print(f"round {r + 1}/{args.rounds} P={p} M={m}: tensorbus {1000 * ours['step_s']:.1f} "
                  f"ms a step (bubble {ours['bubble']}), torch.distributed.pipelining "
                  f"{1000 * theirs:.1f} ms", flush=True)
    lines = [
        f"One pipeline of P stages of Linear({args.width}, {args.width}) and ReLU, batch "
        f"{args.batch_size} in M micro-batches, {args.schedule}, {args.steps} steps, "
        f"{args.rounds} round(s); median (min-max) over rounds; samples/s = batch / step.", "",
        "| P | M | tensorbus ms/step | torch.distributed.pipelining ms/step | tensorbus ÷ torch "
        "(within a round) | tensorbus samples/s | torch samples/s | bubble measured | "
        "(P-1)/(M+P-1) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p, m in cases:
        f = figures[f"P={p} M={m}"]
        ours, theirs = f["tensorbus_s"], f["torch_s"]
        ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
        lines.append(
            f"| {p} | {m} | {_spread(ours, 1000)} | {_spread(theirs, 1000)} | "
            f"{_spread(ratios, 1, '.2f')} | {args.batch_size / statistics.median(ours):.0f} | "
            f"{args.batch_size / statistics.median(theirs):.0f} | "
            f"{_spread([b for b in f['bubble'] if b is not None], 1, '.2f')} | "
            f"{bubble(p, m):.2f} |")
    lines += ["", "The bubble measured: 1 - (each stage's seconds in forward and backward, "
              "summed) / (P x the first stage's span of each step, from its first forward's "
              "start to its last backward's end), over the run (tensorbus's summary, "
              "`pipeline.bubble`)."]
    name = "pipeline"
    write_json(args.out / f"{name}.json", {"args": vars(args) | {"out": str(args.out)},
                                           "figures": figures}, meta)
    write_markdown(args.out / f"{name}.md", "\n".join(lines), meta)
    print("\n".join(lines))


def _spread(values: list[float], scale: float, form: str = ".1f") -> str:
    if not values:
        return "-"
    scaled = [v * scale for v in values]
    return (f"{statistics.median(scaled):{form}} ({min(scaled):{form}}-{max(scaled):{form}})"
            if len(scaled) > 1 else f"{scaled[0]:{form}}")
