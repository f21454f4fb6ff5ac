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
import ipaddress
import json
import logging
import sys
import traceback
from pathlib import Path
from typing import Any, NoReturn

import torch

from bus.errors import HandshakeError, PeerTimeoutError, RejectedError
from bus.security import load_client_keys, make_keys
from bus.transport import new_event_loop, split_endpoint
from nodes.config import WorkerConfig
from nodes.coordinator import TrainingError
from nodes.worker import ComputeError, DataError, Worker
from run.faults import parse_worker
from run.local import LocalRunError, launch_local
from run.options import RunOptions, make_coordinator
from run.progress import ProgressLine
from run.signals import stopping_on_signals
from run.spec import SpecError, load_spec
from run.status import StatusTable
from strategies import STRATEGIES

LOG_LEVELS = ("debug", "info", "warning", "error")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s {args.command} %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    if args.threads:
        torch.set_num_threads(args.threads)
    error_prefix = "error: " if args.command == "worker" else "tensorbus: error: "

    def fail(e: BaseException, text: str, status: int) -> int:
        if args.debug:
            traceback.print_exception(e)
        elif e.__cause__ is not None and not isinstance(e.__cause__, _OURS):
            text += " (--debug shows the traceback)"  # the SPEC's own code raised
        print(f"{error_prefix}{text}", file=sys.stderr)
        return status

    try:
        commands = {"local": _local, "coordinator": _coordinator, "worker": _worker,
                    "keys": _keys, "plot": _plot}
        return commands[args.command](args)
    except KeyboardInterrupt as e:
        return fail(e, "interrupted", 130)
    except (SpecError, ValueError) as e:
        return fail(e, str(e), 2)
    except (TrainingError, LocalRunError, DataError, ComputeError, PeerTimeoutError, RejectedError,
            HandshakeError, OSError) as e:
        return fail(e, str(e), 1)
    except Exception as e:  # noqa: BLE001 - a bug: still one line, the traceback on request
        return fail(e, f"internal error: {type(e).__name__}: {e} (a bug in tensorbus: run "
                       "again with --debug and report the traceback)", 1)


# Causes that are ours and already said in full: no traceback would help a user. (A
# ValueError or OSError as a cause came from the SPEC's code or a library: its traceback may.)
_OURS = (SpecError, TrainingError, PeerTimeoutError, RejectedError, HandshakeError)


def _local(args: argparse.Namespace) -> int:
    progress = ProgressLine(sys.stderr) if not args.no_progress else None
    try:
        summary = launch_local(
            args.spec, _run_options(args), on_step=progress, threads=args.threads,
            log_level=args.log_level, status=StatusTable(sys.stderr, every_s=args.status),
            debug=args.debug,
        )
    finally:
        if progress:
            progress.close()
    _print_summary(summary)
    return 0


def _coordinator(args: argparse.Namespace) -> int:
    host, _ = split_endpoint(args.bind)
    if args.keys is None and not args.insecure and not _is_loopback(host):
        raise ValueError(
            f"--bind {args.bind} is not a loopback address and no --keys were given: anyone "
            "who can reach it could join and read the weights; make keys with `tensorbus keys "
            "DIR` and pass --keys DIR, or pass --insecure to accept that"
        )
    spec = load_spec(args.spec)
    progress = ProgressLine(sys.stderr) if not args.no_progress else None
    coordinator = make_coordinator(spec, _run_options(args), bind=args.bind,
                                   pub_port=args.pub_port, on_step=progress)
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


def _worker(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec)
    split_endpoint(args.connect)
    config = WorkerConfig(connect=args.connect, rank=args.rank, device=_device(args.device),
                          join_timeout_s=args.join_timeout, faults=parse_worker(args.fault),
                          reconnect_timeout_s=args.reconnect_timeout,
                          keys=load_client_keys(args.keys, args.key_name) if args.keys else None)
    worker = Worker(model=spec.build_model(), data=spec.data, loss=spec.loss, config=config,
                    optimizer=spec.optimizer)
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        report = runner.run(worker.run())
    logging.getLogger("tensorbus.worker").info(
        "worker %d done: %d pushes, last loss %s", report.rank, report.pushes, report.last_loss
    )
    return 0


def _plot(args: argparse.Namespace) -> int:
    from run.plot import PlotError, plot  # matplotlib: only for this command

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
        trace=args.trace, compress=args.compress or "",
    )


def _device(name: str) -> str:
    if name in ("auto", "cpu"):
        return "cpu"  # GPU workers are not in this release; auto means the CPU here
    raise ValueError(f"--device {name}: only cpu workers exist in this release")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _print_summary(summary: dict[str, Any]) -> None:
    print(json.dumps(summary, indent=1), flush=True)


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="tensorbus", description="Train one PyTorch model on many processes over ZeroMQ."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("spec", help="a SPEC: a Python file or module:object")
        p.add_argument("--threads", type=int, default=None, help="torch threads per process")
        p.add_argument("--log-level", choices=LOG_LEVELS, default="warning")
        p.add_argument("--debug", action="store_true", help="print the traceback of an error")

    def training(p: argparse.ArgumentParser) -> None:
        p.add_argument("--workers", type=int, required=True, help="workers to train with")
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
        p.add_argument("--join-timeout", type=float, default=300.0, help="wait this long for workers")
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
        p.add_argument("--compress", choices=("bf16", "fp16"),
                       help="push gradients in this dtype: half the bytes; the coordinator "
                            "keeps fp32 weights (sync, ssp, async)")
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

    coordinator = commands.add_parser("coordinator", help="the coordinator alone")
    common(coordinator)
    training(coordinator)
    coordinator.add_argument("--bind", required=True, help="tcp://HOST:PORT for requests")
    coordinator.add_argument("--pub-port", type=int, help="broadcast port (default PORT+1)")
    coordinator.add_argument("--insecure", action="store_true",
                             help="allow a non-loopback --bind without keys")

    worker = commands.add_parser("worker", help="one worker")
    common(worker)
    worker.add_argument("--connect", required=True, help="the coordinator's tcp://HOST:PORT")
    worker.add_argument("--rank", type=int, default=-1, help="rank to ask for (default: any)")
    worker.add_argument("--device", default="auto", help="auto or cpu")
    worker.add_argument("--join-timeout", type=float, default=300.0,
                        help="keep trying to join this long")
    worker.add_argument("--keys", type=Path, metavar="DIR",
                        help="CURVE: DIR holds coordinator.key and this worker's NAME.key_secret")
    worker.add_argument("--key-name", default="worker", metavar="NAME",
                        help="which key pair of DIR is this worker's (default: worker)")
    worker.add_argument("--reconnect-timeout", type=float, default=60.0, metavar="SECONDS",
                        help="after losing the coordinator, keep trying to join again this "
                             "long (default 60)")
    worker.add_argument("--fault", action="append", default=[], metavar="KIND:N",
                        help="inject a fault (repeatable): slow:MS or crash:STEP")
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
