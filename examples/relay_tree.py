"""A relay tree from the Python API: one root, two relays, two workers under each.

Hierarchical aggregation: each relay averages its own workers' gradients and sends one
mean to the root, as BytePS and PyTorch's HierarchicalModelAverager do across machines.
Here every node is a process of this machine talking over loopback TCP (on a cluster, the
relays run next to their workers and only the relays cross the slow link). With sync
everywhere, the tree trains the weights of a flat sync run of the same four workers.

    python examples/relay_tree.py [--relays 2] [--per-relay 2] [--steps 60]

prints the root's summary (with accuracy on scikit-learn's held-out digits).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import digits

from tensorbus.bus.transport import new_event_loop
from tensorbus.nodes import Coordinator, CoordinatorConfig, Relay, Worker, WorkerConfig
from tensorbus.strategies import Sync


def _run(coroutine_factory, *args) -> None:  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(coroutine_factory(*args))


async def _relay(upstream: str, bind: str, workers: int) -> None:
    relay = Relay(model=digits.model(), strategy=Sync(workers=workers), upstream=upstream,
                  config=CoordinatorConfig(bind=bind, steps=1))
    await relay.run()


async def _worker(connect: str) -> None:
    await Worker(model=digits.model(), data=digits.data, loss=digits.loss,
                 config=WorkerConfig(connect=connect)).run()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--relays", type=int, default=2)
    parser.add_argument("--per-relay", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()

    torch.manual_seed(0)
    root = Coordinator(model=digits.model(), strategy=Sync(workers=args.relays), lr=args.lr,
                       evaluate=digits.evaluate,
                       config=CoordinatorConfig(batch_size=32, steps=args.steps))
    upstream = root.bind()
    # Each node a fresh process (not a fork of this one, which holds sockets and threads),
    # forked from a server that imported torch and tensorbus once, not each node again.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "tensorbus"])
    processes = []
    for _ in range(args.relays):
        # Port 0 cannot be told to the workers beforehand: bind a free one by hand.
        bind = f"tcp://127.0.0.1:{_free_port()}"
        processes.append(context.Process(target=_run, args=(_relay, upstream, bind, args.per_relay)))
        processes += [context.Process(target=_run, args=(_worker, bind))
                      for _ in range(args.per_relay)]
    for p in processes:
        p.daemon = True  # never outlive this script
        p.start()
    try:
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            summary = runner.run(root.run())
    finally:
        for p in processes:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    print(json.dumps({k: summary[k] for k in ("strategy", "workers", "steps", "final_loss",
                                              "accuracy", "test_loss")}, indent=1))
    if any(p.exitcode != 0 for p in processes):
        sys.exit(f"a node failed: exit codes {[p.exitcode for p in processes]}")


def _free_port() -> int:
    """A free port whose next one is free too: a relay bound to PORT publishes on PORT+1."""
    import socket

    for _ in range(100):
        with socket.socket() as s, socket.socket() as beside:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
            try:
                beside.bind(("127.0.0.1", port + 1))
            except OSError:
                continue  # taken (or past the last port): another
            return port
    raise OSError("no free port with a free one beside it on 127.0.0.1 in 100 tries")


if __name__ == "__main__":
    main()
