"""The GPU path on a real GPU: training on CUDA workers, the sync step against DDP on the
same GPU, and the copies between host and device, with pinned staging on and off.

Three parts, each side by side in one run on one machine:

(a) Fashion-MNIST, one epoch, 2 workers (`tensorbus local examples/fashion_mnist.py
    --workers 2 --epochs 1`), under sync and under average, each on CUDA workers and on
    CPU workers with the same seed: test accuracy, test loss, versions and wall time.
(b) A sync step of the 10M-parameter MLP (benchmarks/mlp.py), batch 64 per worker, every
    process on the one GPU, --rounds times in alternating order: one process; PyTorch DDP
    with 2 processes on gloo (NCCL refuses two ranks on one GPU; gloo reduces CUDA tensors
    through host memory); tensorbus sync with 2 workers (`--device cuda:0`) and a central
    coordinator on the CPU, where the optimizer steps.
(c) What a worker copies each sync step, on the same model's flat buffers (nodes.flat):
    the gradients to the host (device to host, `FlatModel.stage`), into pinned mirrors
    (on) and into pageable ones (off); the received weights to the device (host to
    device, `FlatModel.load`), straight from the frames' pageable memory (1 MiB frames,
    each its own allocation) as the worker does, and through a pinned buffer (a copy on
    the host first). Median of --repeats, after one warm-up.

    python -m benchmarks gpu                          # on a machine with a CUDA device
    python -m benchmarks gpu --device cpu --quick     # a smoke test of (a) and (b) without one

Writes benchmarks/results/gpu.md and gpu.json; the device's name, memory and CUDA version
head the Markdown.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks import checkout, mlp, steps
from benchmarks.report import RESULTS, Meta, write_json, write_markdown
from tensorbus.bus.codec import CHUNK_BYTES
from tensorbus.bus.pieces import Pieces, copy_into
from tensorbus.bus.shared import SharedAllocator
from tensorbus.nodes.flat import FlatModel

SPEC = "examples/fashion_mnist.py"


def device_words(device: str) -> str:
    if device == "cpu":
        return "no GPU: the CPU (a smoke run; the GPU figures need a CUDA device)"
    props = torch.cuda.get_device_properties(device)
    return (f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} "
            f"multiprocessors, CUDA {torch.version.cuda}, torch {torch.__version__}")


def fashion(device: str, strategy: str, length: Sequence[str]) -> dict[str, Any]:
    """Fashion-MNIST on 2 workers for `length` (--epochs 1): the run's summary and its
    wall time."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.jsonl"
        _, wall = checkout.run_tensorbus(["local", SPEC, "--workers", "2", *length,
                                          "--strategy", strategy, "--device", device, "--seed",
                                          "0", "--metrics", str(metrics), "--no-progress"])
        summary = [json.loads(line) for line in metrics.read_text().splitlines()][-1]
    return {"device": device, "strategy": strategy, "accuracy": summary["accuracy"],
            "test_loss": summary["test_loss"], "versions": summary["steps"],
            "train_s": summary["wall_s"], "wall_s": wall}


def step_times(device: str, params: str, count: int, rounds: int) -> list[dict[str, float]]:
    """Seconds per sync step of each contender, a dict per round, in alternating order."""
    contenders: dict[str, Callable[[], float]] = {
        "single": lambda: steps.single(params, count, device=device),
        "ddp": lambda: steps.ddp(params, count, device=device),
        "tensorbus": lambda: steps.tensorbus_sync(params, count, device=device),
        "tensorbus_bytes": lambda: steps.tensorbus_sync(params, count, device=device,
                                                        extra=("--no-shared-memory",)),
    }
    found = []
    for i in range(rounds):
        order = list(contenders) if i % 2 == 0 else list(reversed(contenders))
        row = {name: contenders[name]() for name in order}
        print(f"round {i + 1}: " + ", ".join(f"{n} {row[n] * 1e3:.2f} ms" for n in contenders),
              flush=True)
        found.append(row)
    return found


