"""The `tensorbus` command: `local`, `coordinator` and `worker`. The only reader of argv.

Every failure a user can cause ends with one line on stderr, `tensorbus: error: ...`
(a worker's says `error: ...`, for its launcher to pick up), saying what is wrong and what
to do, and a non-zero exit status: 2 for bad arguments or SPEC, 1 for a run that failed.
A run stopped by SIGINT or SIGTERM stops gracefully, then dies of the signal (a shell's
130 or 143); a second signal, or one during the imports, interrupts at once (130). A
traceback only with `--debug`; anything unforeseen is named as an internal error, in one
line too.

The options are declared in run.flags, each flag's dest being the name of the setting it
sets: a training run's become run.options.RunOptions by name (`RunOptions.from_args`), and a
relay's coordinator settings are copied by name too (`same_named`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import traceback
from typing import Any

import torch

from tensorbus.bus.errors import HandshakeError, PeerTimeoutError, RejectedError
from tensorbus.bus.security import load_client_keys, load_server_keys, make_keys
from tensorbus.bus.transport import is_loopback, new_event_loop, split_endpoint
from tensorbus.nodes.checkpoint import CheckpointError
from tensorbus.nodes.config import CoordinatorConfig, WorkerConfig
from tensorbus.nodes.failures import TrainingError
from tensorbus.nodes.link import RunFailedError
from tensorbus.nodes.metrics import MetricsError
from tensorbus.nodes.neighbours import NeighbourLost
from tensorbus.nodes.relay import Relay
from tensorbus.nodes.stage_worker import StageWorker
from tensorbus.nodes.stages import Stage, StagesError, build_stage, cut
from tensorbus.nodes.worker import ComputeError, DataError, Worker
from tensorbus.run import cluster, device, flags, interrupts, own_loop
from tensorbus.run import summary as run_summary
from tensorbus.run.export import check_writable, export, save_model
from tensorbus.run.faults import limit_memory, memory_mb, parse_worker
from tensorbus.run.local import LocalRunError, fork_children, launch_local
from tensorbus.run.memory import keep_freed_memory
from tensorbus.run.options import RunOptions, make_coordinator, same_named
from tensorbus.run.out_of_memory import WorkerOutOfMemory, explain, is_out_of_memory
from tensorbus.run.pernode import launch_node
from tensorbus.run.progress import CurrentStderr, ProgressLine
from tensorbus.run.signals import die_of, stopping_on_signals
from tensorbus.run.spec import SpecError, error_line, load_spec
from tensorbus.run.status import StatusTable
from tensorbus.strategies import STRATEGIES

DONE = "worker {rank} done: "  # how a worker's last line begins when it ends well


def main(argv: list[str] | None = None) -> int:
    return run(flags.parse(sys.argv[1:] if argv is None else argv))


def run(args: argparse.Namespace) -> int:
    """Carry out a parsed command line (run.flags): its exit status."""
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s {args.command} %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        stream=CurrentStderr(),  # (above the progress line, where one is drawn)
    )
    error_prefix = "error: " if args.command == "worker" else "tensorbus: error: "
    if args.threads is not None:
        if args.threads < 1:
            print(f"{error_prefix}--threads must be at least 1, got {args.threads}",
                  file=sys.stderr)
            return 2
        torch.set_num_threads(args.threads)
    keep_freed_memory()

    def fail(e: BaseException, text: str, status: int) -> int:
        if status != 130 and interrupts.noted():
            # Ctrl-C came, a library swallowed it, and this failed on what it left half made.
            e, text, status = KeyboardInterrupt(), "interrupted", 130
        if args.debug:
            traceback.print_exception(e)
        elif e.__cause__ is not None and not isinstance(e.__cause__, _OURS):
            text += " (--debug shows the traceback)"  # the SPEC's own code raised
        print(f"{error_prefix}{text}", file=sys.stderr)
        return status

    try:
        commands = {"local": _local, "coordinator": _coordinator, "worker": _worker, "relay": _relay,
                    "keys": _keys, "plot": _plot, "export": _export, "launch": _launch}
        return commands[args.command](args)
    except KeyboardInterrupt as e:
        return fail(e, "interrupted", 130)
    except (SpecError, StagesError, ValueError, CheckpointError, MetricsError) as e:
        return fail(e, str(e), 2)
    except (DataError, ComputeError) as e:  # the SPEC's own code failed: said with its path
        return fail(e, error_line(e, args.spec), 1)
    except (TrainingError, LocalRunError, PeerTimeoutError, RejectedError, HandshakeError,
            RunFailedError, OSError, NeighbourLost, WorkerOutOfMemory) as e:
        return fail(e, str(e), 1)
    except Exception as e:  # noqa: BLE001 - a bug: still one line, the traceback on request
        return fail(e, f"internal error: {type(e).__name__}: {e} (a bug in tensorbus: run "
                       "again with --debug and report the traceback)", 1)


# Causes that are ours and already said in full: no traceback would help a user. (A
# ValueError or OSError as a cause came from the SPEC's code or a library: its traceback may.)
_OURS = (SpecError, TrainingError, PeerTimeoutError, RejectedError, HandshakeError, RunFailedError,
         CheckpointError, MetricsError, StagesError)


def _local(args: argparse.Namespace) -> int:
    if args.save is not None:
        check_writable(args.save)
    progress = ProgressLine(sys.stderr) if not args.no_progress else None
    try:
        with progress.above() if progress else contextlib.nullcontext():
            summary = launch_local(
                args.spec, RunOptions.from_args(args), on_step=progress, threads=args.threads,
                log_level=args.log_level, status=StatusTable(sys.stderr, every_s=args.status),
                debug=args.debug, device=args.device, fork=True,
                standby=_standby_options(args) if args.standby else None,
            )
    finally:
        if progress:
            progress.close()
    return _ended(args, summary)


def _standby_options(args: argparse.Namespace) -> list[str]:
    """`local --standby`'s standby: `coordinator` with the run's options, its own metrics
    beside the run's, its summary left to the run's."""
    own = [a for a in flags.as_argv("coordinator", args)
           if not a.startswith(("--json", "--save=", "--metrics=", "--status="))]
    if args.metrics is not None:
        own.append(f"--metrics={args.metrics.with_suffix('.standby.jsonl')}")
    return [args.spec, *own, "--bind", "tcp://127.0.0.1:0", "--no-progress"]


def _launch(args: argparse.Namespace) -> int:
    """`tensorbus launch SCRIPT`: a coordinator of the script's model, and N copies of it."""
    options = RunOptions.from_args(args)
    own_loop.check(options)
    # Copies forked from here, torch imported (run.children); not beside GPUs, which a
    # script may take: there, fresh interpreters, as torchrun starts.
    forks = fork_children(options.workers, ["cpu"]) if torch.cuda.device_count() == 0 else None
    try:
        summary = own_loop.launch(args.script, options, args.script_args, threads=args.threads,
                                  forks=forks)
    except own_loop.ScriptsFailed as e:
        _ended(args, e.summary)  # the run's figures, then the failure's line (exit 1)
        raise
    finally:
        if forks is not None:
            forks.close()
    return _ended(args, summary)


