"""Parts (b), (c) and (d) of the speed benchmark: training steps and pushes, and their baselines.

Every contender trains `benchmarks/mlp.py` (BENCH_PARAMS=1M or 10M) with one torch thread
per process, on this machine, in its own processes:

- `single`: one process, batch 64: the work with no communication at all.
- `ddp`: PyTorch DistributedDataParallel on gloo, 2 processes, batch 64 each.
- `tensorbus_sync`: `tensorbus local ... --strategy sync`, batch 64 per worker, with one
  central coordinator or with a coordinator shard in every worker (`--colocate`).
- `tensorbus_async`: `tensorbus local ... --strategy async --batch-size 1`: pushes per second
  when communication, not compute, is what limits.
- `naive_ps`: the one-push-one-reply parameter server (the Ray actor pattern) in raw
  pyzmq: each worker sends its gradient, the server applies it and replies with a copy of
  the weights, the worker loads them and computes again; same model, batch 1, 2 workers.

A step time is the median of the per-step times after the first quarter (warm-up).
"""

from __future__ import annotations

import itertools
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import zmq

from benchmarks import checkout, mlp
from benchmarks.report import ROOT
from benchmarks.throughput import free_port
from tensorbus.nodes.trace import load

SPEC = str(ROOT / "benchmarks" / "mlp.py")
BATCH = 64


