"""What part (c)'s goal asks of this machine: a bare async parameter server, against the naive one.

Goal 3 of issue 5 wants tensorbus async (batch 1, 2 workers, the 1M model) at 4x the
updates per second of the naive one-push-one-reply server (benchmarks/steps.py naive_ps).
This measures how near the least an async server can do comes to that, with none of a
real system's duties (no membership, heartbeats, strategies, metrics, checks of what
peers send, no event loop, no compute thread):

- the master weights lie in shared memory as a ring of RING sets; each step writes the
  next version into the next set (w' = w - lr * g, one pass, as tensorbus's plain SGD
  does), after the same finiteness check (the gradient's sum);
- each worker's gradients lie in shared memory (two sets), where each is copied once
  backward has made it (as tensorbus's hooks do: cheaper than zeroing and accumulating);
  a push is a 2-byte ZeroMQ message naming nothing but "mine is ready", answered with the
  number of the version its step made (so the worker may write it again), or with 0 once
  the run has made its updates (stop);
- the worker copies the set of the version its last answer named into its model,
  computes a gradient, pushes, waits for the answer: blocking pyzmq, no thread, no
  asyncio. Pipelined, it computes the next gradient (into its other set) before it takes
  the answer; in place (pipelined too), it computes on that set where it lies, without
  copying it.

A set is overwritten RING versions after it was made; a copy made meanwhile is thrown away
and made again from the newest set, and a compute in place on an overwritten set is
counted (printed at the end) but pushed all the same. Not a design for real use: a
measurement of one lean design, against which tensorbus's overhead shows.

The five contenders (the naive server, the bare one in its three ways, tensorbus async)
run interleaved, ROUNDS times; each ratio is taken within its round. Each contender runs
twice, with U and with 2U updates: its rate is the second run's, over the last three
quarters of its updates (as benchmarks/steps.py takes it), and the CPU one update costs,
all processes together, is differenced over the two runs, so that start-up cancels out
(benchmarks/async_cpu.py's `measure`); that CPU bounds the rate at cores / CPU per update:

    python -m benchmarks async_floor [--updates 3000] [--rounds 3]     # about 12 minutes

Writes benchmarks/results/async_floor.md and .json.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import struct
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from queue import Empty
from typing import Any

import torch
import zmq

from benchmarks import mlp, steps
from benchmarks.async_cpu import measure, spread
from benchmarks.report import RESULTS, Meta, write_json, write_markdown
from benchmarks.throughput import free_port

# Weight sets: a version is overwritten RING versions after it was made. 16 (64 MB) was
# the faster in place of the two sizes tried (4 and 16): with 4, steps write sets that the
# workers still compute on.
RING = 16
LR = 0.01
WAIT_MS = 60_000  # the longest a node waits for a message before it fails


def _shared(path: str, count: int, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`count` sets of `numel` elements, backed by the file at `path` (in /dev/shm)."""
    return torch.from_file(path, shared=True, size=count * numel, dtype=dtype).view(count, numel)


def _server(port: int, folder: str, workers: int, updates: int, out: Any) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    flat = torch.cat([p.detach().reshape(-1) for p in mlp.model().parameters()])
    numel = flat.numel()
    ring = _shared(f"{folder}/weights", RING, numel)
    ring[0].copy_(flat)
    # Which version each set holds, -1 while written: a worker's copy is checked against it.
    marks = _shared(f"{folder}/marks", 1, RING, torch.int64)[0]
    marks.fill_(-1)
    marks[0] = 0
    grads = [_shared(f"{folder}/grads-{r}", 2, numel) for r in range(workers)]
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.RCVTIMEO, WAIT_MS)  # a worker gone: zmq.Again, not a hang
    router.bind(f"tcp://127.0.0.1:{port}")
    out.put("ready")
    version, stamps = 0, []
    while version < updates:
        peer, pushed = router.recv_multipart()
        rank, slot = struct.unpack("<HH", pushed)
        g = grads[rank][slot]
        if not torch.isfinite(g.sum()):
            raise RuntimeError("not finite")
        into = (version + 1) % RING
        marks[into] = -1
        torch.add(ring[version % RING], g, alpha=-LR, out=ring[into])
        version += 1
        marks[into] = version
        stamps.append(time.perf_counter())
        router.send_multipart([peer, struct.pack("<Q", version)])
    # Every worker waits for an answer: tell each to stop (version 0 means stop).
    for _ in range(workers):
        peer, _rank = router.recv_multipart()
        router.send_multipart([peer, struct.pack("<Q", 0)])
    out.put(stamps)
    context.destroy(linger=1000)