def _median_s(work: Callable[[], None], repeats: int, device: str) -> float:
    work()  # warm-up: first touches, the allocator
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        work()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _frames(numel: int, dtype: torch.dtype) -> Pieces:
    per = CHUNK_BYTES // torch.empty(0, dtype=dtype).element_size()
    parts = [torch.randn(min(per, numel - at)).to(dtype) for at in range(0, numel, per)]
    return Pieces(parts, (numel,))


def copies(device: str, params: str, repeats: int) -> dict[str, Any]:
    """Seconds of a sync step's copies, each way, the worker's and the alternatives."""
    os.environ["BENCH_PARAMS"] = params
    torch.manual_seed(0)
    shm = SharedAllocator()
    flats = {"pinned": FlatModel(mlp.model(), device),
             "pageable": FlatModel(mlp.model(), device, pinned=False),
             "shared": FlatModel(mlp.model(), device)}
    flats["shared"].share_grads(shm.allocate)  # (page-locked there: FlatModel.share_grads)
    found: dict[str, Any] = {}
    try:
        for name, flat in flats.items():
            for grads in flat.grads:
                grads.normal_()
            found[f"d2h_{name}_s"] = _median_s(lambda f=flat: f.stage(weights=False), repeats, device)
        flat = flats["pinned"]
        # What a received Weights message leaves: each buffer in frames of CHUNK_BYTES,
        # each frame an allocation of its own in ordinary (pageable) memory.
        frames = [_frames(t.numel(), t.dtype) for t in flat.weights]

        def straight() -> None:
            for dst, src in zip(flat.weights, frames, strict=True):
                copy_into(dst, src)  # (a copy from pageable memory a frame)

        found["h2d_staged_s"] = _median_s(lambda: flat.load(frames), repeats, device)
        found["h2d_straight_s"] = _median_s(straight, repeats, device)
        found["bytes"] = sum(t.numel() * t.element_size() for t in flat.grads)
    finally:
        shm.close()
    return found


def _table(rows: Sequence[dict[str, Any]], keys: Sequence[str]) -> list[str]:
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        cells = [f"{r[k]:.4f}" if isinstance(r[k], float) else str(r[k]) for k in keys]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def report(result: dict[str, Any]) -> str:
    """The Markdown of the parts that ran."""
    lines = ["# The GPU path on a real GPU", "", f"Device: {result['device_words']}."]
    if "fashion" in result:
        lines += _fashion_lines(result)
    if "steps" in result:
        lines += _step_lines(result["steps"])
    if "copies" in result:
        lines += _copy_lines(result["copies"], result.get("steps", {}).get("params", ""))
    return "\n".join(lines) + "\n"


def _fashion_lines(result: dict[str, Any]) -> list[str]:
    lines = ["", f"## (a) Fashion-MNIST, {result['length']}, 2 workers, seed 0", "",
             *_table(result["fashion"], ["strategy", "device", "accuracy", "test_loss",
                                         "versions", "train_s", "wall_s"]),
             "", "train_s: the summary's `wall_s` (the run, from its coordinator's start); "
             "wall_s: the whole command, start-up included."]
    by = {(r["strategy"], r["device"]): r for r in result["fashion"]}
    for strategy in ("sync", "average"):
        gpu, cpu = by.get((strategy, result["device"])), by.get((strategy, "cpu"))
        if gpu and cpu and gpu is not cpu:
            lines.append(f"\n{strategy}: GPU − CPU accuracy {100 * (gpu['accuracy'] - cpu['accuracy']):+.2f} "
                         f"points, wall time GPU ÷ CPU {gpu['wall_s'] / cpu['wall_s']:.2f}.")
    return lines


