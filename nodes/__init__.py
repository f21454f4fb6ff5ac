"""The nodes: the Coordinator (parameter server) and the Worker, with their configuration;
for custom topologies, the Relay (hierarchical aggregation) and ShardModel (a sharded
parameter server: one Coordinator per shard) and Colocated (a worker that serves one
shard of the parameters); for custom training loops, Group (allreduce,
broadcast, allgather, barrier over a rendezvous: see nodes.collectives)."""

from nodes.collectives import (
    CollectiveMismatchError,
    Group,
    GroupFailedError,
    GroupServer,
)
from nodes.colocated import Colocated
from nodes.config import CoordinatorConfig, WorkerConfig
from nodes.coordinator import Coordinator, Progress, State, TrainingError
from nodes.link import RunFailedError
from nodes.relay import Relay
from nodes.shards import ShardModel, assemble
from nodes.worker import ComputeError, DataError, Worker, WorkerReport

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