def _check_standby(args: argparse.Namespace) -> None:
    """What a standby (--standby-of) cannot be yet, refused before anything starts."""
    if args.standby_of is None:
        return
    split_endpoint(args.standby_of)
    unsupported = [name for name, given in (
        ("a SPEC", args.spec is None), ("--shard", args.shard is not None and args.shard[1] > 1))
        if given]
    if unsupported:
        raise ValueError(f"--standby-of follows one coordinator of a SPEC, without --shard, and "
                         f"this one has {', '.join(unsupported)}: a standby of such runs is not "
                         "built yet")
    host, _ = split_endpoint(args.bind)
    if host in ("0.0.0.0", "*", "::"):
        raise ValueError(f"--standby-of: --bind {args.bind} names no address workers can reach: "
                         "give this host's address (the coordinator tells its workers to move there)")


def _coordinator(args: argparse.Namespace) -> int:
    args.bind, args.workers = _served(args)
    _refuse_public_bind(args)
    _check_standby(args)
    if args.spec is None:  # scripts that bring their own loop describe the model
        options = RunOptions.from_args(args)
        own_loop.check(options)
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            summary = runner.run(own_loop.serve(options, bind=args.bind, pub_port=args.pub_port))
        return _ended(args, summary)
    if args.save is not None:
        if args.shard is not None and args.shard[1] > 1:
            raise ValueError(f"--save writes the whole model, and --shard {args.shard[0]}/"
                             f"{args.shard[1]} holds a range of it: drop --save, or run the "
                             "shards in one `tensorbus local --shards` to save")
        check_writable(args.save)
    spec = load_spec(args.spec)
    progress = ProgressLine(sys.stderr) if not args.no_progress else None
    shard, _ = args.shard or (0, 1)
    coordinator = make_coordinator(spec, RunOptions.from_args(args), bind=args.bind,
                                   pub_port=args.pub_port, on_step=progress, shard=shard)
    status = StatusTable(sys.stderr, every_s=args.status)

    async def serve() -> dict[str, Any] | None:
        if args.standby_of is not None and not await coordinator.stand_by(args.standby_of):
            return None  # the coordinator followed ended its run: nothing was taken over
        return await status.around(coordinator, coordinator.run())

    try:
        with (progress.above() if progress else contextlib.nullcontext(),
              asyncio.Runner(loop_factory=new_event_loop) as runner):
            ran = runner.run(stopping_on_signals(coordinator, serve()))
    finally:
        if progress:
            progress.close()
    if ran is None:
        print(f"the coordinator at {args.standby_of} ended its run: this standby took "
              "nothing over", file=sys.stderr)
        return 0
    if args.save is not None:
        save_model(coordinator.model, args.save)
    return _ended(args, ran)


