"""Training over slow links: time to a target figure, and bytes on the wire per step, for
DDP, sync, average, streaming average and async-average, with and without int4 changes,
side by side in one run.

The coordinator and each of --workers workers run in a network namespace of their own
(tests/netns.py), every worker's link shaped to --rate-mbit in each direction (tc tbf), as
between machines on a slow network. The model, data and optimizer are --spec's (by default
examples/fashion_mnist.py: a 235k-parameter MLP, Fashion-MNIST, plain SGD with --lr; or
examples/tiny_gpt.py, a language model with AdamW), --batch-size a worker:

- ddp: PyTorch DistributedDataParallel on gloo between the worker namespaces (rank 0's
  address is the rendezvous). Rank 0 evaluates the model every --ddp-eval-every steps,
  while the others wait; that time is not counted as training.
- sync, average:H (H local steps a round), average-int4:H (the same, `--compress int4`),
  diloco:H and diloco-int4:H (average with DiLoCo's outer step: lr 0.7, Nesterov 0.9),
  streaming:H, streaming-int4:H and streaming-diloco-int4:H (the same with `--fragments
  P`, this benchmark's --fragments: one of P fragments averaged every H/P local steps
  while the workers compute on), async-average-int4:H and async-dn-int4:H
  (async-average; the second with delayed Nesterov, lr 0.7 and momentum 0.9, and
  `--dynamic-steps`):
  `tensorbus coordinator` and `tensorbus worker`s, with `--eval-every 1` (a copy of the
  weights each second of training, evaluated once training is over) and
  `--no-shared-memory`: the namespaces share this host's /dev/shm, which machines would not.
- --slow MS makes worker 1 (DDP's rank 1 too) sleep MS milliseconds a local step: a
  straggler, for async-average against average.

Each method trains for --seconds of training time. Reported for each:

- time to target: the training seconds until --metric (one of evaluate()'s figures) first
  reaches --target: at least it for accuracy, at most it for a loss or bits a byte;
- the final figure;
- bytes per worker per step: what each worker's link received and sent (its interface's
  counters, TCP/IP headers included, joining and leaving too), over the training steps a
  worker took (local steps under the averaging methods: the samples trained on over the
  batch and the workers), and DDP's figure divided by it.

Needs root (network namespaces); elsewhere it says why and writes nothing.

    python -m benchmarks slow_links
    python -m benchmarks slow_links --spec examples/tiny_gpt.py --batch-size 16 \
        --metric bits_per_byte --target 3.5 --methods ddp sync diloco:32 diloco-int4:32
    python -m benchmarks slow_links --methods ddp sync average-int4:64 streaming-int4:64 \
        --out /tmp/slow                                                 # streaming against DDP
    python -m benchmarks slow_links --slow 60 --methods average-int4:16 async-average-int4:16 \
        async-dn-int4:16                                                # a straggler
    python -m benchmarks slow_links --seconds 10 --methods sync ddp     # a smoke test
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.report import RESULTS, ROOT, Meta, write_json, write_markdown

sys.path.insert(0, str(ROOT / "tests"))
from netns import (  # noqa: E402 - the namespaces' helper lives with the tests that use it
    COORDINATOR_ADDRESS,
    WORKER_LINK,
    Network,
    Unavailable,
    made_network,
    worker_address,
)

SPEC = ROOT / "examples" / "fashion_mnist.py"
DILOCO = ["--outer-lr", "0.7", "--outer-momentum", "0.9", "--nesterov"]
INT4 = ["--compress", "int4"]
STREAM = ["--fragments", "{fragments}"]  # (the benchmark's --fragments)
# Each averaging method of --methods NAME:H: its strategy and options (H: --average-every).
AVERAGES = {
    "average": ["--strategy", "average"],
    "average-int4": ["--strategy", "average", *INT4],
    "diloco": ["--strategy", "average", *DILOCO],
    "diloco-int4": ["--strategy", "average", *DILOCO, *INT4],
    "streaming": ["--strategy", "average", *STREAM],
    "streaming-int4": ["--strategy", "average", *STREAM, *INT4],
    "streaming-diloco-int4": ["--strategy", "average", *STREAM, *DILOCO, *INT4],
    "async-average-int4": ["--strategy", "async-average", *INT4],
    "async-dn-int4": ["--strategy", "async-average", "--outer-lr", "0.7", "--outer-momentum",
                      "0.9", "--dynamic-steps", *INT4],
}
PORT = 5555  # each namespace is new: any port is free in it
METHODS = ("ddp", "sync", "average:16", "average-int4:16", "average-int4:64", "streaming-int4:64")

DDP = '''
import importlib.util, json, sys, time
import torch
import torch.distributed as dist

rank, world, seconds, every, lr, batch = (int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]),
                                          int(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6]))
slow_s = float(sys.argv[8]) / 1000 if rank == 1 else 0.0  # a straggler's sleep a step
found = importlib.util.spec_from_file_location("spec", sys.argv[7])
spec = importlib.util.module_from_spec(found)
found.loader.exec_module(spec)
torch.set_num_threads(1)
dist.init_process_group("gloo", rank=rank, world_size=world)
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(spec.model())
optimizer = (spec.optimizer(model.parameters()) if hasattr(spec, "optimizer")
             else torch.optim.SGD(model.parameters(), lr=lr))
batches = spec.data(rank, world, batch)
start, paused, steps, stop = time.monotonic(), 0.0, 0, torch.zeros(1)
while not stop.item():
    for x, y in batches:
        optimizer.zero_grad()
        spec.loss(model(x), y).backward()
        optimizer.step()
        if slow_s:
            time.sleep(slow_s)
        steps += 1
        if steps % every == 0:
            held = time.monotonic()
            if rank == 0:
                train_s = held - start - paused
                figures = spec.evaluate(model.module)
                print(json.dumps({"train_s": train_s, "steps": steps, **figures}), flush=True)
                stop.fill_(float(train_s >= seconds))
            dist.broadcast(stop, 0)
            paused += time.monotonic() - held
            if stop.item():
                break
dist.destroy_process_group()
'''


def _counters(net: Network) -> list[int]:
    """Bytes each worker's link has received and sent so far."""
    counted = []
    for namespace in net.workers:
        done = subprocess.run(["ip", "-n", namespace, "-s", "-j", "link", "show", WORKER_LINK],
                              capture_output=True, text=True, timeout=20, check=True)
        stats = json.loads(done.stdout)[0]["stats64"]
        counted.append(stats["rx"]["bytes"] + stats["tx"]["bytes"])
    return counted


