"""What a training run is asked to do, and the coordinator built from it.

`local` and `coordinator` take the same options; both build their coordinator here. Each
option is declared once, in run.flags, whose dest names the RunOptions field it sets:
`RunOptions.from_args` copies them by name (and takes the few others from
flags.TO_OPTIONS). `coordinator_config` then copies every field that RunOptions and
nodes.config.CoordinatorConfig share by name, and gives the rest (NODE_SETTINGS, and what
differs from shard to shard) explicitly. A new option is a flag in run.flags and a field
of the same name here (and in CoordinatorConfig, if the coordinator needs it).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tensorbus.bus.layout import Compression
from tensorbus.bus.security import load_server_keys
from tensorbus.nodes.colocated import Colocated
from tensorbus.nodes.config import CoordinatorConfig
from tensorbus.nodes.coordinator import Coordinator, Progress
from tensorbus.nodes.evalpoints import Evaluate
from tensorbus.nodes.shards import ShardModel, assemble
from tensorbus.run import flags
from tensorbus.run.faults import parse_local
from tensorbus.run.spec import Spec
from tensorbus.strategies import STRATEGIES, Strategy
from tensorbus.strategies.base import PushKind, Wait

DEFAULT_LR = 0.1  # the learning rate of the default SGD, when the SPEC has no optimizer()
# The CoordinatorConfig fields that no run option sets: each node's own, from its launcher.
NODE_SETTINGS = frozenset({"bind", "pub_port", "stop_timeout_s", "first_rank", "world_size",
                           "until_workers_leave", "stage"})


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    workers: int
    strategy: str = "sync"
    steps: int | None = None
    epochs: int | None = None  # neither steps nor epochs: one epoch
    batch_size: int = 64
    lr: float | None = None  # the default SGD's (DEFAULT_LR when not given)
    seed: int = 0
    metrics: Path | None = None
    heartbeat_s: float = 0.5
    timeout_s: float = 10.0
    join_timeout_s: float = 300.0
    # The strategy's own options, by keyword (backups, staleness, average_every, ...):
    # only those the user set; each must be one the chosen strategy takes.
    strategy_options: Mapping[str, Any] = field(default_factory=dict)
    faults: tuple[str, ...] = ()  # `local` only: slow:RANK:MS, crash:RANK:STEP
    eval_every_s: float | None = None
    eval_every_epochs: int | None = None  # `--eval-every Nep`
    min_workers: int = 1
    max_workers: int | None = None
    checkpoint_dir: Path | None = None
    checkpoint_every: int | None = None
    resume: bool = False
    keys: Path | None = None  # a key directory (see `tensorbus keys`): CURVE on every socket
    trace: Path | None = None  # a Chrome trace-event timeline of the run, written here
    compress: str = ""  # "bf16", "fp16", "topk:R"; average: "int8", "int4" (bus.layout)
    shards: int = 1  # coordinator shards, each owning a range of the parameters
    # `local` only: each worker process serves one coordinator shard (nodes.colocated).
    colocate: bool = False
    # Workers push gradients to a coordinator on this host from shared memory (bus.shared).
    shared_memory: bool = True
    clip_grad_norm: float | None = None  # the largest 2-norm of a step's gradient
    save: Path | None = None  # write the trained model's state_dict here at the end
    precision: str = ""  # "bf16-mixed" or "fp16-mixed": the workers' forward in autocast
    # `local` only: the SPEC's stages() cut into `pipeline` stages, one a worker
    # (run.pipelines); each batch cut into `micro_batches`, run in `schedule` order.
    pipeline: int = 1
    micro_batches: int = 1
    schedule: str = "1f1b"

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"--workers must be at least 1, got {self.workers}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"--strategy {self.strategy!r}: choose from {sorted(STRATEGIES)}")
        if self.steps is not None and self.epochs is not None:
            raise ValueError("give --steps or --epochs, not both")
        for flag, value in (("--steps", self.steps), ("--epochs", self.epochs),
                            ("--batch-size", self.batch_size)):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be at least 1, got {value}")
        if not 0 < self.heartbeat_s < self.timeout_s:
            raise ValueError(f"--heartbeat must be above 0 and below --timeout, got "
                             f"{self.heartbeat_s:g} and {self.timeout_s:g}")
        if not self.join_timeout_s > 0:
            raise ValueError(f"--join-timeout must be above 0, got {self.join_timeout_s:g}")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"--lr must be positive, got {self.lr}")
        if self.clip_grad_norm is not None and not 0 < self.clip_grad_norm < float("inf"):
            raise ValueError(f"--clip-grad-norm must be a positive number, got "
                             f"{self.clip_grad_norm:g}")
        if self.eval_every_s is not None and not self.eval_every_s > 0:
            raise ValueError(f"--eval-every must be positive, got {self.eval_every_s:g}")
        if self.eval_every_epochs is not None and self.eval_every_epochs < 1:
            raise ValueError(f"--eval-every must be at least 1ep, got {self.eval_every_epochs}ep")
        parse_local(self.faults, self.workers)
        if self.max_workers is not None and self.max_workers < self.workers:
            raise ValueError(f"--max-workers ({self.max_workers}) must be at least --workers "
                             f"({self.workers})")
        if not 1 <= self.min_workers <= self.workers:
            raise ValueError(f"--min-workers must be in 1..--workers ({self.workers}), "
                             f"got {self.min_workers}")
        if (self.resume or self.checkpoint_every is not None) and self.checkpoint_dir is None:
            raise ValueError("--resume and --checkpoint-every need --checkpoint-dir")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ValueError(f"--checkpoint-every must be at least 1, got {self.checkpoint_every}")
        if self.shards < 1:
            raise ValueError(f"--shards must be at least 1, got {self.shards}")
        if self.shards > 1 and self.evaluates_during_training:
            raise ValueError("--eval-every evaluates the whole model during training, and each "
                             "of --shards holds a range of it: drop one of them")
        self._check_pipeline()
        strategy = make_strategy(self)  # one-line errors for its options now, not at start-up
        if strategy.rhythm.fragments and (self.shards > 1 or self.colocate):
            raise ValueError("--fragments streams the averages of the whole model through one "
                             "coordinator, and --shards and --colocate split it among several: "
                             "drop one of them")
        if self.colocate:
            self._check_colocate(strategy)
        if (self.clip_grad_norm is not None and (self.shards > 1 or self.colocate)
                and strategy.rhythm.push is PushKind.GRADIENT):
            raise ValueError("--clip-grad-norm clips the averaged gradient as a whole, and "
                             "with --shards or --colocate each coordinator shard holds only a "
                             "range of it: drop one of them (or use average, whose workers "
                             "clip their own)")
        # (One-line errors naming the choices, and what the strategy's pushes can take.)
        Compression.parse(self.compress).check(strategy.rhythm.push is PushKind.WEIGHTS,
                                               self.strategy)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RunOptions:
        """The options of a parsed `local` or `coordinator` command line (run.flags): each
        field from the dest of its name, or from flags.TO_OPTIONS; a flag left unset (None),
        or one this command lacks, leaves the field's default."""
        given: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            make = flags.TO_OPTIONS.get(f.name)
            value = make(args) if make is not None else getattr(args, f.name, None)
            if value is not None:
                given[f.name] = value
        return cls(**given)

    @property
    def pipelines(self) -> int:
        """The workers each coordinator serves: every worker, or under --pipeline P one a
        pipeline (N/P): each stage's coordinator serves that stage of every pipeline."""
        return self.workers // self.pipeline

    def _check_pipeline(self) -> None:
        if self.pipeline < 1:
            raise ValueError(f"--pipeline must be at least 1, got {self.pipeline}")
        if self.micro_batches < 1:
            raise ValueError(f"--micro-batches must be at least 1, got {self.micro_batches}")
        if self.schedule not in ("1f1b", "gpipe"):
            raise ValueError(f"--schedule {self.schedule!r}: choose from 1f1b, gpipe")
        if self.pipeline == 1:
            if self.micro_batches > 1:
                raise ValueError("--micro-batches cuts each batch for the stages of a "
                                 "pipeline: give --pipeline P too")
            return
        p = self.pipeline
        refusals = [
            (self.workers % p != 0, f"--workers {self.workers} is not a multiple of --pipeline "
                                    f"{p}: N workers make N/P pipelines of P stages"),
            (self.strategy not in ("sync", "average"),
             f"--pipeline serves each stage under sync or average, whose stages step together, "
             f"not {self.strategy}"),
            ("backups" in self.strategy_options,
             "sync --backups K would step each stage on its first gradients, which may be "
             "other pipelines' at each stage: drop --backups"),
            (self.micro_batches > self.batch_size,
             f"--micro-batches {self.micro_batches} is more than --batch-size "
             f"{self.batch_size}: a micro-batch needs a sample at least"),
            (self.shards > 1 or self.colocate,
             "--pipeline gives each stage a coordinator of its own: drop --shards and --colocate"),
            (self.clip_grad_norm is not None,
             "--clip-grad-norm clips the whole model's gradient, and with --pipeline each "
             "stage holds a part of it: drop one of them"),
            (self.precision == "fp16-mixed",
             "--precision fp16-mixed scales the loss on the last stage and checks every "
             "stage's gradients as one, which is not done across stages: use bf16-mixed"),
            (self.keys is not None,
             "--keys: the links between a pipeline's stages are not encrypted: drop --keys "
             "(pipelines run on this machine's loopback)"),
            (self.max_workers is not None,
             "--max-workers: a pipeline's stages join together, not one by one: drop it"),
            (self.evaluates_during_training,
             "--eval-every evaluates the whole model during training, and with --pipeline "
             "each stage's coordinator holds a part of it: drop one of them"),
            (self.min_workers > self.pipelines,
             f"--min-workers counts pipelines under --pipeline: at most {self.pipelines} here"),
        ]
        for refused, why in refusals:
            if refused:
                raise ValueError(why)

    @property
    def evaluates_during_training(self) -> bool:
        return self.eval_every_s is not None or self.eval_every_epochs is not None

    @property
    def sgd_lr(self) -> float:
        """The default SGD's learning rate: --lr, else DEFAULT_LR."""
        return self.lr if self.lr is not None else DEFAULT_LR

    def check_spec(self, spec: Spec) -> None:
        """Options the SPEC would make pointless are refused, not silently ignored."""
        if self.lr is not None and spec.optimizer is not None:
            raise ValueError(f"--lr sets the learning rate of the default SGD, and SPEC "
                             f"{spec.source} defines optimizer(), whose own wins: set the lr "
                             "there, or drop --lr")

    def _check_colocate(self, strategy: Strategy) -> None:
        if self.workers < 2:
            raise ValueError("--colocate needs at least 2 workers: with one, there is nothing "
                             "to share out")
        if self.shards > 1:
            raise ValueError("--colocate puts one coordinator shard in each worker (as many "
                             "shards as --workers): drop --shards")
        if strategy.rhythm.wait is not Wait.NEWER:
            raise ValueError(f"--colocate serves sync and average, whose workers wait for "
                             f"every version, not {self.strategy}: a worker that runs ahead "
                             "holds a shard the others need; drop --colocate for it")
        if self.max_workers is not None:
            raise ValueError("--colocate trains a fixed set of workers (each serves a shard): "
                             "drop --max-workers")
        if any(f.startswith("crash:") for f in self.faults):
            raise ValueError("--colocate: a crashed worker takes its shard of the model with "
                             "it and the run cannot go on; drop the crash fault")
        if self.evaluates_during_training:
            raise ValueError("--eval-every evaluates the whole model during training, and "
                             "with --colocate each worker's shard holds a range of it: drop "
                             "one of them")