def _worker(port: int, folder: str, rank: int, pipelined: bool, in_place: bool) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = mlp.model()
    x, y = mlp.images()
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    ring = _shared(f"{folder}/weights", RING, numel)
    grads = _shared(f"{folder}/grads-{rank}", 2, numel)
    marks = _shared(f"{folder}/marks", 1, RING, torch.int64)[0]
    flat = torch.empty(numel)
    torn = 0

    def load(version: int) -> int:
        """Copy the newest set in (trying again where a step overwrote it meanwhile)."""
        nonlocal torn
        while True:
            slot = version % RING
            if int(marks[slot]) == version:
                flat.copy_(ring[slot])
                if int(marks[slot]) == version:
                    return version
            torn += 1
            version = max(int(m) for m in marks)
    starts = [sum(p.numel() for p in params[:k]) for k in range(len(params))]
    for p, at in zip(params, starts, strict=True):  # the model's weights: views of one buffer
        p.data = flat[at : at + p.numel()].view_as(p)
    # In place: the model computes on the newest set itself, without copying it (a set
    # that a step overwrites meanwhile, RING - 1 versions on, is counted as torn).
    in_ring = [[ring[slot][at : at + p.numel()].view_as(p) for p, at in zip(params, starts, strict=True)]
               for slot in range(RING)]
    bound = 0  # the version the model computes on, in place

    def bind(version: int) -> None:
        nonlocal bound
        for p, view in zip(params, in_ring[version % RING], strict=True):
            p.data = view
        bound = version

    def check() -> None:
        nonlocal torn
        if int(marks[bound % RING]) != bound:
            torn += 1

    views = [[grads[slot][at : at + p.numel()].view_as(p) for p, at in zip(params, starts, strict=True)]
             for slot in range(2)]

    def compute(i: int, slot: int) -> None:
        for p in params:
            p.grad = None  # backward makes each afresh: then one copy into the set
        at = (i * 2 + rank) % len(x)
        mlp.loss(model(x[at : at + 1]), y[at : at + 1]).backward()
        with torch.no_grad():
            for p, view in zip(params, views[slot], strict=True):
                view.copy_(p.grad)

    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, WAIT_MS)  # the server gone: zmq.Again, not a hang
    dealer.connect(f"tcp://127.0.0.1:{port}")
    version, i, slot = 0, 0, 0
    if pipelined:
        # The next gradient is computed (into the other set) while the last push is on
        # its way and stepped; then the answer is taken, the push sent, the newest loaded.
        if in_place:
            bind(0)
        compute(0, slot)
        dealer.send(struct.pack("<HH", rank, slot))
        while True:
            i, slot = i + 1, slot ^ 1
            compute(i, slot)
            if in_place:
                check()
            version = struct.unpack("<Q", dealer.recv())[0]
            if version == 0:
                break
            dealer.send(struct.pack("<HH", rank, slot))
            if in_place:
                bind(version)
            else:
                load(version)
    else:
        while True:
            load(version)
            compute(i, 0)
            dealer.send(struct.pack("<HH", rank, 0))
            version = struct.unpack("<Q", dealer.recv())[0]
            i += 1
            if version == 0:
                break
    if torn:
        what = "computes on a set overwritten meanwhile" if in_place else "copies torn, taken again"
        print(f"worker {rank}: {torn} {what}", file=sys.stderr)
    context.destroy(linger=0)


def bare_async(updates: int, workers: int = 2, pipelined: bool = False,
               in_place: bool = False) -> float:
    """Updates per second of the bare async server, 2 workers, batch 1; `pipelined`: each
    worker computes its next gradient while its last push is answered; `in_place` (with
    `pipelined`): on the newest set where it lies, not on a copy."""
    if in_place and not pipelined:
        raise ValueError("in_place is a way of the pipelined worker: pass pipelined=True too")
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    with tempfile.TemporaryDirectory(dir="/dev/shm") as folder:
        server = context.Process(target=_server, args=(port, folder, workers, updates, queue))
        server.start()
        processes = []
        try:
            if _get(queue, [server], 120) != "ready":
                raise RuntimeError("the server did not start")
            processes = [context.Process(target=_worker, args=(port, folder, r, pipelined, in_place))
                         for r in range(workers)]
            for p in processes:
                p.start()
            stamps = _get(queue, [server, *processes], 600)
        finally:
            for p in (*processes, server):
                p.join(60)
                if p.is_alive():
                    p.kill()
                    p.join()
    return steps.steady_rate(stamps)


def _get(queue: Any, processes: list[Any], timeout_s: float) -> Any:
    """The next item on `queue`; RuntimeError at once if one of `processes` failed (a
    server or worker that raised would leave the others waiting), or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return queue.get(timeout=0.5)
        except Empty:
            failed = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
            if failed:
                raise RuntimeError(f"a process of the bare server failed (exit codes {failed})") from None
    raise RuntimeError(f"the bare server gave nothing in {timeout_s:.0f} s")


def main(argv: Sequence[str], meta: Meta) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks async_floor",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    os.environ["BENCH_PARAMS"] = "1M"
    contenders = {
        "naive PS": lambda u: steps.naive_ps("1M", u // 2),
        "bare async (shared memory)": lambda u: bare_async(u),
        "bare async, pipelined": lambda u: bare_async(u, pipelined=True),
        "bare async, pipelined, in place": lambda u: bare_async(u, pipelined=True, in_place=True),
        "tensorbus async": lambda u: steps.tensorbus_async("1M", u),
    }
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name in contenders}
    for r in range(args.rounds):
        for name, run in contenders.items():
            cpu, rate = measure(run, args.updates)
            figures[name].append((cpu, rate))
            print(f"round {r + 1}: {name}: {rate:.0f} updates/s, {cpu:.2f} CPU ms an update",
                  flush=True)
    naive = [rate for _, rate in figures["naive PS"]]

    lines = [(f"1M model, batch 1, 2 workers, {len(os.sched_getaffinity(0))} cores, {args.updates} and "
              f"{2 * args.updates} updates, {args.rounds} rounds; median (min-max) over the rounds; "
              "each ratio taken within its round"), "",
             "| contender | updates/s | ÷ naive PS | CPU ms per update, all processes |",
             "|---|---:|---:|---:|"]
    for name, got in figures.items():
        rates = [rate for _, rate in got]
        ratios = [rate / n for rate, n in zip(rates, naive, strict=True)]
        lines.append(f"| {name} | {spread(rates, '.0f')} | {spread(ratios, '.2f')} | "
                     f"{spread([c for c, _ in got], '.2f')} |")
    write_markdown(args.out / "async_floor.md", "\n".join(lines), meta)
    write_json(args.out / "async_floor.json",
               {"args": {"updates": args.updates, "rounds": args.rounds}, "figures": figures}, meta)
    print("\n".join(lines))