def _step_lines(s: dict[str, Any]) -> list[str]:
    ratio = statistics.median(r["tensorbus"] / r["ddp"] for r in s["rounds"])
    bytes_ratio = statistics.median(r["tensorbus_bytes"] / r["ddp"] for r in s["rounds"])
    lines = ["", f"## (b) Sync step, {s['params']} MLP, batch 64 a worker, every process on {s['device']}",
             "", f"{s['count']} steps a run, the first quarter not timed; median ms a step, "
             f"{len(s['rounds'])} rounds in alternating order.", "",
             "| round | one process | DDP (gloo), 2 ranks | tensorbus sync, 2 workers | "
             "tensorbus ÷ DDP | tensorbus, `--no-shared-memory` | its ÷ DDP |",
             "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(s["rounds"]):
        lines.append(f"| {i + 1} | {r['single'] * 1e3:.2f} | {r['ddp'] * 1e3:.2f} | "
                     f"{r['tensorbus'] * 1e3:.2f} | {r['tensorbus'] / r['ddp']:.3f} | "
                     f"{r['tensorbus_bytes'] * 1e3:.2f} | {r['tensorbus_bytes'] / r['ddp']:.3f} |")
    lines += ["", f"Median tensorbus ÷ DDP: **{ratio:.3f}** (pushes and versions by reference "
              f"through shared memory, the default on one host); **{bytes_ratio:.3f}** with "
              "`--no-shared-memory` (every byte over TCP, as between hosts)."]
    return lines


def _copy_lines(c: dict[str, Any], params: str) -> list[str]:
    def row(name: str, key: str) -> str:
        return f"| {name} | {c[key] * 1e3:.2f} | {c['bytes'] / c[key] / 1e9:.1f} |"

    return ["", f"## (c) A sync step's copies, {c['bytes'] / 1e6:.1f} MB each way ({params} MLP)", "",
            "| copy | ms | GB/s |", "|---|---|---|",
            row("gradients to the host: pinned mirrors (staging on; the worker's, pushes "
                "as bytes)", "d2h_pinned_s"),
            row("gradients to the host: mirrors in shared memory, page-locked (the worker's, "
                "with a coordinator on its host)", "d2h_shared_s"),
            row("gradients to the host: pageable mirrors (staging off)", "d2h_pageable_s"),
            row("weights to the device: frames copied into a pinned buffer, then one copy "
                "(staging on; the worker's)", "h2d_staged_s"),
            row("weights to the device: straight from the frames' pageable memory (staging "
                "off)", "h2d_straight_s")]


def main(argv: Sequence[str], meta: Meta) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks gpu")
    parser.add_argument("--device", default="cuda", help="the GPU: cuda (every worker on GPU "
                        "rank mod GPUs, as `local --device cuda` puts them) or cuda:N; cpu: a smoke run")
    parser.add_argument("--params", default="10M", choices=sorted(mlp.HIDDEN))
    parser.add_argument("--steps", type=int, default=100, help="sync steps a timed run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20, help="timed copies of each kind")
    parser.add_argument("--quick", action="store_true", help="(a) under sync alone, with --steps")
    parser.add_argument("--parts", nargs="+", choices=("a", "b", "c"), default=["b", "c", "a"],
                        help="which parts, in this order")
    parser.add_argument("--commit", default="", help="the commit measured, where the tree "
                        "is not this commit's checkout (a copy on another machine)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.device != "cpu" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch {torch.__version__} sees no CUDA device "
                     "here (--device cpu runs a smoke test)")
    if args.commit:
        meta = dataclasses.replace(meta, commit=args.commit)
    result: dict[str, Any] = {"device": args.device, "device_words": device_words(args.device)}
    print(result["device_words"], flush=True)
    # One GPU for every process of (b) and (c): cuda:N, or cuda:0 for cuda.
    one = "cuda:0" if args.device == "cuda" else args.device
    for part in args.parts:
        if part == "a":
            strategies = ("sync",) if args.quick else ("sync", "average")
            length = ("--steps", str(args.steps)) if args.quick else ("--epochs", "1")
            result["length"], result["fashion"] = " ".join(length), []
            for strategy in strategies:
                for device in dict.fromkeys((args.device, "cpu")):
                    found = fashion(device, strategy, length)
                    print(json.dumps(found), flush=True)
                    result["fashion"].append(found)
        elif part == "b":
            result["steps"] = {"params": args.params, "count": args.steps, "device": one,
                               "rounds": step_times(one, args.params, args.steps, args.rounds)}
        elif one != "cpu":
            result["copies"] = copies(one, args.params, args.repeats)
            print(json.dumps(result["copies"]), flush=True)
        # After each part: a run stopped early keeps what it measured.
        args.out.mkdir(parents=True, exist_ok=True)
        write_markdown(args.out / "gpu.md", report(result), meta)
        write_json(args.out / "gpu.json", result, meta)
    print((args.out / "gpu.md").read_text())