def make_strategy(options: RunOptions) -> Strategy:
    """The chosen strategy with the options given; a flag it does not take is an error."""
    cls = STRATEGIES[options.strategy]
    for name in options.strategy_options:
        if name not in cls.options:
            takers = sorted(s for s, c in STRATEGIES.items() if name in c.options)
            flag = f"--{name.replace('_', '-')}"
            raise ValueError(f"{flag} is an option of {' and '.join(takers)}, not of "
                             f"{options.strategy}: drop it, or choose --strategy "
                             f"{' or '.join(takers)}")
    try:
        return cls(workers=options.pipelines, **options.strategy_options)
    except ValueError as e:  # said with the arguments' names: here, with their flags
        raise ValueError(_as_flags(str(e), cls.options | {"workers"})) from None


def _as_flags(text: str, names: Iterable[str]) -> str:
    """`text` with each of `names` (a strategy's arguments) written as its flag."""
    for name in sorted(names, key=len, reverse=True):
        text = re.sub(rf"(?<![\w-]){name}(?![\w-])", f"--{name.replace('_', '-')}", text)
    return text


def make_coordinator(
    spec: Spec,
    options: RunOptions,
    *,
    bind: str,
    pub_port: int | None = None,
    on_step: Callable[[Progress], None] | None = None,
    shard: int = 0,
    evaluate: Evaluate | None = None,
) -> Coordinator:
    """Seed, build the model from the SPEC, and set up a coordinator for these options:
    with `options.shards` > 1, coordinator shard `shard`, over its range of the model.
    Only shard 0 writes the metrics and the trace; each shard checkpoints into its own
    directory. Unsharded, it evaluates with the SPEC's evaluate; a shard, with `evaluate`
    if given (see `make_coordinators`), for it holds only a range of the model."""
    options.check_spec(spec)
    torch.manual_seed(options.seed)
    model: torch.nn.Module = spec.build_model()
    sharded = options.shards > 1
    if sharded:
        if not 0 <= shard < options.shards:
            raise ValueError(f"--shard {shard}/{options.shards}: the index must be in "
                             f"0..{options.shards - 1}")
        model = ShardModel(model, shard, options.shards)
    first = shard == 0
    return Coordinator(
        model=model,
        strategy=make_strategy(options),
        config=coordinator_config(options, bind=bind, pub_port=pub_port, shard=shard,
                                  shards=options.shards),
        optimizer=spec.optimizer, scheduler=spec.scheduler,
        lr=options.sgd_lr,
        evaluate=evaluate if sharded else spec.evaluate,
        on_step=on_step if first else None,
    )


