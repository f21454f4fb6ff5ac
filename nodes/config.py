"""Frozen configuration of the nodes. Built by `run/` from argv, or by hand from Python.

`run/` fills a CoordinatorConfig by field name: each field that a run option sets has that
option's name in run.options.RunOptions (and its flag's dest in run.flags); the others are
each node's own (run.options.NODE_SETTINGS)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tensorbus.bus.layout import Compression
from tensorbus.bus.security import ClientKeys, ServerKeys
from tensorbus.nodes.faults import Faults
from tensorbus.nodes.precision import Precision


@dataclass(frozen=True, kw_only=True)
class CoordinatorConfig:
    bind: str = "tcp://127.0.0.1:0"  # port 0: a random free port
    pub_port: int | None = None  # default: bind port + 1, or random with a random bind port
    batch_size: int = 64  # per worker
    steps: int | None = None  # versions to apply; or
    epochs: int | None = None  # passes over the smallest shard (sync: one batch per version)
    heartbeat_s: float = 0.5
    timeout_s: float = 10.0  # a worker silent this long is removed
    join_timeout_s: float = 300.0  # how long to wait for the first workers
    stop_timeout_s: float = 5.0  # how long to wait for workers to leave at the end
    metrics: Path | None = None
    # Copy the weights every this many seconds of training, and evaluate the copies after
    # training (an accuracy-against-time curve that does not slow the run); None: no copies.
    eval_every_s: float | None = None
    eval_every_epochs: int | None = None  # or every this many passes over the shards
    # Below this many live workers the run stops with an error instead of training on.
    min_workers: int = 1
    # Ranks 0..max_workers-1 exist (and data is sharded max_workers ways): workers beyond
    # the strategy's starting count may join during training. None: the starting count.
    max_workers: int | None = None
    checkpoint_dir: Path | None = None  # where to write checkpoints (None: never)
    checkpoint_every: int | None = None  # versions between checkpoints (None: only at the end)
    resume: bool = False  # start from the newest checkpoint in checkpoint_dir, if any
    keys: ServerKeys | None = None  # CURVE: encrypt, and admit only the authorized workers
    trace: Path | None = None  # write a Chrome trace-event timeline of the run here
    # Workers push float gradients as bf16 or fp16 (half the bytes), or "topk:R" (the
    # largest R of each range, with error feedback), and under average their weights as
    # "int8" or "int4" differences (bus.layout.Compression); the coordinator keeps fp32
    # master weights and broadcasts them as they are. "": as they are.
    compress: str = ""
    # Under a relay (nodes.relay): this coordinator's ranks start at first_rank, and its
    # workers are told there are world_size data shards (the whole tree's workers).
    first_rank: int = 0
    world_size: int | None = None
    # Take the tensors of workers on this host by reference, from their shared memory,
    # rather than as bytes over the socket (bus.shared); a worker elsewhere sends bytes.
    shared_memory: bool = True
    # Each worker seeds torch's, numpy's and random's generators from (seed, its rank) as
    # it starts training: its dropout and shuffles are the same from run to run.
    seed: int = 0
    # Scale each step's gradient to at most this 2-norm: the averaged gradient here, or a
    # worker's local one under `average` (told in its Welcome). None: no clipping.
    clip_grad_norm: float | None = None
    # The workers' forward in autocast: "", "bf16-mixed" or "fp16-mixed" (nodes.precision).
    precision: str = ""
    # The run ends once every worker has left having ended well (scripts that bring their
    # own loop: nodes.own_loop), not at a number of steps or epochs, which may not be given.
    until_workers_leave: bool = False
    # A coordinator of one pipeline stage (nodes.stage_worker): it serves stage `stage`
    # (from 0) of `pipeline`, its workers one a pipeline, each cutting a batch into
    # `micro_batches` and running them in the order `schedule` says (nodes.pipeline_order).
    pipeline: int = 1
    stage: int = 0
    micro_batches: int = 1
    schedule: str = "1f1b"

    def __post_init__(self) -> None:
        if self.pipeline < 1 or not 0 <= self.stage < self.pipeline:
            raise ValueError(f"stage {self.stage} of pipeline {self.pipeline}: need "
                             "0 <= stage < pipeline")
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches must be at least 1, got {self.micro_batches}")
        if self.schedule not in ("1f1b", "gpipe"):
            raise ValueError(f"schedule {self.schedule!r}: choose from 1f1b, gpipe")
        if self.first_rank < 0:
            raise ValueError(f"first_rank must be at least 0, got {self.first_rank}")
        if self.world_size is not None and self.world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {self.world_size}")
        Compression.parse(self.compress)  # ValueError naming the choices
        if self.max_workers is not None and self.max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, got {self.max_workers}")
        if self.min_workers < 1:
            raise ValueError(f"min_workers must be at least 1, got {self.min_workers}")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be at least 1, got {self.checkpoint_every}")
        if (self.resume or self.checkpoint_every is not None) and self.checkpoint_dir is None:
            raise ValueError("resume and checkpoint_every need a checkpoint_dir")
        if self.eval_every_s is not None and not self.eval_every_s > 0:
            raise ValueError(f"eval_every_s must be positive, got {self.eval_every_s}")
        if self.eval_every_epochs is not None and self.eval_every_epochs < 1:
            raise ValueError(f"eval_every_epochs must be at least 1, got {self.eval_every_epochs}")
        if self.eval_every_s is not None and self.eval_every_epochs is not None:
            raise ValueError("give eval_every_s or eval_every_epochs, not both")
        if self.steps is not None and self.epochs is not None:
            raise ValueError("give steps or epochs, not both")
        if self.steps is None and self.epochs is None and not self.until_workers_leave:
            raise ValueError("give steps or epochs (or until_workers_leave)")
        for name in ("steps", "epochs"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.clip_grad_norm is not None and not 0 < self.clip_grad_norm < math.inf:
            raise ValueError(f"clip_grad_norm must be positive, got {self.clip_grad_norm}")
        Precision.parse(self.precision)
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {self.batch_size}")
        if not 0 < self.heartbeat_s < self.timeout_s:
            raise ValueError(
                f"need 0 < heartbeat_s < timeout_s, got {self.heartbeat_s} and {self.timeout_s}"
            )


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    # The coordinator's tcp://HOST:PORT; or, for a sharded parameter server, every shard's,
    # in shard order (a sequence, or one string with the endpoints separated by commas).
    connect: str | Sequence[str]
    rank: int = -1  # -1: any free rank
    device: str = "cpu"  # or "cuda:N" (run/ resolves auto and cuda)
    join_timeout_s: float = 300.0  # how long to keep trying to join
    request_timeout_s: float = 10.0  # per request (join, push, pull, leave)
    # After losing the coordinator (or being removed), keep trying to join again this long,
    # counted from when it was last heard: long enough for a restart from a checkpoint.
    reconnect_timeout_s: float = 60.0
    faults: Faults = field(default_factory=Faults)  # injected faults, for experiments
    keys: ClientKeys | None = None  # CURVE: needed when the coordinator has keys
    # Push gradients by reference, from shared memory, to a coordinator on this host that
    # takes them (bus.shared), where the worker waits for every version: sync, dense.
    shared_memory: bool = True
    # The coordinator's standby (nodes.replication): where to join when the coordinator does
    # not answer, a worker that starts after a takeover say (its heartbeats name it anyway).
    standby: str = ""

    @property
    def endpoints(self) -> tuple[str, ...]:
        connect = self.connect
        parts = connect.split(",") if isinstance(connect, str) else list(connect)
        return tuple(p.strip() for p in parts)

    def __post_init__(self) -> None:
        if not self.endpoints or not all(self.endpoints):
            raise ValueError(f"connect needs at least one endpoint, got {self.connect!r}")
        if len(set(self.endpoints)) != len(self.endpoints):
            raise ValueError(f"connect names an endpoint twice: {self.connect!r}")
        if self.rank < -1:
            raise ValueError(f"rank must be -1 (any) or at least 0, got {self.rank}")
        if not (self.device == "cpu" or (self.device.startswith("cuda:")
                                         and self.device[5:].isdigit())):
            raise ValueError(f"device must be cpu or cuda:N, got {self.device!r}")
        if self.standby and len(self.endpoints) > 1:
            raise ValueError("standby: a standby follows one coordinator, not shards "
                             f"({self.connect!r})")
        for name in ("join_timeout_s", "request_timeout_s", "reconnect_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