def _relay(args: argparse.Namespace) -> int:
    """`tensorbus relay`: a coordinator to --workers local workers, a worker of --connect."""
    _refuse_public_bind(args)
    split_endpoint(args.connect)
    spec = load_spec(args.spec)
    options = {"average_every": args.average_every} if args.average_every is not None else {}
    if args.strategy == "sync" and options:
        raise ValueError("--average-every is an option of average, not of sync: drop it, or "
                         "choose --strategy average")
    strategy = STRATEGIES[args.strategy](workers=args.workers, **options)
    # --bind, --pub-port, --heartbeat, --timeout, --join-timeout and --no-shared-memory, by
    # their dests' names; the run's length is the root's (the relay ignores steps).
    config = CoordinatorConfig(**{
        **same_named(CoordinatorConfig, args), "steps": 1,
        "keys": load_server_keys(args.keys) if args.keys else None})
    relay = Relay(model=spec.build_model(), strategy=strategy, config=config,
                  upstream=args.connect,
                  keys=load_client_keys(args.keys, args.key_name) if args.keys else None)
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        summary = runner.run(stopping_on_signals(relay, relay.run()))
    return _ended(args, summary)


def _worker(args: argparse.Namespace) -> int:
    if args.workers_per_node is not None:
        return _node(args)
    if args.node_rank is not None:
        raise ValueError("--node-rank numbers the nodes of --workers-per-node: give both, "
                         "or neither")
    args.connect, args.rank = _placed(args)
    allowed = memory_mb(args.fault)
    if allowed is not None:  # (a small worker on purpose: before it builds anything)
        limit_memory(allowed)
    spec = load_spec(args.spec)
    for endpoint in args.connect.split(","):
        split_endpoint(endpoint.strip())
    config = WorkerConfig(connect=args.connect, rank=args.rank, device=_device(args.device),
                          join_timeout_s=args.join_timeout_s, faults=parse_worker(args.fault),
                          reconnect_timeout_s=args.reconnect_timeout_s,
                          shared_memory=args.shared_memory, standby=args.standby or "",
                          keys=load_client_keys(args.keys, args.key_name) if args.keys else None)
    try:
        worker = _new_worker(args, spec, config)
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            report = runner.run(stopping_on_signals(worker, worker.run()))
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        raise _out_of_memory(args, spec) from e
    except asyncio.CancelledError:
        if worker.stopped_by is None:
            raise
        # Left the run and let go of its shared memory: now die of the signal, as asked.
        print(f"{worker.name} left the run on {worker.stopped_by}", file=sys.stderr, flush=True)
        die_of(signal.Signals[worker.stopped_by])
        raise
    # Said whatever the log level: a worker started by hand that succeeds says so.
    loss = f"{report.last_loss:.4f}" if report.last_loss is not None else "-"
    print(f"{DONE.format(rank=report.rank)}{report.pushes} pushes, final version "
          f"{report.final_version}, last loss {loss}", file=sys.stderr, flush=True)
    logging.getLogger("tensorbus.worker").info(
        "worker %d: %d versions loaded by reference (%d torn), %d computes done again "
        "(their weights rewritten meanwhile)", report.rank, report.by_reference, report.torn,
        report.redone)
    return 0


