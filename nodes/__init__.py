"""The nodes: the Coordinator (parameter server) and the Worker, with their configuration;
for custom topologies, the Relay (hierarchical aggregation) and ShardModel (a sharded
parameter server: one Coordinator per shard) and Colocated (a worker that serves one
shard of the parameters); for custom training loops, Group (allreduce,
broadcast, allgather, barrier over a rendezvous: see nodes.collectives)."""

from __future__ import annotations

from typing import Any

from tensorbus.bus import lazy

# Imported when first used, not with the package: the command line reads the wire's
# version (bus.protocol) and the configs without importing torch.
_WHERE = {
    "CollectiveMismatchError": "collectives",
    "Colocated": "colocated",
    "ComputeError": "worker",
    "Coordinator": "coordinator",
    "CoordinatorConfig": "config",
    "DataError": "worker",
    "Group": "collectives",
    "GroupFailedError": "collectives",
    "GroupServer": "collectives",
    "Progress": "coordinator",
    "Relay": "relay",
    "RunFailedError": "link",
    "ShardModel": "shards",
    "State": "coordinator",
    "TrainingError": "failures",
    "Worker": "worker",
    "WorkerConfig": "config",
    "WorkerReport": "worker",
    "assemble": "shards",
}

__all__ = [
    "CollectiveMismatchError",
    "Colocated",
    "ComputeError",
    "Coordinator",
    "CoordinatorConfig",
    "DataError",
    "Group",
    "GroupFailedError",
    "GroupServer",
    "Progress",
    "Relay",
    "RunFailedError",
    "ShardModel",
    "State",
    "TrainingError",
    "Worker",
    "WorkerConfig",
    "WorkerReport",
    "assemble",
]


def __getattr__(name: str) -> Any:
    return lazy.attribute(__name__, _WHERE, name)
