"""The nodes: the Coordinator (parameter server) and the Worker, with their configuration;
for custom topologies, the Relay (hierarchical aggregation) and ShardModel (a sharded
parameter server: one Coordinator per shard)."""

from nodes.config import CoordinatorConfig, WorkerConfig
from nodes.coordinator import Coordinator, Progress, State, TrainingError
from nodes.relay import Relay
from nodes.shards import ShardModel, assemble
from nodes.worker import ComputeError, DataError, Worker, WorkerReport

__all__ = [
    "ComputeError",
    "Coordinator",
    "CoordinatorConfig",
    "DataError",
    "Progress",
    "Relay",
    "ShardModel",
    "State",
    "TrainingError",
    "Worker",
    "WorkerConfig",
    "WorkerReport",
    "assemble",
]