def _new_worker(args: argparse.Namespace, spec: Any, config: WorkerConfig) -> Worker:
    """A worker of the whole model, or with --stage S/P of stage S of the SPEC's stages()."""
    common: dict[str, Any] = {"data": spec.data, "loss": spec.loss, "config": config,
                              "optimizer": spec.optimizer, "scheduler": spec.scheduler}
    if args.stage is None:
        return Worker(model=spec.build_model(), **common)
    stage, stages = args.stage
    if config.device != "cpu":
        raise ValueError(f"--stage runs on the CPU only, for now (a stage's activations are not "
                         f"yet moved to and from a GPU), not {config.device}: give --device cpu")
    if spec.stages is None:
        raise SpecError(f"SPEC {spec.source}: --stage {stage}/{stages} needs stages() -> list "
                        "of torch.nn.Module, the model cut into modules that run in sequence: "
                        "define it (see examples/digits_pipeline.py)")
    return StageWorker(stage=stage, stages=stages,
                       model=build_stage(spec.stages, stage, stages, f"SPEC {spec.source}"),
                       **common)


def _out_of_memory(args: argparse.Namespace, spec: Any) -> WorkerOutOfMemory:
    """Worker out of memory: said with the size of what it holds."""
    rank = f" {args.rank}" if args.rank is not None and args.rank >= 0 else ""
    if args.stage is None:
        return explain(who=f"worker{rank}", build=spec.model, pipelined=False)
    stage, stages = args.stage

    def build() -> Stage:
        return cut(spec.stages(), stages)[stage]
    return explain(who=f"stage {stage} of pipeline{rank}", build=build, pipelined=True)


def _served(args: argparse.Namespace) -> tuple[str, int]:
    """The coordinator's --bind and --workers, else the environment's (see run.cluster).

    With no --bind, it listens on every interface only with --keys, which let in only the
    workers whose keys it holds; without, on loopback alone: other machines need --bind
    with --keys (or --insecure)."""
    if args.bind is not None and args.port is not None:
        raise ValueError("give --bind tcp://HOST:PORT or --port PORT, not both")
    host = "0.0.0.0" if args.keys is not None else "127.0.0.1"
    bind = args.bind or f"tcp://{host}:{cluster.coordinator_port(os.environ, args.port)}"
    return bind, cluster.workers(os.environ, args.workers)


