"""The nodes: the Coordinator (parameter server) and the Worker, with their configuration."""

from nodes.config import CoordinatorConfig, WorkerConfig
from nodes.coordinator import Coordinator, Progress, State, TrainingError
from nodes.worker import ComputeError, DataError, Worker, WorkerReport

__all__ = [
    "ComputeError",
    "Coordinator",
    "CoordinatorConfig",
    "DataError",
    "Progress",
    "State",
    "TrainingError",
    "Worker",
    "WorkerConfig",
    "WorkerReport",
]