def steady_rate(stamps: list[float]) -> float:
    """Events per second over the last three quarters of their time stamps (the first
    quarter is warm-up)."""
    steady = stamps[len(stamps) // 4 :]
    return (len(steady) - 1) / (steady[-1] - steady[0])


def _steady(times: list[float]) -> float:
    return statistics.median(times[len(times) // 4 :])


def _train_steps(model: torch.nn.Module, steps: int, rank: int, world: int,
                 batch: int = BATCH, device: str = "cpu") -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = (t.to(device) for t in mlp.images())
    # On a GPU a step's kernels are only queued when step() returns: wait for them, so that
    # a step's time is its work's.
    done = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    times = []
    for i in range(steps):
        started = time.perf_counter()
        at = ((i * world + rank) * batch) % (len(x) - batch)
        optimizer.zero_grad()
        mlp.loss(model(x[at : at + batch]), y[at : at + batch]).backward()
        optimizer.step()
        done()
        times.append(time.perf_counter() - started)
    return times


def _single(params: str, steps: int, out: Any, batch: int, device: str) -> None:
    os.environ["BENCH_PARAMS"] = params
    torch.set_num_threads(1)
    torch.manual_seed(0)
    out.put(_train_steps(mlp.model().to(device), steps, 0, 1, batch, device))


def single(params: str, steps: int, batch: int = BATCH, device: str = "cpu") -> float:
    """Seconds per step of one process (forward, backward, SGD step), batch 64 unless said,
    on the CPU unless `device` names a GPU."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_single, args=(params, steps, queue, batch, device))
    process.start()
    times = queue.get(timeout=600)
    process.join(60)
    return _steady(times)


def _ddp(rank: int, world: int, port: int, params: str, steps: int, out: Any, device: str) -> None:
    import torch.distributed as dist

    os.environ.update(BENCH_PARAMS=params, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        on_gpu = device != "cpu"
        model = torch.nn.parallel.DistributedDataParallel(
            mlp.model().to(device), device_ids=[torch.device(device).index] if on_gpu else None)
        times = _train_steps(model, steps, rank, world, device=device)
        if rank == 0:
            out.put(times)
    finally:
        dist.destroy_process_group()


def ddp(params: str, steps: int, workers: int = 2, device: str = "cpu") -> float:
    """Seconds per step of DDP on gloo, batch 64 per process; every process on `device`
    (gloo reduces CUDA tensors through host memory: NCCL refuses two ranks on one GPU)."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    processes = [context.Process(target=_ddp, args=(r, workers, port, params, steps, queue, device))
                 for r in range(workers)]
    for p in processes:
        p.start()
    try:
        times = queue.get(timeout=600)
    finally:
        for p in processes:
            p.join(60)
            if p.is_alive():
                p.kill()
    return _steady(times)


def _tensorbus(params: str, workers: int, strategy: str, steps: int, *extra: str,
               tree: Path = ROOT) -> list[dict[str, Any]]:
    """The metrics records of `tensorbus local` run from the checkout `tree` (this one
    unless said: benchmarks/ab.py runs another commit's beside it)."""
    with tempfile.TemporaryDirectory() as tmp, checkout.cli(tree) as (tensorbus, env):
        metrics = Path(tmp) / "metrics.jsonl"
        command = [*tensorbus, "local", str(tree / "benchmarks" / "mlp.py"),
                   "--workers", str(workers), "--strategy", strategy, "--steps", str(steps),
                   "--threads", "1", "--metrics", str(metrics), "--no-progress", "--log-level",
                   "error", *extra]
        done = subprocess.run(command, cwd=tree, env={**env, "BENCH_PARAMS": params},
                              capture_output=True, text=True, timeout=600, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed: {done.stderr[-2000:]}")
        return [json.loads(line) for line in metrics.read_text().splitlines()]


def local_wall_s(params: str, workers: int, *extra: str, tree: Path = ROOT) -> float:
    """Seconds from starting `tensorbus local` (sync, one version, batch 64) to its exit:
    its start-up and its end, as a user waits for them."""
    started = time.perf_counter()
    _tensorbus(params, workers, "sync", 1, *extra, tree=tree)
    return time.perf_counter() - started


def tensorbus_sync(params: str, steps: int, workers: int = 2, compress: str = "",
                   colocate: bool = False, tree: Path = ROOT, device: str = "cpu",
                   extra: tuple[str, ...] = ()) -> float:
    """Seconds per version of `tensorbus local --strategy sync`, batch 64 per worker: with
    one central coordinator, or with `colocate`, a shard in every worker (--colocate);
    the workers compute on `device`; `extra`: more options of local."""
    records = _tensorbus(params, workers, "sync", steps,
                         *(["--compress", compress] if compress else []),
                         *(["--colocate"] if colocate else []),
                         *(["--device", device] if device != "cpu" else []), *extra, tree=tree)
    at = [r["train_s"] for r in records if r["event"] == "step"]
    return _steady([b - a for a, b in itertools.pairwise(at)])


def colocated_trace(params: str, steps: int, tree: Path = ROOT) -> list[dict[str, Any]]:
    """The trace events (nodes.trace) of a colocated sync run, 2 workers, batch 64."""
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        _tensorbus(params, 2, "sync", steps, "--colocate", "--trace", str(trace), tree=tree)
        return load(trace)


def spans_by_version(events: list[dict[str, Any]], track: int, name: str
                     ) -> dict[int, dict[str, Any]]:
    """A track's spans of one name, by the version they name (the last one of each)."""
    return {e["args"]["version"]: e for e in events
            if e.get("ph") == "X" and e.get("pid") == track and e["name"] == name}


def shard_ms(params: str, steps: int, tree: Path = ROOT) -> float:
    """Median ms that shard 0 of a colocated sync run spends making a version and handing it
    to its sockets: its trace's apply span (the step) plus broadcast span (the snapshot and
    the send), per version, the first third of the run left out."""
    events = colocated_trace(params, steps, tree)
    apply, broadcast = (spans_by_version(events, 0, n) for n in ("apply", "broadcast"))
    return statistics.median((apply[v]["dur"] + broadcast[v]["dur"]) / 1000
                             for v in apply if v > steps // 3 and v in broadcast)


def tensorbus_async(params: str, pushes: int, workers: int = 2, compress: str = "",
                    tree: Path = ROOT) -> float:
    """Updates applied per second by `tensorbus local --strategy async`, batch 1."""
    records = _tensorbus(params, workers, "async", pushes, "--batch-size", "1", "--lr", "0.01",
                         *(["--compress", compress] if compress else []), tree=tree)
    return steady_rate([r["train_s"] for r in records if r["event"] == "step"])


def tensorbus_ssp(params: str, pushes: int, staleness: int, workers: int = 2,
                  tree: Path = ROOT) -> float:
    """Updates applied per second by `tensorbus local --strategy ssp`, batch 1."""
    records = _tensorbus(params, workers, "ssp", pushes, "--batch-size", "1", "--lr", "0.01",
                         "--staleness", str(staleness), tree=tree)
    if records[-1]["dropped"]:  # (a held worker that pushed again would be one)
        raise RuntimeError(f"ssp dropped updates: {records[-1]['dropped']}")
    return steady_rate([r["train_s"] for r in records if r["event"] == "step"])


def _naive_server(port: int, params: str, pushes: int) -> None:
    os.environ["BENCH_PARAMS"] = params
    torch.set_num_threads(1)
    torch.manual_seed(0)
    weights = torch.cat([p.detach().reshape(-1) for p in mlp.model().parameters()])
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.bind(f"tcp://127.0.0.1:{port}")
    for _ in range(pushes):
        peer, gradient = router.recv_multipart(copy=False)
        weights.add_(torch.frombuffer(gradient.buffer, dtype=torch.float32), alpha=-0.01)
        router.send_multipart([peer, weights.numpy()], copy=True)  # a copy, as an actor returns
    context.destroy(linger=1000)


def _naive_worker(port: int, params: str, pushes: int, rank: int, out: Any) -> None:
    os.environ["BENCH_PARAMS"] = params
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = mlp.model()
    x, y = mlp.images()
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    out.put("ready")  # connected: the server takes pushes as they come
    times = []
    for i in range(pushes):
        model.zero_grad()
        at = (i * 2 + rank) % len(x)
        mlp.loss(model(x[at : at + 1]), y[at : at + 1]).backward()
        gradient = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        dealer.send(gradient.numpy(), copy=False)
        weights = torch.frombuffer(dealer.recv(copy=False).buffer, dtype=torch.float32)
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(weights, model.parameters())
        times.append(time.perf_counter())
    out.put(times)
    context.destroy(linger=0)


def naive_ps(params: str, pushes: int, workers: int = 2) -> float:
    """Updates applied per second by the one-push-one-reply parameter server."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    server = context.Process(target=_naive_server, args=(port, params, pushes * workers))
    processes = [context.Process(target=_naive_worker, args=(port, params, pushes, r, queue))
                 for r in range(workers)]
    server.start()
    for p in processes:
        p.start()
    try:
        got = [queue.get(timeout=600) for _ in range(2 * workers)]  # "ready", then the times
        stamps = sorted(t for item in got if isinstance(item, list) for t in item)
    finally:
        for p in (*processes, server):
            p.join(60)
            if p.is_alive():
                p.kill()
    return steady_rate(stamps)