def _placed(args: argparse.Namespace) -> tuple[str, int]:
    """A worker's --connect and --rank, else the environment's (see run.cluster)."""
    if args.connect is not None and args.port is not None:
        raise ValueError("--port goes with an address from the environment (MASTER_ADDR or "
                         "Slurm's nodelist): with --connect, give the port in it")
    placement = cluster.placement(os.environ, rank=args.rank, port=args.port)
    return args.connect or placement.endpoint(), placement.rank


def _node(args: argparse.Namespace) -> int:
    """`worker --workers-per-node G`: G workers on this node (see run.pernode)."""
    if args.rank is not None:
        raise ValueError("--rank and --workers-per-node exclude each other: worker L of a "
                         "node takes rank NODE_RANK*G+L (see --node-rank)")
    connect, _ = _placed(args)
    flags = ["--log-level", args.log_level, "--join-timeout", str(args.join_timeout_s),
             "--reconnect-timeout", str(args.reconnect_timeout_s), "--key-name", args.key_name,
             *(f"--fault={f}" for f in args.fault)]
    if args.keys is not None:
        flags += ["--keys", str(args.keys)]
    if args.debug:
        flags.append("--debug")
    launch_node(args.spec, workers=args.workers_per_node, connect=connect,
                node_rank=cluster.node_rank(os.environ, args.node_rank), device=args.device,
                threads=args.threads, flags=flags, environ=os.environ)
    return 0


def _export(args: argparse.Namespace) -> int:
    """`tensorbus export CHECKPOINT -o FILE.pt`: a checkpoint's model as a state_dict."""
    read = export(args.checkpoint, args.output)
    print(f"wrote the model of {read} to {args.output}", file=sys.stderr)
    return 0


def _plot(args: argparse.Namespace) -> int:
    from tensorbus.run.plot import PlotError, plot  # matplotlib: only for this command

    try:
        written = plot(args.metrics, args.output, labels=args.label)
    except PlotError as e:
        raise ValueError(str(e)) from None
    print(f"wrote {written}", file=sys.stderr)
    return 0


def _keys(args: argparse.Namespace) -> int:
    make_keys(args.directory, args.worker or ["worker"])
    print(f"keys in {args.directory}: keep coordinator.key_secret on the coordinator; give each "
          "worker coordinator.key and its NAME.key_secret (--keys DIR --key-name NAME); "
          "authorized/ lists the workers let in", file=sys.stderr)
    return 0


def _device(name: str) -> str:
    """A worker's --device, with auto and cuda resolved by its local rank (run.device)."""
    return device.resolve(name, cluster.placement(os.environ).local_rank)


def _refuse_public_bind(args: argparse.Namespace) -> None:
    """A coordinator's (or relay's) --bind off loopback needs --keys, or --insecure."""
    host, _ = split_endpoint(args.bind)
    if args.keys is None and not args.insecure and not is_loopback(host):
        raise ValueError(
            f"--bind {args.bind} is not a loopback address and no --keys were given: anyone "
            "who can reach it could join and read the weights; make keys with `tensorbus keys "
            "DIR` and pass --keys DIR, or pass --insecure to accept that")


def _ended(args: argparse.Namespace, summary: dict[str, Any]) -> int:
    """Say how the run ended: its main figures (or, with --json, the whole summary); for a
    run a signal stopped, what was saved, and then die of that signal, as asked."""
    training = args.command != "relay"  # (a relay has no --metrics, no checkpoints)
    if args.json:
        print(json.dumps(summary, indent=1), flush=True)
    else:
        print(run_summary.table(summary, getattr(args, "metrics", None), keeps=training),
              flush=True)
    stopped = run_summary.stopped_by(summary)
    if stopped is not None:
        print(f"tensorbus: {run_summary.after_a_signal(summary, saves=training)}",
              file=sys.stderr, flush=True)
        die_of(stopped)
    return 0
