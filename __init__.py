"""tensorbus: distributed PyTorch training over a ZeroMQ bus.

One import package with four subpackages, in the layers of DESIGN.md: `tensorbus.bus` (the
wire), `tensorbus.strategies` (the consistency models), `tensorbus.nodes` (the coordinator
and the worker) and `tensorbus.run` (the command line and the launchers).

The public names below are imported when first used, not with the package, so that the
`tensorbus` command can answer `--help` or an argument error without importing torch.
"""

from __future__ import annotations

import importlib.metadata
from typing import TYPE_CHECKING, Any

from tensorbus.bus import lazy

try:
    __version__: str = importlib.metadata.version("tensorbus")
except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "unknown"

# Each public name, and the module under tensorbus that defines it.
_WHERE: dict[str, str] = {
    # your own training loop
    "init": "nodes.own_loop",
    "DistributedOptimizer": "nodes.own_loop",
    "Context": "nodes.own_loop",
    # launching
    "launch_local": "run.local",
    "LocalRunError": "run.local",
    "RunOptions": "run.options",
    "Spec": "run.spec",
    "SpecError": "run.spec",
    "load_spec": "run.spec",
    # nodes and their configuration
    "Coordinator": "nodes.coordinator",
    "CoordinatorConfig": "nodes.config",
    "Worker": "nodes.worker",
    "WorkerConfig": "nodes.config",
    "Relay": "nodes.relay",
    "ShardModel": "nodes.shards",
    "Colocated": "nodes.colocated",
    "Group": "nodes.collectives",
    "GroupServer": "nodes.collectives",
    # strategies
    "Strategy": "strategies.base",
    "Sync": "strategies.sync",
    "StaleSync": "strategies.stale",
    "Async": "strategies.stale",
    "PeriodicAveraging": "strategies.average",
    "OuterOptimizer": "strategies.average",
    "STRATEGIES": "strategies",
    # errors
    "TrainingError": "nodes.failures",
    "Diverged": "nodes.failures",
    "TooFewWorkers": "nodes.failures",
    "JoinTimedOut": "nodes.failures",
    "NoVersionMade": "nodes.failures",
    "RunFailedError": "nodes.link",
    "DataError": "nodes.worker",
    "ComputeError": "nodes.worker",
    "CollectiveMismatchError": "nodes.collectives",
    "GroupFailedError": "nodes.collectives",
    "WireError": "bus.errors",
    "PeerTimeoutError": "bus.errors",
    "RejectedError": "bus.errors",
    "HandshakeError": "bus.errors",
}

__all__ = [
    "__version__",
    "Async",
    "CollectiveMismatchError",
    "Colocated",
    "ComputeError",
    "Context",
    "Coordinator",
    "CoordinatorConfig",
    "DataError",
    "DistributedOptimizer",
    "Diverged",
    "Group",
    "GroupFailedError",
    "GroupServer",
    "HandshakeError",
    "JoinTimedOut",
    "LocalRunError",
    "NoVersionMade",
    "OuterOptimizer",
    "PeerTimeoutError",
    "PeriodicAveraging",
    "RejectedError",
    "Relay",
    "RunFailedError",
    "RunOptions",
    "STRATEGIES",
    "ShardModel",
    "Spec",
    "SpecError",
    "StaleSync",
    "Strategy",
    "Sync",
    "TooFewWorkers",
    "TrainingError",
    "WireError",
    "Worker",
    "WorkerConfig",
    "init",
    "launch_local",
    "load_spec",
]

if TYPE_CHECKING:
    from tensorbus.bus.errors import HandshakeError, PeerTimeoutError, RejectedError, WireError
    from tensorbus.nodes.collectives import (
        CollectiveMismatchError,
        Group,
        GroupFailedError,
        GroupServer,
    )
    from tensorbus.nodes.colocated import Colocated
    from tensorbus.nodes.config import CoordinatorConfig, WorkerConfig
    from tensorbus.nodes.coordinator import Coordinator
    from tensorbus.nodes.failures import (
        Diverged,
        JoinTimedOut,
        NoVersionMade,
        TooFewWorkers,
        TrainingError,
    )
    from tensorbus.nodes.link import RunFailedError
    from tensorbus.nodes.own_loop import Context, DistributedOptimizer, init
    from tensorbus.nodes.relay import Relay
    from tensorbus.nodes.shards import ShardModel
    from tensorbus.nodes.worker import ComputeError, DataError, Worker
    from tensorbus.run.local import LocalRunError, launch_local
    from tensorbus.run.options import RunOptions
    from tensorbus.run.spec import Spec, SpecError, load_spec
    from tensorbus.strategies import STRATEGIES
    from tensorbus.strategies.average import OuterOptimizer, PeriodicAveraging
    from tensorbus.strategies.base import Strategy
    from tensorbus.strategies.stale import Async, StaleSync
    from tensorbus.strategies.sync import Sync


def __getattr__(name: str) -> Any:
    return lazy.attribute(__name__, _WHERE, name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})
