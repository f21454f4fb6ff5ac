"""A sharded parameter server from the Python API: S coordinator shards, N workers.

The model's flat parameters are split by range over S shards (Li et al., OSDI 2014): each
shard is a Coordinator over a ShardModel (its range of the parameters, with its own
optimizer state), and each worker pushes every shard its range and loads every shard's
weights, all at once. With sync, any S trains the weights of one coordinator.

    python examples/sharded_server.py [--shards 3] [--workers 2] [--steps 60]

Here the shards share this process's event loop and the workers are processes; on a
cluster each shard runs on its own machine (`tensorbus coordinator --shard I/S`), so that
no one machine's network carries every worker's whole model. Prints the first shard's
summary with the accuracy of the assembled model.
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
from tensorbus.nodes import (
    Coordinator,
    CoordinatorConfig,
    ShardModel,
    Worker,
    WorkerConfig,
    assemble,
)
from tensorbus.strategies import Sync


def _worker(connect: list[str]) -> None:
    torch.set_num_threads(1)
    worker = Worker(model=digits.model(), data=digits.data, loss=digits.loss,
                    config=WorkerConfig(connect=connect))
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(worker.run())


async def _serve(shards: list[Coordinator]) -> list[dict]:
    return list(await asyncio.gather(*(s.run() for s in shards)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()

    torch.manual_seed(0)
    whole = digits.model()
    shards = [Coordinator(model=ShardModel(whole, i, args.shards), lr=args.lr,
                          strategy=Sync(workers=args.workers),
                          config=CoordinatorConfig(batch_size=32, steps=args.steps))
              for i in range(args.shards)]
    endpoints = [s.bind() for s in shards]  # the workers need them all, in shard order
    # Each node a fresh process (not a fork of this one, which holds sockets and threads),
    # forked from a server that imported torch and tensorbus once, not each node again.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "tensorbus"])
    workers = [context.Process(target=_worker, args=(endpoints,), daemon=True)
               for _ in range(args.workers)]
    for p in workers:
        p.start()
    try:
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            summaries = runner.run(_serve(shards))
    finally:
        for p in workers:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    model = assemble(whole, (s.model for s in shards if isinstance(s.model, ShardModel)))
    first = summaries[0]
    print(json.dumps({"shards": args.shards, "workers": first["workers"], "steps": first["steps"],
                      "final_loss": first["final_loss"], **digits.evaluate(model)}, indent=1))
    if any(p.exitcode != 0 for p in workers):
        sys.exit(f"a worker failed: exit codes {[p.exitcode for p in workers]}")


if __name__ == "__main__":
    main()
