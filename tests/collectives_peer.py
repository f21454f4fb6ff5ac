"""One rank of tests/integration/test_collectives.py's comparison with torch.distributed on gloo.

    python tests/collectives_peer.py RANK SIZE TENSORBUS_PORT GLOO_PORT OUT_DIR

runs the same collectives on the same inputs (seeded by rank) over a tensorbus Group and
over a gloo process group, and saves both results to OUT_DIR/rank{RANK}.pt for the test
to compare. Rank 0 hosts the rendezvous.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tensorbus.nodes import Group

SHAPES = [(10,), (3, 5), (700, 500)]  # the last one is larger than a 1 MiB frame
DTYPES = [torch.float32, torch.float64, torch.int64]


def inputs(rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + rank)
    tensors = []
    for dtype in DTYPES:
        for shape in SHAPES:
            if dtype.is_floating_point:
                tensors.append(torch.randn(shape, generator=generator, dtype=dtype))
            else:
                tensors.append(torch.randint(-1000, 1000, shape, generator=generator, dtype=dtype))
    return tensors


def run(ops: object, rank: int, size: int) -> dict[str, list[torch.Tensor]]:
    """Every collective of the comparison, through `ops` (a Group or the Gloo adapter)."""
    out: dict[str, list[torch.Tensor]] = {"sum": [], "mean": [], "max": [], "broadcast": [],
                                          "allgather": []}
    for tensor in inputs(rank):
        out["sum"].append(ops.allreduce(tensor.clone(), op="sum"))  # type: ignore[attr-defined]
        if tensor.is_floating_point():
            out["mean"].append(ops.allreduce(tensor.clone(), op="mean"))  # type: ignore[attr-defined]
        out["max"].append(ops.allreduce(tensor.clone(), op="max"))  # type: ignore[attr-defined]
        for src in range(size):
            out["broadcast"].append(ops.broadcast(tensor.clone(), src=src))  # type: ignore[attr-defined]
        out["allgather"].extend(ops.allgather(tensor))  # type: ignore[attr-defined]
    ops.barrier()  # type: ignore[attr-defined]
    return out


class Gloo:
    """torch.distributed's calls behind the Group's signatures."""

    def allreduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        if op == "mean":  # gloo has no average: the sum divided, as Group does
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
            return tensor.div_(dist.get_world_size())
        dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        dist.broadcast(tensor, src=src)
        return tensor

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(out, tensor)
        return out

    def barrier(self) -> None:
        dist.barrier()


def main() -> None:
    rank, size, port, gloo_port = (int(a) for a in sys.argv[1:5])
    torch.set_num_threads(1)
    with Group.join(f"tcp://127.0.0.1:{port}", rank=rank, size=size, timeout=30,
                    join_timeout=30) as group:
        ours = run(group, rank, size)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=rank,
                            world_size=size, timeout=timedelta(seconds=30))
    try:
        theirs = run(Gloo(), rank, size)
    finally:
        dist.destroy_process_group()
    torch.save({"tensorbus": ours, "gloo": theirs}, Path(sys.argv[5]) / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
