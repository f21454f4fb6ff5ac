"""A custom training loop that averages its own gradients: tensorbus collectives.

No coordinator, no SPEC: every rank runs this plain PyTorch loop on its shard of
scikit-learn's digits (examples/digits.py: a small MLP, SGD), and the group keeps the ranks
in step the torch.distributed way:

- `broadcast` rank 0's initial weights (each rank seeds its model differently on purpose),
- `allreduce(..., op="mean")` a flat gradient buffer every step, before `optimizer.step()`,
- `barrier` at the end, then `allgather` the weights to show they are identical.

With the data order of `run.shards.Shards` this trains what one process would with a batch
of world_size x batch_size.

    python examples/custom_loop.py --world-size 2            # spawns the ranks on loopback
    python examples/custom_loop.py --world-size 2 --rank 1 --connect tcp://HOST:29500
                                                             # one rank; rank 0 hosts

Each rank prints its test accuracy and a digest of its final weights.
"""

from __future__ import annotations

import argparse
import hashlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def batches(rank: int, world_size: int, batch_size: int) -> Iterator[Any]:
    import digits

    shards = digits.data(rank, world_size, batch_size)
    while True:
        yield from shards  # each pass is the next epoch's order


def train(args: argparse.Namespace) -> None:
    # Imported here, by the ranks only: the launcher that spawns them stays light.
    import digits
    import torch
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    from tensorbus.nodes import Group

    rank, world_size = args.rank, args.world_size
    torch.set_num_threads(1)
    torch.manual_seed(rank)  # different initial weights: the broadcast makes them one
    model = digits.model()
    params = list(model.parameters())
    with Group.join(args.connect, rank=rank, size=world_size) as group:
        weights = parameters_to_vector(params).detach()
        group.broadcast(weights, src=0)
        vector_to_parameters(weights, params)

        optimizer = torch.optim.SGD(params, lr=args.lr)
        grads = torch.zeros(weights.numel())  # one flat gradient buffer, reused every step
        data = batches(rank, world_size, args.batch_size)
        loss = torch.zeros(())
        for _ in range(args.steps):
            inputs, targets = next(data)
            optimizer.zero_grad()
            loss = digits.loss(model(inputs), targets)
            loss.backward()
            torch.cat([p.grad.reshape(-1) for p in params], out=grads)
            group.allreduce(grads, op="mean")  # in place: the mean of every rank's gradient
            offset = 0
            for p in params:
                p.grad.copy_(grads[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
            optimizer.step()
        mean_loss = group.allreduce(loss.detach().clone(), op="mean").item()

        group.barrier()
        final = parameters_to_vector(params).detach()
        same = all(torch.equal(other, final) for other in group.allgather(final))
        metrics = digits.evaluate(model)
        digest = hashlib.sha256(final.numpy().tobytes()).hexdigest()[:16]
        print(f"rank {rank}/{world_size}: steps {args.steps}, last loss {mean_loss:.4f}, "
              f"accuracy {metrics['accuracy']:.4f}, weights {digest}, "
              f"identical on all ranks: {same}", flush=True)


def spawn(args: argparse.Namespace) -> int:
    """Start the ranks as processes on loopback, wait for them, and reap them whatever happens."""
    with socket.socket() as probe:  # a free port, for the rendezvous rank 0 hosts
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    common = ["--world-size", str(args.world_size), "--connect", f"tcp://127.0.0.1:{port}",
              "--steps", str(args.steps), "--lr", str(args.lr), "--batch-size",
              str(args.batch_size)]
    ranks = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), *common],
                              stdout=subprocess.PIPE, text=True)
             for r in range(args.world_size)]
    deadline = time.monotonic() + args.timeout
    try:
        for rank in ranks:  # their reports, in rank order
            report = rank.communicate(timeout=max(deadline - time.monotonic(), 0.1))[0]
            print(report, end="", flush=True)
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()
    failed = [r for r, rank in enumerate(ranks) if rank.returncode != 0]
    if failed:
        print(f"ranks {failed} failed", file=sys.stderr)
    return 1 if failed else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rank", type=int, help="run this one rank (default: spawn them all)")
    parser.add_argument("--connect", default="", help="tcp://HOST:PORT of the rendezvous")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--timeout", type=float, default=600.0, help="for the whole run, spawning")
    args = parser.parse_args()
    if args.rank is None:
        sys.exit(spawn(args))
    if not args.connect:
        parser.error("--rank needs --connect tcp://HOST:PORT (rank 0 binds it)")
    train(args)


if __name__ == "__main__":
    main()