def coordinator_config(
    options: RunOptions, *, bind: str, pub_port: int | None = None, shard: int = 0,
    shards: int = 1, stage: int = 0,
) -> CoordinatorConfig:
    """The configuration of coordinator shard `shard` of `shards` (1: the coordinator), or
    of the coordinator of pipeline stage `stage` (of `options.pipeline`). Only the first
    writes the metrics and the trace; each checkpoints into its own directory."""
    checkpoint_dir = options.checkpoint_dir
    if shards > 1 and checkpoint_dir is not None:
        checkpoint_dir = checkpoint_dir / f"shard-{shard}-of-{shards}"
    if options.pipeline > 1 and checkpoint_dir is not None:
        checkpoint_dir = checkpoint_dir / f"stage-{stage}-of-{options.pipeline}"
    first = shard == 0 and stage == 0
    return CoordinatorConfig(**{
        **same_named(CoordinatorConfig, options),
        "bind": bind,
        "pub_port": pub_port,
        "epochs": None if options.steps is not None else (options.epochs or 1),
        "metrics": options.metrics if first else None,
        "trace": options.trace if first else None,
        "checkpoint_dir": checkpoint_dir,
        "keys": load_server_keys(options.keys) if options.keys is not None else None,
        "stage": stage,
    })


def same_named(config: type[Any], source: object) -> dict[str, Any]:
    """The values in `source` (a dataclass, or parsed arguments whose dests are field
    names) of every field of the dataclass `config` that `source` has by the same name."""
    names = (f.name for f in dataclasses.fields(config))
    if dataclasses.is_dataclass(source):
        held = {f.name for f in dataclasses.fields(source)}
        names = (n for n in names if n in held)
    else:
        names = (n for n in names if hasattr(source, n))
    return {name: getattr(source, name) for name in names}


