"""The `tensorbus` command: `local`, `coordinator` and `worker`. The only reader of argv.

Every failure a user can cause ends with one line on stderr, `tensorbus: error: ...`
(a worker's says `error: ...`, for its launcher to pick up), saying what is wrong and what
to do, and a non-zero exit status: 2 for bad arguments or SPEC, 1 for a run that failed,
130 when interrupted. A traceback only with `--debug`; anything unforeseen is named as an
internal error, in one line too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any, NoReturn

import torch

from tensorbus.bus.errors import HandshakeError, PeerTimeoutError, RejectedError
from tensorbus.bus.messages import BUILD, PROTOCOL_VERSION
from tensorbus.bus.security import load_client_keys, load_server_keys, make_keys
from tensorbus.bus.transport import is_loopback, new_event_loop, split_endpoint
from tensorbus.nodes.checkpoint import CheckpointError
from tensorbus.nodes.config import CoordinatorConfig, WorkerConfig
from tensorbus.nodes.coordinator import TrainingError
from tensorbus.nodes.link import RunFailedError
from tensorbus.nodes.metrics import MetricsError
from tensorbus.nodes.relay import Relay
from tensorbus.nodes.worker import ComputeError, DataError, Worker
from tensorbus.run import cluster, device, interrupts
from tensorbus.run.faults import parse_worker
from tensorbus.run.local import LocalRunError, launch_local
from tensorbus.run.memory import keep_freed_memory
from tensorbus.run.options import RunOptions, make_coordinator
from tensorbus.run.pernode import launch_node
from tensorbus.run.progress import ProgressLine
from tensorbus.run.signals import die_of, stopping_on_signals
from tensorbus.run.spec import SpecError, load_spec, said
from tensorbus.run.status import StatusTable
from tensorbus.strategies import STRATEGIES

LOG_LEVELS = ("debug", "info", "warning", "error")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s {args.command} %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
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
                    "keys": _keys, "plot": _plot}
        return commands[args.command](args)
    except KeyboardInterrupt as e:
        return fail(e, "interrupted", 130)
    except (SpecError, ValueError, CheckpointError, MetricsError) as e:
        return fail(e, str(e), 2)
    except (DataError, ComputeError) as e:  # the SPEC's own code failed: said with its path
        return fail(e, said(e, args.spec), 1)
    except (TrainingError, LocalRunError, PeerTimeoutError, RejectedError, HandshakeError,
            RunFailedError, OSError) as e:
        return fail(e, str(e), 1)
    except Exception as e:  # noqa: BLE001 - a bug: still one line, the traceback on request
        return fail(e, f"internal error: {type(e).__name__}: {e} (a bug in tensorbus: run "
                       "again with --debug and report the traceback)", 1)


# Causes that are ours and already said in full: no traceback would help a user. (A
# ValueError or OSError as a cause came from the SPEC's code or a library: its traceback may.)
_OURS = (SpecError, TrainingError, PeerTimeoutError, RejectedError, HandshakeError, RunFailedError,
         CheckpointError, MetricsError)


def _local(args: argparse.Namespace) -> int:
    progress = ProgressLine(sys.stderr) if not args.no_progress else None
    try:
        summary = launch_local(
            args.spec, _run_options(args), on_step=progress, threads=args.threads,
            log_level=args.log_level, status=StatusTable(sys.stderr, every_s=args.status),
            debug=args.debug, device=args.device, fork=True,
        )
    finally:
        if progress:
            progress.close()
    _print_summary(summary)
    return 0


def _coordinator(args: argparse.Namespace) -> int:
    args.bind, args.workers = _served(args)
    _refuse_public_bind(args)
    spec = load_spec(args.spec)
    progress = ProgressLine(sys.stderr) if not args.no_progress else None
    shard, _ = args.shard or (0, 1)
    coordinator = make_coordinator(spec, _run_options(args), bind=args.bind,
                                   pub_port=args.pub_port, on_step=progress, shard=shard)
    status = StatusTable(sys.stderr, every_s=args.status)
    try:
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            summary = runner.run(stopping_on_signals(
                coordinator, status.around(coordinator, coordinator.run())))
    finally:
        if progress:
            progress.close()
    _print_summary(summary)
    return 0


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
    config = CoordinatorConfig(
        bind=args.bind, pub_port=args.pub_port, steps=1, heartbeat_s=args.heartbeat,
        timeout_s=args.timeout, join_timeout_s=args.join_timeout,
        keys=load_server_keys(args.keys) if args.keys else None,
        shared_memory=not args.no_shared_memory)
    relay = Relay(model=spec.build_model(), strategy=strategy, config=config,
                  upstream=args.connect,
                  keys=load_client_keys(args.keys, args.key_name) if args.keys else None)
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        summary = runner.run(stopping_on_signals(relay, relay.run()))
    _print_summary(summary)
    return 0


def _worker(args: argparse.Namespace) -> int:
    if args.workers_per_node is not None:
        return _node(args)
    if args.node_rank is not None:
        raise ValueError("--node-rank numbers the nodes of --workers-per-node: give both, "
                         "or neither")
    args.connect, args.rank = _placed(args)
    spec = load_spec(args.spec)
    for endpoint in args.connect.split(","):
        split_endpoint(endpoint.strip())
    config = WorkerConfig(connect=args.connect, rank=args.rank, device=_device(args.device),
                          join_timeout_s=args.join_timeout, faults=parse_worker(args.fault),
                          reconnect_timeout_s=args.reconnect_timeout,
                          shared_memory=not args.no_shared_memory,
                          keys=load_client_keys(args.keys, args.key_name) if args.keys else None)
    worker = Worker(model=spec.build_model(), data=spec.data, loss=spec.loss, config=config,
                    optimizer=spec.optimizer)
    try:
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            report = runner.run(stopping_on_signals(worker, worker.run()))
    except asyncio.CancelledError:
        if worker.stopped_by is None:
            raise
        # Left the run and let go of its shared memory: now die of the signal, as asked.
        print(f"worker {worker.rank} left the run on {worker.stopped_by}", file=sys.stderr, flush=True)
        die_of(signal.Signals[worker.stopped_by])
        raise
    logging.getLogger("tensorbus.worker").info(
        "worker %d done: %d pushes, last loss %s, %d versions loaded by reference (%d torn), "
        "%d computes done again (their weights rewritten meanwhile)", report.rank,
        report.pushes, report.last_loss, report.by_reference, report.torn, report.redone)
    return 0


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
    load_spec(args.spec)  # a SPEC error once, here, rather than from every worker
    flags = ["--log-level", args.log_level, "--join-timeout", str(args.join_timeout),
             "--reconnect-timeout", str(args.reconnect_timeout), "--key-name", args.key_name,
             *(f"--fault={f}" for f in args.fault)]
    if args.keys is not None:
        flags += ["--keys", str(args.keys)]
    if args.debug:
        flags.append("--debug")
    launch_node(args.spec, workers=args.workers_per_node, connect=connect,
                node_rank=cluster.node_rank(os.environ, args.node_rank), device=args.device,
                threads=args.threads, flags=flags, environ=os.environ)
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


# Every strategy option has a flag below; which strategy takes which is the strategy's say.
STRATEGY_FLAGS = sorted(set().union(*(cls.options for cls in STRATEGIES.values())))


def _run_options(args: argparse.Namespace) -> RunOptions:
    return RunOptions(
        workers=args.workers, strategy=args.strategy, steps=args.steps, epochs=args.epochs,
        batch_size=args.batch_size, lr=args.lr, seed=args.seed, metrics=args.metrics,
        heartbeat_s=args.heartbeat, timeout_s=args.timeout, join_timeout_s=args.join_timeout,
        strategy_options={k: getattr(args, k) for k in STRATEGY_FLAGS if getattr(args, k) is not None},
        faults=tuple(getattr(args, "fault", None) or ()), eval_every_s=args.eval_every,
        min_workers=args.min_workers or 1, max_workers=args.max_workers, checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every, resume=args.resume, keys=args.keys,
        trace=args.trace, compress=args.compress or "", shards=_shards(args),
        colocate=getattr(args, "colocate", False), shared_memory=not args.no_shared_memory,
    )


def _shards(args: argparse.Namespace) -> int:
    """How many coordinator shards: `local --shards S`, or S of `coordinator --shard I/S`."""
    if getattr(args, "shard", None) is not None:
        return int(args.shard[1])
    return int(getattr(args, "shards", None) or 1)


def _shard(text: str) -> tuple[int, int]:
    """`--shard I/S`: this coordinator is shard I (from 0) of S."""
    try:
        index, count = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not I/S (this shard's index from 0, "
                                         "then the number of shards), e.g. 0/2") from None
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"{text!r}: the index must be in 0..S-1")
    return index, count


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


def _print_summary(summary: dict[str, Any]) -> None:
    print(json.dumps(summary, indent=1), flush=True)


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="tensorbus", description="Train one PyTorch model on many processes over ZeroMQ."
    )
    parser.add_argument("--version", action="version",
                        version=f"tensorbus {BUILD} (wire protocol {PROTOCOL_VERSION})")
    commands = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("spec", help="a SPEC: a Python file or module:object")
        p.add_argument("--threads", type=int, default=None, help="torch threads per process")
        p.add_argument("--log-level", choices=LOG_LEVELS, default="warning")
        p.add_argument("--debug", action="store_true", help="print the traceback of an error")

    def shared_memory(p: argparse.ArgumentParser) -> None:
        p.add_argument("--no-shared-memory", action="store_true",
                       help="gradients cross the socket as bytes even between a worker and "
                            "a coordinator on this host (by default, under sync, a worker "
                            "pushes them by reference, from shared memory)")

    def training(p: argparse.ArgumentParser, *, workers_from_env: bool = False) -> None:
        p.add_argument("--workers", type=int, required=not workers_from_env,
                       help="workers to train with" + (" (default: WORLD_SIZE)"
                                                       if workers_from_env else ""))
        p.add_argument("--strategy", choices=sorted(STRATEGIES), default="sync")
        length = p.add_mutually_exclusive_group()
        length.add_argument("--steps", type=int, help="versions to apply")
        length.add_argument("--epochs", type=int, help="passes over each worker's shard (default 1)")
        p.add_argument("--batch-size", type=int, default=64, help="per worker (default 64)")
        p.add_argument("--lr", type=float, default=0.1, help="for the default SGD (default 0.1)")
        p.add_argument("--seed", type=int, default=0, help="seeds the initial weights")
        p.add_argument("--metrics", type=Path, help="write JSON lines here, summary last")
        p.add_argument("--heartbeat", type=float, default=0.5, help="seconds between heartbeats")
        p.add_argument("--timeout", type=float, default=10.0, help="remove a worker silent this long")
        p.add_argument("--join-timeout", type=float, default=300.0,
                       help="wait this long for workers, in seconds (default 300)")
        p.add_argument("--no-progress", action="store_true", help="no progress line")
        p.add_argument("--status", type=float, nargs="?", const=5.0, metavar="SECONDS",
                       help="print the per-worker status table every SECONDS (default 5); "
                            "it is also printed on SIGUSR1, or Enter on a terminal")
        p.add_argument("--trace", type=Path, metavar="FILE.json",
                       help="write a timeline of the run (Chrome trace events: open it in "
                            "Perfetto or chrome://tracing)")
        p.add_argument("--min-workers", type=int, metavar="M",
                       help="stop with an error when fewer than M workers are left (default 1)")
        p.add_argument("--max-workers", type=int, metavar="W",
                       help="ranks 0..W-1 exist and data is sharded W ways, so that workers "
                            "beyond --workers may join during training (default: --workers)")
        p.add_argument("--checkpoint-dir", type=Path, metavar="DIR",
                       help="write checkpoints here (atomically; the 3 newest are kept), "
                            "at the end and on SIGTERM or Ctrl-C")
        p.add_argument("--checkpoint-every", type=int, metavar="K",
                       help="also write a checkpoint every K versions")
        p.add_argument("--keys", type=Path, metavar="DIR",
                       help="CURVE: encrypt every socket and admit only the workers whose "
                            "public keys are in DIR/authorized (see `tensorbus keys`)")
        p.add_argument("--resume", action="store_true",
                       help="go on from the newest checkpoint in --checkpoint-dir (if any)")
        p.add_argument("--compress", metavar="bf16|fp16|topk:R",
                       help="push gradients in bf16 or fp16 (half the bytes), or as the "
                            "largest R of their elements (topk:0.01: 1%%, with error "
                            "feedback); the coordinator keeps fp32 weights (sync, ssp, async)")
        shared_memory(p)
        p.add_argument("--eval-every", type=float, metavar="SECONDS",
                       help="copy the weights every SECONDS of training and evaluate the copies "
                            "after training (accuracy against time, in --metrics)")
        s = p.add_argument_group("strategy options")
        s.add_argument("--backups", type=int, metavar="K",
                       help="sync: step on the first WORKERS-K gradients of a version")
        s.add_argument("--staleness", type=int, metavar="S",
                       help="ssp: clocks differ by at most S+1 (default 2)")
        s.add_argument("--staleness-lr", action="store_true", default=None,
                       help="ssp, async: divide each step by 1 + its staleness")
        s.add_argument("--average-every", type=int, metavar="H",
                       help="average: local steps between averages (default 8)")
        s.add_argument("--outer-lr", type=float,
                       help="average: SGD on the averaged change with this lr (DiLoCo)")
        s.add_argument("--outer-momentum", type=float, help="average: its momentum")
        s.add_argument("--nesterov", action="store_true", default=None,
                       help="average: Nesterov momentum for the outer SGD")

    local = commands.add_parser("local", help="a coordinator and N workers on this machine")
    common(local)
    training(local)
    local.add_argument("--fault", action="append", metavar="KIND:RANK:N",
                       help="inject a fault (repeatable): slow:RANK:MS sleeps MS ms in every "
                            "step of worker RANK; crash:RANK:STEP kills it at local step STEP")
    local.add_argument("--device", default="auto",
                       help="auto (worker R on GPU R mod the GPUs here, where CUDA is "
                            "present; else the CPU), cpu, cuda (the same, but insists on "
                            "GPUs) or cuda:N (every worker on GPU N) (default auto)")
    local.add_argument("--shards", type=int, metavar="S",
                       help="a sharded parameter server: S coordinators, each owning a range "
                            "of the parameters; every worker talks to all of them (default 1)")
    local.add_argument("--colocate", action="store_true",
                       help="no central coordinator: each worker process also serves one "
                            "shard of the parameters, so that each moves about one model a "
                            "step, as a ring all-reduce does (sync and average)")

    coordinator = commands.add_parser("coordinator", help="the coordinator alone")
    common(coordinator)
    training(coordinator, workers_from_env=True)
    coordinator.add_argument("--bind", help="tcp://HOST:PORT for requests (default: "
                                            "tcp://0.0.0.0:PORT with --keys, else "
                                            "tcp://127.0.0.1:PORT, PORT as --port says)")
    coordinator.add_argument("--port", type=int,
                             help="with no --bind, the port to bind (default: "
                                  f"MASTER_PORT, else {cluster.DEFAULT_PORT})")
    coordinator.add_argument("--pub-port", type=int, help="broadcast port (default PORT+1)")
    coordinator.add_argument("--insecure", action="store_true",
                             help="allow a non-loopback --bind without keys")
    coordinator.add_argument("--shard", type=_shard, metavar="I/S",
                             help="be shard I (from 0) of a parameter server of S shards, "
                                  "owning a range of the parameters; start every shard with "
                                  "the same options, and give workers every shard's address "
                                  "in order: --connect ADDR0,ADDR1,...")

    worker = commands.add_parser("worker", help="one worker")
    common(worker)
    worker.add_argument("--connect",
                        help="the coordinator's tcp://HOST:PORT; for a sharded parameter "
                             "server, every shard's, in shard order, separated by commas "
                             "(default: from MASTER_ADDR or SLURM_JOB_NODELIST, see --port)")
    worker.add_argument("--rank", type=int,
                        help="rank to ask for (default: RANK, OMPI_COMM_WORLD_RANK or "
                             "SLURM_PROCID, the first set; else any free rank)")
    worker.add_argument("--port", type=int,
                        help="with no --connect: the coordinator's port, its host being "
                             "MASTER_ADDR or the first of SLURM_JOB_NODELIST (default: "
                             f"MASTER_PORT, else {cluster.DEFAULT_PORT})")
    worker.add_argument("--workers-per-node", type=int, metavar="G",
                        help="start G worker processes here, ranks NODE_RANK*G to "
                             "NODE_RANK*G+G-1, each with LOCAL_RANK set; this process waits "
                             "for them all")
    worker.add_argument("--node-rank", type=int, metavar="N",
                        help="with --workers-per-node: this node's index (default: "
                             "GROUP_RANK, else SLURM_NODEID, else 0)")
    worker.add_argument("--device", default="auto",
                        help="auto (GPU LOCAL_RANK where CUDA is present, else the CPU), cpu, "
                             "cuda (GPU LOCAL_RANK) or cuda:N (default auto)")
    worker.add_argument("--join-timeout", type=float, default=300.0,
                        help="keep trying to join this long, in seconds (default 300)")
    worker.add_argument("--keys", type=Path, metavar="DIR",
                        help="CURVE: DIR holds coordinator.key and this worker's NAME.key_secret")
    shared_memory(worker)
    worker.add_argument("--key-name", default="worker", metavar="NAME",
                        help="which key pair of DIR is this worker's (default: worker)")
    worker.add_argument("--reconnect-timeout", type=float, default=60.0, metavar="SECONDS",
                        help="after losing the coordinator, keep trying to join again this "
                             "long (default 60)")
    worker.add_argument("--fault", action="append", default=[], metavar="KIND:N",
                        help="inject a fault (repeatable): slow:MS or crash:STEP")
    relay = commands.add_parser("relay", help="a relay: coordinator to local workers, worker "
                                              "of a root coordinator (hierarchical averaging)")
    common(relay)
    shared_memory(relay)
    relay.add_argument("--connect", required=True, help="the root coordinator's tcp://HOST:PORT")
    relay.add_argument("--bind", required=True, help="tcp://HOST:PORT for the local workers")
    relay.add_argument("--pub-port", type=int, help="broadcast port (default PORT+1)")
    relay.add_argument("--workers", type=int, required=True, help="local workers to serve")
    relay.add_argument("--strategy", choices=("sync", "average"), default="sync",
                       help="how the local workers' updates are reduced before they go to "
                            "the root: sync under a sync, ssp or async root; average under "
                            "an average root (default sync)")
    relay.add_argument("--average-every", type=int, metavar="H",
                       help="average: the local steps between averages (the root's H)")
    relay.add_argument("--heartbeat", type=float, default=0.5, help="seconds between heartbeats")
    relay.add_argument("--timeout", type=float, default=10.0, help="remove a worker silent this long")
    relay.add_argument("--join-timeout", type=float, default=300.0,
                       help="wait this long for the root and the workers, in seconds "
                            "(default 300)")
    relay.add_argument("--keys", type=Path, metavar="DIR",
                       help="CURVE on both sides: DIR holds this relay's coordinator pair and "
                            "authorized/ (for its workers) and its NAME.key_secret and the "
                            "root's coordinator.key (for the root)")
    relay.add_argument("--key-name", default="worker", metavar="NAME",
                       help="which key pair of DIR the relay shows the root (default: worker)")
    relay.add_argument("--insecure", action="store_true",
                       help="allow a non-loopback --bind without keys")

    keys = commands.add_parser("keys", help="make CURVE key pairs for --keys")
    keys.add_argument("directory", type=Path, metavar="DIR")
    keys.add_argument("--worker", action="append", metavar="NAME",
                      help="a worker key pair to make and authorize (repeatable; default: worker)")
    keys.add_argument("--log-level", choices=LOG_LEVELS, default="warning")
    keys.add_argument("--debug", action="store_true", help="print the traceback of an error")
    keys.set_defaults(threads=None)  # no torch work: main() finds the setting unset

    plot = commands.add_parser("plot", help="plot the --metrics files of runs into a PNG")
    plot.add_argument("metrics", type=Path, nargs="+", metavar="METRICS.jsonl")
    plot.add_argument("-o", "--output", type=Path, required=True, metavar="FILE.png")
    plot.add_argument("--label", action="append", metavar="NAME",
                      help="a run's name in the legend, one per file in order (default: "
                           "the file's name)")
    plot.add_argument("--log-level", choices=LOG_LEVELS, default="warning")
    plot.add_argument("--debug", action="store_true", help="print the traceback of an error")
    plot.set_defaults(threads=None)
    return parser


class _OneLineParser(argparse.ArgumentParser):
    """Usage errors in one line, like every other error, pointing at --help."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
