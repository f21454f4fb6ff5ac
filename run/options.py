"""What a training run is asked to do, and the coordinator built from it.

`local` and `coordinator` take the same options; both build their coordinator here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from nodes.config import CoordinatorConfig
from nodes.coordinator import Coordinator, Progress
from run.spec import Spec
from strategies import Strategy, Sync

STRATEGIES: dict[str, Callable[..., Strategy]] = {"sync": Sync}


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    workers: int
    strategy: str = "sync"
    steps: int | None = None
    epochs: int | None = None  # neither steps nor epochs: one epoch
    batch_size: int = 64
    lr: float = 0.1
    seed: int = 0
    metrics: Path | None = None
    heartbeat_s: float = 0.5
    timeout_s: float = 10.0
    join_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"--workers must be at least 1, got {self.workers}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"--strategy {self.strategy!r}: choose from {sorted(STRATEGIES)}")
        if self.steps is not None and self.epochs is not None:
            raise ValueError("give --steps or --epochs, not both")
        if self.lr <= 0:
            raise ValueError(f"--lr must be positive, got {self.lr}")


def make_coordinator(
    spec: Spec,
    options: RunOptions,
    *,
    bind: str,
    pub_port: int | None = None,
    on_step: Callable[[Progress], None] | None = None,
) -> Coordinator:
    """Seed, build the model from the SPEC, and set up a coordinator for these options."""
    torch.manual_seed(options.seed)
    model = spec.build_model()
    config = CoordinatorConfig(
        bind=bind,
        pub_port=pub_port,
        batch_size=options.batch_size,
        steps=options.steps,
        epochs=None if options.steps is not None else (options.epochs or 1),
        heartbeat_s=options.heartbeat_s,
        timeout_s=options.timeout_s,
        join_timeout_s=options.join_timeout_s,
        metrics=options.metrics,
    )
    strategy = STRATEGIES[options.strategy](workers=options.workers)
    return Coordinator(
        model=model,
        strategy=strategy,
        config=config,
        optimizer=spec.optimizer,
        lr=options.lr,
        evaluate=spec.evaluate,
        on_step=on_step,
    )