def make_colocated(
    spec: Spec, options: RunOptions, *, index: int, bind: str,
    on_step: Callable[[Progress], None] | None = None,
) -> Colocated:
    """Worker `index` of `options.workers` with the coordinator shard it serves (--colocate):
    the model built from the SPEC with the run's seed, as in every other process. Node 0
    reports: the metrics, the trace, progress, and the evaluation of the final model."""
    options.check_spec(spec)
    torch.manual_seed(options.seed)
    first = index == 0
    return Colocated(
        index=index, count=options.workers, model=spec.build_model(), data=spec.data,
        loss=spec.loss, strategy=make_strategy(options),
        config=coordinator_config(options, bind=bind, shard=index, shards=options.workers),
        optimizer=spec.optimizer, scheduler=spec.scheduler, lr=options.sgd_lr,
        evaluate=spec.evaluate if first else None, on_step=on_step if first else None,
    )


def make_coordinators(
    spec: Spec,
    options: RunOptions,
    *,
    bind: str,
    on_step: Callable[[Progress], None] | None = None,
) -> list[Coordinator]:
    """The coordinator, or the `options.shards` coordinator shards, for these options.

    Shard 0 evaluates the whole model, assembled from every shard's weights, once every
    shard is done: run it with `before_evaluate` awaiting the others (see `serve`).
    """
    if options.shards == 1:
        return [make_coordinator(spec, options, bind=bind, on_step=on_step)]
    evaluate = spec.evaluate
    shards: list[ShardModel] = []

    def assembled(_: torch.nn.Module) -> dict[str, float]:
        assert evaluate is not None
        # A whole model, built at the end only, filled with every shard's weights.
        return evaluate(assemble(spec.build_model(), shards))

    coordinators = [
        make_coordinator(spec, options, bind=bind, on_step=on_step, shard=i,
                         evaluate=assembled if i == 0 and evaluate is not None else None)
        for i in range(options.shards)]
    shards.extend(c.model for c in coordinators if isinstance(c.model, ShardModel))
    return coordinators


