"""The nodes: the Coordinator (parameter server) and the Worker, with their configuration;
for custom topologies, the Relay (hierarchical aggregation) and ShardModel (a sharded
parameter server: one Coordinator per shard) and Colocated (a worker that serves one
shard of the parameters); for custom training loops, Group (allreduce,
broadcast, allgather, barrier over a rendezvous: see nodes.collectives)."""

from tensorbus.nodes.collectives import (
    CollectiveMismatchError,
    Group,
    GroupFailedError,
    GroupServer,
)
from tensorbus.nodes.colocated import Colocated
from tensorbus.nodes.config import CoordinatorConfig, WorkerConfig
from tensorbus.nodes.coordinator import Coordinator, Progress, State, TrainingError
from tensorbus.nodes.link import RunFailedError
from tensorbus.nodes.relay import Relay
from tensorbus.nodes.shards import ShardModel, assemble
from tensorbus.nodes.worker import ComputeError, DataError, Worker, WorkerReport

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