def _reap(processes: Sequence[subprocess.Popen[str]]) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.communicate()


def ddp(net: Network, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    script = tmp / "ddp.py"
    script.write_text(DDP)
    environ = {"MASTER_ADDR": worker_address(0), "MASTER_PORT": str(PORT),
               "GLOO_SOCKET_IFNAME": WORKER_LINK, "OMP_NUM_THREADS": "1"}
    env_prefix = ["env", *(f"{k}={v}" for k, v in environ.items())]
    before = _counters(net)
    ranks = [subprocess.Popen([*net.exec(namespace), *env_prefix, sys.executable, str(script),
                               str(rank), str(args.workers), str(args.seconds),
                               str(args.ddp_eval_every), str(args.lr), str(args.batch_size),
                               str(args.spec), str(args.slow)],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank, namespace in enumerate(net.workers)]
    try:
        outputs = [rank.communicate(timeout=args.seconds * 10 + 120) for rank in ranks]
    finally:
        _reap(ranks)
    for rank, (_, err) in zip(ranks, outputs, strict=True):
        if rank.returncode != 0:
            raise RuntimeError(f"a DDP rank failed: {err[-2000:]}")
    after = _counters(net)
    points = [json.loads(line) for line in outputs[0][0].splitlines() if line.startswith("{")]
    steps = points[-1]["steps"]
    return {"points": [(p["train_s"], p[args.metric]) for p in points], "steps": steps,
            "bytes": [(b - a) / steps for a, b in zip(before, after, strict=True)]}


def tensorbus(net: Network, args: argparse.Namespace, tmp: Path, method: str) -> dict[str, Any]:
    name, _, every = method.partition(":")
    options = (["--strategy", "sync"] if name == "sync"
               else [*(o.format(fragments=args.fragments) for o in AVERAGES[name]),
                     "--average-every", every])
    metrics = tmp / f"{method.replace(':', '-')}.jsonl"
    endpoint = f"tcp://{COORDINATOR_ADDRESS}:{PORT}"
    command = [sys.executable, "-m", "tensorbus"]
    before = _counters(net)
    coordinator = subprocess.Popen(
        [*net.exec(net.coordinator), *command, "coordinator", str(args.spec), "--bind", endpoint,
         "--insecure", "--workers", str(args.workers), "--epochs", "100", "--batch-size",
         str(args.batch_size),
         *([] if args.spec_has_optimizer else ["--lr", str(args.lr)]),
         "--metrics", str(metrics), "--eval-every", "1", "--threads", "1",
         "--no-progress", "--json", "--no-shared-memory", *options],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    workers = [subprocess.Popen([*net.exec(namespace), *command, "worker", str(args.spec), "--connect",
                                 endpoint, "--rank", str(rank), "--threads", "1",
                                 "--no-shared-memory",
                                 *([f"--fault=slow:{args.slow:g}"] if rank == 1 and args.slow else [])],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for rank, namespace in enumerate(net.workers)]
    try:
        # Trained for --seconds of training time (the metrics' train_s), then stopped.
        deadline = time.monotonic() + args.seconds * 10 + 120
        trained = _TrainedFor(metrics)
        while trained.seconds() < args.seconds:
            if coordinator.poll() is not None or time.monotonic() > deadline:
                coordinator.kill()
                raise RuntimeError(f"{method}: the coordinator ended or stalled: "
                                   f"{coordinator.communicate(timeout=30)[1][-2000:]}")
            time.sleep(0.2)
        coordinator.send_signal(signal.SIGTERM)
        out, err = coordinator.communicate(timeout=600)  # (it evaluates the copies first)
        for worker in workers:
            worker.communicate(timeout=60)
    finally:
        _reap([coordinator, *workers])
    after = _counters(net)
    summary = json.loads(out)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    points = [(r["train_s"], r[args.metric]) for r in records if r["event"] == "eval"]
    # Local steps a worker: the samples trained on, over the batch and the workers.
    steps = round(summary["samples"] / (args.batch_size * args.workers))
    return {"points": points, "steps": steps, "final": summary.get(args.metric),
            "bytes": [(b - a) / steps for a, b in zip(before, after, strict=True)]}


class _TrainedFor:
    """The training seconds a run's metrics file has reached, read as the file grows: each
    call reads only the lines written since the last, and leaves a line being written for
    the next."""

    def __init__(self, metrics: Path) -> None:
        self._metrics = metrics
        self._offset = 0
        self._seconds = 0.0

    def seconds(self) -> float:
        if not self._metrics.exists():
            return 0.0
        with self._metrics.open("rb") as file:
            file.seek(self._offset)
            *lines, _ = file.read().split(b"\n")  # (the last is incomplete, or empty)
        for line in lines:
            self._offset += len(line) + 1
            record = json.loads(line)
            if record.get("event") == "step":
                self._seconds = max(self._seconds, record["train_s"])
        return self._seconds


def _method(text: str) -> str:
    name, _, every = text.partition(":")
    if text in ("ddp", "sync") or (name in AVERAGES and every.isdigit() and int(every) > 0):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: choose ddp, sync, or one of "
                                     f"{', '.join(AVERAGES)} with :H")


def _check_fragments(methods: Sequence[str], fragments: int) -> None:
    """A streaming method's H must be a multiple of --fragments: said before any run."""
    for method in methods:
        name, _, every = method.partition(":")
        if name.startswith("streaming") and int(every) % fragments:
            sys.exit(f"slow_links: {method}: H must be a multiple of --fragments ({fragments})")


def _has_optimizer(spec: Path) -> bool:
    """Whether the SPEC defines optimizer() (then --lr is refused: its own lr wins)."""
    found = importlib.util.spec_from_file_location("slow_links_spec", spec)
    assert found is not None and found.loader is not None
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    return hasattr(module, "optimizer")


def _higher_is_better(metric: str) -> bool:
    return "loss" not in metric and "bits" not in metric


def _to_target(points: list[tuple[float, float]], target: float, metric: str) -> float | None:
    higher = _higher_is_better(metric)
    return next((t for t, figure in points if (figure >= target if higher else figure <= target)),
                None)


def main(argv: Sequence[str], meta: Meta) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks slow_links")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--seconds", type=float, default=60.0, help="training time, each method")
    parser.add_argument("--spec", type=Path, default=SPEC)
    parser.add_argument("--batch-size", type=int, default=64, help="a worker's")
    parser.add_argument("--metric", default="accuracy", help="one of evaluate()'s figures")
    parser.add_argument("--target", type=float, default=0.80)
    parser.add_argument("--lr", type=float, default=0.1, help="where the SPEC has no optimizer()")
    parser.add_argument("--ddp-eval-every", type=int, default=20, help="steps")
    parser.add_argument("--methods", nargs="+", type=_method, default=list(METHODS),
                        help=f"ddp, sync, or {', '.join(AVERAGES)} with :H")
    parser.add_argument("--fragments", type=int, default=4,
                        help="the streaming methods' P: one fragment every H/P local steps")
    parser.add_argument("--slow", type=float, default=0.0,
                        help="milliseconds worker 1 sleeps a step (a straggler; 0: none)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    _check_fragments(args.methods, args.fragments)
    args.spec_has_optimizer = _has_optimizer(args.spec)  # (then --lr is refused: its lr wins)
    results: dict[str, dict[str, Any]] = {}
    try:
        with made_network(args.workers) as net, tempfile.TemporaryDirectory() as tmp:
            net.shape(args.rate_mbit)
            for method in args.methods:
                run = (ddp(net, args, Path(tmp)) if method == "ddp"
                       else tensorbus(net, args, Path(tmp), method))
                run["to_target_s"] = _to_target(run["points"], args.target, args.metric)
                run["final"] = run.get("final") or (run["points"][-1][1] if run["points"] else None)
                run["bytes_per_step"] = statistics.mean(run["bytes"])
                results[method] = run
                print(f"{method}: {run['steps']} steps, target at {run['to_target_s']} s, final "
                      f"{run['final']}, {run['bytes_per_step'] / 1e3:.1f} kB a worker a step",
                      flush=True)
    except Unavailable as e:
        sys.exit(f"slow_links needs network namespaces: {e}")
    _write(args, results, meta)


def _write(args: argparse.Namespace, results: dict[str, dict[str, Any]], meta: Meta) -> None:
    ddp_bytes = results.get("ddp", {}).get("bytes_per_step")
    ddp_time = results.get("ddp", {}).get("to_target_s")
    spec = Path(args.spec).resolve()
    name = spec.relative_to(ROOT) if spec.is_relative_to(ROOT) else spec
    reached = "at least" if _higher_is_better(args.metric) else "at most"
    lines = ["# Over slow links: time to target and bytes on the wire", "",
             f"{args.workers} workers, each link shaped to {args.rate_mbit:g} Mbit/s each way; "
             f"{name}, batch {args.batch_size} a worker (its optimizer(), else SGD lr "
             f"{args.lr:g}); {args.seconds:g} s of training each; target: {args.metric} "
             f"{reached} {args.target:g}. average:H takes H local steps a round; diloco:H "
             "adds DiLoCo's outer step (lr 0.7, Nesterov momentum 0.9); -int4 pushes each "
             "worker's change as 4-bit integers, and versions come back in float32; "
             f"streaming:H averages one of {args.fragments} fragments every "
             f"H/{args.fragments} local steps, computing on while it travels; "
             "async-average-int4:H applies each worker's change as it comes, and "
             "async-dn-int4:H adds delayed Nesterov (lr 0.7, momentum 0.9) and dynamic "
             "local steps."
             + (f" Worker 1 sleeps {args.slow:g} ms a step." if args.slow else ""), "",
             f"| method | steps a worker | time to target, s | ÷ DDP's | final {args.metric} | "
             "bytes a worker a step | DDP's ÷ this |", "|---|---:|---:|---:|---:|---:|---:|"]
    for method, run in results.items():
        to_target = run["to_target_s"]
        time_cell = f"{to_target:.1f}" if to_target is not None else "not reached"
        ratio = (f"{to_target / ddp_time:.2f}" if to_target is not None and ddp_time else "")
        fewer = f"{ddp_bytes / run['bytes_per_step']:.1f}" if ddp_bytes else ""
        final = "" if run["final"] is None else (
            f"{run['final']:.2%}" if args.metric == "accuracy" else f"{run['final']:.3f}")
        lines.append(f"| {method} | {run['steps']} | {time_cell} | {ratio} | {final} | "
                     f"{run['bytes_per_step'] / 1e3:.1f} kB | {fewer} |")
    stem = "slow_links" if spec == SPEC else f"slow_links-{spec.stem}"
    if args.slow:
        stem += f"-slow{args.slow:g}ms"
    args.out.mkdir(parents=True, exist_ok=True)
    write_markdown(args.out / f"{stem}.md", "\n".join(lines) + "\n", meta)
    write_json(args.out / f"{stem}.json", {"args": {k: str(v) for k, v in vars(args).items()},
                                           "results": results}, meta)