def final_model(spec: Spec, coordinators: list[Coordinator]) -> torch.nn.Module:
    """The whole trained model: the coordinator's, or one built from the SPEC and filled
    with every shard's weights."""
    if len(coordinators) == 1:
        return coordinators[0].model
    shards = [c.model for c in coordinators if isinstance(c.model, ShardModel)]
    return assemble(spec.build_model(), shards)


async def serve(coordinators: list[Coordinator]) -> dict[str, Any]:
    """Run the coordinator, or every shard of a sharded server, to the end; return the
    (first shard's) summary. One shard failing stops the others."""
    first, *others = coordinators
    if not others:
        return await first.run()
    rest = [asyncio.create_task(c.run()) for c in others]
    gathered = asyncio.gather(*rest)
    main = asyncio.create_task(first.run(before_evaluate=gathered))
    try:
        both: set[asyncio.Future[Any]] = {main, gathered}
        await asyncio.wait(both, return_when=asyncio.FIRST_EXCEPTION)
        if gathered.done() and gathered.exception() is not None:
            raise gathered.exception()  # type: ignore[misc]
        summary = await main
    finally:
        for task in (main, *rest):
            task.cancel()
        await asyncio.gather(main, *rest, return_exceptions=True)
    return {**summary, "shards": len(coordinators)}
