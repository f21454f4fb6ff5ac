"""Every option of the `tensorbus` command, declared once, and the parser made from them.

Imports nothing heavy (no torch, no ZeroMQ): `tensorbus` parses its arguments first, so
that a mistyped option is answered at once, and only then imports the rest. Groups of
options that several commands take (`_liveness`, `_keys`, ...) are declared once and added
to each; docs/cli.md's reference is printed from this parser (`python -m
tensorbus.run.flags`), and a test keeps the page in step with it.

An option of a training run (`local`, `coordinator`) is declared here only: its `dest` is
the name of the run.options.RunOptions field it sets (`--heartbeat` sets `heartbeat_s`),
and `RunOptions.from_args` copies every field from the dest of its name, but the few that
TO_OPTIONS makes from other dests (`--eval-every` into seconds or epochs, the strategy's
options, ...). The coordinator's configuration is then copied from the RunOptions by field
name (run.options.coordinator_config). NOT_OPTIONS names the dests that set no field; a
test fails on a field no dest feeds and on a dest that feeds nothing.

Usage errors are one line, pointing at --help, with the nearest option or choice when the
one given is a typo.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, NoReturn

from tensorbus.bus.protocol import BUILD, PROTOCOL_VERSION
from tensorbus.run.cluster import DEFAULT_PORT
from tensorbus.strategies import STRATEGIES

LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_STRATEGY = "sync"
# Every strategy option has a flag; which strategy takes which is the strategy's say.
STRATEGY_FLAGS = sorted(set().union(*(cls.options for cls in STRATEGIES.values())))


class OneLineParser(argparse.ArgumentParser):
    """Usage errors in one line, like every other error, pointing at --help, with what was
    probably meant. Options are never abbreviated: `--worker 2` is not `--workers 2`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        hint = _did_you_mean(self, message)
        self.exit(2, f"{self.prog}: error: {message}{hint} (see {self.prog} --help)\n")


def _did_you_mean(parser: argparse.ArgumentParser, message: str) -> str:
    unknown = re.match(r"unrecognized arguments: (.*)", message)
    if unknown:
        known = _option_strings(parser)
        for word in unknown.group(1).split():
            close = difflib.get_close_matches(word.split("=")[0], known, n=1)
            if word.startswith("-") and close:
                return f"; did you mean {close[0]}?"
        return ""
    choice = re.match(r"argument (\S+): invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if choice:
        choices = re.findall(r"'([^']*)'", choice.group(3))
        close = difflib.get_close_matches(choice.group(2), choices, n=1)
        return f"; did you mean {close[0]}?" if close else ""
    return ""


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """The options of `parser` and of its subcommands (an unknown one is reported by the
    top parser, which does not know which subcommand's it was meant to be)."""
    found: list[str] = []
    for action in parser._actions:
        found += [o for o in action.option_strings if o.startswith("--")]
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _option_strings(sub)
    return sorted(set(found))


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """Parse a command line; `launch` hands everything after `--` to its script."""
    argv = list(argv)
    if argv[:1] == ["launch"] and "--" in argv:
        cut = argv.index("--")
        args = parser().parse_args(argv[:cut])
        args.script_args = argv[cut + 1:]
        return args
    return parser().parse_args(argv)


def parser() -> OneLineParser:
    top = OneLineParser(prog="tensorbus",
                        description="Train one PyTorch model on many processes over ZeroMQ.")
    top.add_argument("--version", action="version",
                     version=f"tensorbus {BUILD} (wire protocol {PROTOCOL_VERSION})")
    commands = top.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    local = commands.add_parser("local", help="a coordinator and N workers on this machine")
    _common(local)
    _training(local)
    _faults(local, per_rank=True)
    _device(local, "auto (worker R on GPU R mod the GPUs here, where CUDA is present; else "
                   "the CPU), cpu, cuda (the same, but insists on GPUs) or cuda:N (every "
                   "worker on GPU N) (default auto)")
    local.add_argument("--shards", type=int, metavar="S",
                       help="a sharded parameter server: S coordinators, each owning a range "
                            "of the parameters; every worker talks to all of them (default 1)")
    local.add_argument("--standby", action="store_true",
                       help="also start a standby coordinator, as `coordinator --standby-of` "
                            "does, before the workers: it takes each version's state, and "
                            "would take the run over from a coordinator that stopped "
                            "answering (its metrics, with --metrics: FILE.standby.jsonl)")
    local.add_argument("--colocate", action="store_true",
                       help="no central coordinator: each worker process also serves one "
                            "shard of the parameters, so that each moves about one model a "
                            "step, as a ring all-reduce does (sync and average)")
    pipeline = local.add_argument_group("pipeline stages (a model larger than one worker)")
    pipeline.add_argument("--pipeline", type=int, metavar="P",
                          help="cut the SPEC's stages() into P consecutive stages, one a "
                               "worker: --workers N makes N/P pipelines, each stage's "
                               "parameters served to its N/P workers under --strategy (sync "
                               "or average) (default 1: no pipeline)")
    pipeline.add_argument("--micro-batches", type=int, metavar="M",
                          help="with --pipeline: cut each batch into M micro-batches, which "
                               "flow through the stages one after another (default 1)")
    pipeline.add_argument("--schedule", choices=["1f1b", "gpipe"],
                          help="with --pipeline: the order of each stage's micro-batches: "
                               "1f1b holds at most P of them at once, gpipe all M (default 1f1b)")

    coordinator = commands.add_parser("coordinator", help="the coordinator alone")
    _common(coordinator, spec="a SPEC: a Python file or module:object; none: the model of "
                              "scripts that bring their own loop (tensorbus.init), which "
                              "the first of them describes")
    _training(coordinator, workers_from_env=True)
    coordinator.add_argument("--bind", help="tcp://HOST:PORT for requests (default: "
                                            "tcp://0.0.0.0:PORT with --keys, else "
                                            "tcp://127.0.0.1:PORT, PORT as --port says)")
    coordinator.add_argument("--port", type=int,
                             help="with no --bind, the port to bind (default: MASTER_PORT, "
                                  f"else {DEFAULT_PORT})")
    _serving(coordinator)
    coordinator.add_argument("--shard", type=_shard, metavar="I/S",
                             help="be shard I (from 0) of a parameter server of S shards, "
                                  "owning a range of the parameters; start every shard with "
                                  "the same options, and give workers every shard's address "
                                  "in order: --connect ADDR0,ADDR1,...")
    coordinator.add_argument("--standby-of", metavar="tcp://HOST:PORT",
                             help="be the standby of the coordinator at this address, started "
                                  "with the same SPEC and options: take each version's state "
                                  "from it, and take its run over once it is silent for "
                                  "--timeout; its workers move here by themselves. --bind must "
                                  "name an address they reach")

    launch = commands.add_parser(
        "launch", help="a coordinator and N copies of a script with its own training loop "
                       "(tensorbus.init and DistributedOptimizer) on this machine",
        epilog="Everything after -- goes to the script: tensorbus launch train.py --workers "
               "4 -- --epochs 3")
    launch.add_argument("script", help="the Python script")
    launch.set_defaults(script_args=[])  # (what follows --: see parse)
    launch.add_argument("--threads", type=int, default=None, help="torch threads per process")
    _logging(launch)
    _training(launch)

    worker = commands.add_parser("worker", help="one worker")
    _common(worker)
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
                             f"MASTER_PORT, else {DEFAULT_PORT})")
    worker.add_argument("--workers-per-node", type=int, metavar="G",
                        help="start G worker processes here, ranks NODE_RANK*G to "
                             "NODE_RANK*G+G-1, each with LOCAL_RANK set; this process waits "
                             "for them all")
    worker.add_argument("--node-rank", type=int, metavar="N",
                        help="with --workers-per-node: this node's index (default: "
                             "GROUP_RANK, else SLURM_NODEID, else 0)")
    _device(worker, "auto (GPU LOCAL_RANK where CUDA is present, else the CPU), cpu, cuda "
                    "(GPU LOCAL_RANK) or cuda:N (default auto)")
    worker.add_argument("--stage", type=_stage, metavar="S/P",
                        help="be the worker of stage S (from 0) of a pipeline of P stages "
                             "(the SPEC's stages()), joining that stage's coordinator as the "
                             "rank of its pipeline (`local --pipeline` starts these)")
    worker.add_argument("--join-timeout", type=float, default=300.0, dest="join_timeout_s",
                        metavar="JOIN_TIMEOUT",
                        help="keep trying to join this long, in seconds (default 300)")
    _keys(worker, "CURVE: DIR holds coordinator.key and this worker's NAME.key_secret")
    _shared_memory(worker)
    _key_name(worker, "which key pair of DIR is this worker's (default: worker)")
    worker.add_argument("--standby", metavar="tcp://HOST:PORT",
                        help="the standby of the coordinator at --connect (`coordinator "
                             "--standby-of`): join there when the coordinator does not answer "
                             "(a worker that starts after the standby took the run over); the "
                             "coordinator's heartbeats name its standby anyway")
    worker.add_argument("--reconnect-timeout", type=float, default=60.0, metavar="SECONDS",
                        dest="reconnect_timeout_s",
                        help="after losing the coordinator, keep trying to join again this "
                             "long, counted from when it was last heard (default 60)")
    _faults(worker, per_rank=False)

    relay = commands.add_parser("relay", help="a relay: coordinator to local workers, worker "
                                              "of a root coordinator (hierarchical averaging)")
    _common(relay)
    _shared_memory(relay)
    relay.add_argument("--connect", required=True, help="the root coordinator's tcp://HOST:PORT")
    relay.add_argument("--bind", required=True, help="tcp://HOST:PORT for the local workers")
    relay.add_argument("--workers", type=int, required=True, help="local workers to serve")
    relay.add_argument("--strategy", choices=("sync", "average"), default="sync",
                       help="how the local workers' updates are reduced before they go to "
                            "the root: sync under a sync, ssp or async root; average under "
                            "an average root (default sync)")
    relay.add_argument("--average-every", type=int, metavar="H",
                       help="average: the local steps between averages (the root's H)")
    _liveness(relay, "wait this long for the root and the workers, in seconds (default 300)")
    _keys(relay, "CURVE on both sides: DIR holds this relay's coordinator pair and "
                 "authorized/ (for its workers) and its NAME.key_secret and the root's "
                 "coordinator.key (for the root)")
    _key_name(relay, "which key pair of DIR the relay shows the root (default: worker)")
    _serving(relay)
    _json(relay)

    keys = commands.add_parser("keys", help="make CURVE key pairs for --keys")
    keys.add_argument("directory", type=Path, metavar="DIR")
    keys.add_argument("--worker", action="append", metavar="NAME",
                      help="a worker key pair to make and authorize (repeatable; default: worker)")
    _logging(keys)
    keys.set_defaults(threads=None)  # no torch work: main() finds the setting unset

    exported = commands.add_parser(
        "export", help="write a checkpoint's model as a state_dict (torch.load-able)")
    exported.add_argument("checkpoint", type=Path, metavar="CHECKPOINT",
                          help="a checkpoint file, or a --checkpoint-dir (its newest)")
    exported.add_argument("-o", "--output", type=Path, required=True, metavar="FILE.pt")
    _logging(exported)
    exported.set_defaults(threads=None)

    plot = commands.add_parser("plot", help="plot the --metrics files of runs into a PNG")
    plot.add_argument("metrics", type=Path, nargs="+", metavar="METRICS.jsonl")
    plot.add_argument("-o", "--output", type=Path, required=True, metavar="FILE.png")
    plot.add_argument("--label", action="append", metavar="NAME",
                      help="a run's name in the legend, one per file in order (default: "
                           "the file's name)")
    _logging(plot)
    plot.set_defaults(threads=None)
    return top


def _logging(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", choices=LOG_LEVELS, default="warning")
    p.add_argument("--debug", action="store_true", help="print the traceback of an error")


def _common(p: argparse.ArgumentParser, *, spec: str | None = None) -> None:
    """`spec`: the SPEC's help, where it may be left out (else it is required)."""
    if spec is None:
        p.add_argument("spec", help="a SPEC: a Python file or module:object")
    else:
        p.add_argument("spec", nargs="?", help=spec)
    p.add_argument("--threads", type=int, default=None, help="torch threads per process")
    _logging(p)


def _json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true",
                   help="print the whole summary as JSON on stdout when the run ends, in "
                        "place of its main figures (for scripts)")


def _shared_memory(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-shared-memory", action="store_false", dest="shared_memory",
                   help="every tensor crosses the socket as bytes, even between processes "
                        "of one host (by default, gradients and versions go by reference, "
                        "from shared memory, where both ends see the same /dev/shm)")


def _liveness(p: argparse.ArgumentParser, join_help: str) -> None:
    # (dest: the settings' field names; metavar: as --help has always shown them)
    p.add_argument("--heartbeat", type=float, default=0.5, dest="heartbeat_s",
                   metavar="HEARTBEAT", help="seconds between heartbeats")
    p.add_argument("--timeout", type=float, default=10.0, dest="timeout_s", metavar="TIMEOUT",
                   help="remove a worker silent this long, in seconds (default 10)")
    p.add_argument("--join-timeout", type=float, default=300.0, dest="join_timeout_s",
                   metavar="JOIN_TIMEOUT", help=join_help)


def _keys(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--keys", type=Path, metavar="DIR", help=what)


def _key_name(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--key-name", default="worker", metavar="NAME", help=what)


def _serving(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pub-port", type=int, help="broadcast port (default PORT+1)")
    p.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback --bind without keys")


def _device(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--device", default="auto", help=what)


def _faults(p: argparse.ArgumentParser, *, per_rank: bool) -> None:
    if per_rank:
        p.add_argument("--fault", action="append", metavar="KIND:RANK:N",
                       help="inject a fault (repeatable): slow:RANK:MS sleeps MS ms in every "
                            "step of worker RANK; crash:RANK:STEP kills it at local step STEP; "
                            "memory:RANK:MB lets it use MB megabytes more than it holds as it "
                            "starts (under --pipeline P, worker RANK is stage RANK mod P of "
                            "pipeline RANK div P)")
    else:
        p.add_argument("--fault", action="append", default=[], metavar="KIND:N",
                       help="inject a fault (repeatable): slow:MS, crash:STEP or memory:MB")


def _training(p: argparse.ArgumentParser, *, workers_from_env: bool = False) -> None:
    p.add_argument("--workers", type=int, required=not workers_from_env,
                   help="workers to train with" + (" (default: WORLD_SIZE)"
                                                   if workers_from_env else ""))
    p.add_argument("--strategy", choices=sorted(STRATEGIES), default=DEFAULT_STRATEGY,
                   help=f"the consistency model (default {DEFAULT_STRATEGY})")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, help="versions to apply")
    length.add_argument("--epochs", type=int, help="passes over each worker's shard (default 1)")
    p.add_argument("--batch-size", type=int, default=64, help="per worker (default 64)")
    p.add_argument("--lr", type=float,
                   help="the default SGD's learning rate (default 0.1); a SPEC with its own "
                        "optimizer() sets its own, and --lr beside it is an error")
    p.add_argument("--seed", type=int, default=0, help="seeds the initial weights")
    p.add_argument("--clip-grad-norm", type=float, metavar="X",
                   help="scale each step's gradient to a 2-norm of at most X: the averaged "
                        "gradient at the coordinator (sync, ssp, async), each worker's own "
                        "under average")
    p.add_argument("--precision", choices=["bf16-mixed", "fp16-mixed"],
                   help="run each worker's forward and loss under autocast in bf16 (CPU or "
                        "CUDA) or fp16 (CUDA, with loss scaling); weights, gradients and "
                        "steps stay fp32")
    p.add_argument("--metrics", type=Path, help="write JSON lines here, summary last")
    p.add_argument("--save", type=Path, metavar="FILE.pt",
                   help="write the trained model's state_dict here at the end (what "
                        "model().load_state_dict(torch.load(FILE)) takes)")
    _liveness(p, "wait this long for workers, in seconds (default 300)")
    p.add_argument("--no-progress", action="store_true", help="no progress line")
    _json(p)
    p.add_argument("--status", type=float, nargs="?", const=5.0, metavar="SECONDS",
                   help="print the per-worker status table every SECONDS (default 5); "
                        "it is also printed on SIGUSR1, or Enter on a terminal")
    p.add_argument("--trace", type=Path, metavar="FILE.json",
                   help="write a timeline of the run (Chrome trace events: open it in "
                        "Perfetto or chrome://tracing)")
    p.add_argument("--min-workers", type=int, default=1, metavar="M",
                   help="stop with an error when fewer than M workers are left (default 1)")
    p.add_argument("--max-workers", type=int, metavar="W",
                   help="ranks 0..W-1 exist and data is sharded W ways, so that workers "
                        "beyond --workers may join during training (default: --workers)")
    p.add_argument("--checkpoint-dir", type=Path, metavar="DIR",
                   help="write checkpoints here (atomically; the 3 newest are kept), "
                        "at the end, on SIGTERM or Ctrl-C, and when the run fails")
    p.add_argument("--checkpoint-every", type=int, metavar="K",
                   help="also write a checkpoint every K versions")
    _keys(p, "CURVE: encrypt every socket and admit only the workers whose public keys are "
             "in DIR/authorized (see `tensorbus keys`)")
    p.add_argument("--resume", action="store_true",
                   help="go on from the newest checkpoint in --checkpoint-dir (if any)")
    p.add_argument("--compress", metavar="bf16|fp16|topk:R|int8|int4",
                   help="push gradients in bf16 or fp16 (half the bytes), or as the "
                        "largest R of their elements (topk:0.01: 1%%, with error "
                        "feedback) (sync, ssp, async); under average, push each worker's "
                        "change to the weights as 8- or 4-bit integers with a scale per 64 "
                        "(with error feedback); the coordinator keeps fp32 weights")
    _shared_memory(p)
    p.add_argument("--eval-every", type=_eval_every, metavar="SECONDS|Nep",
                   help="copy the weights every SECONDS of training, or at the end of every "
                        "N epochs (1ep), and evaluate the copies after training (accuracy "
                        "against time, in --metrics)")
    s = p.add_argument_group("strategy options")
    s.add_argument("--backups", type=int, metavar="K",
                   help="sync: step on the first WORKERS-K gradients of a version")
    s.add_argument("--staleness", type=int, metavar="S",
                   help="ssp: clocks differ by at most S+1 (default 2)")
    s.add_argument("--staleness-lr", action=argparse.BooleanOptionalAction, default=None,
                   help="ssp, async: divide each step by 1 + its staleness (default off)")
    s.add_argument("--momentum-correction", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="ssp, async: lower the optimizer's momentum by 1 - 1/WORKERS and "
                        "scale each gradient by 1/WORKERS, for the momentum stale updates "
                        "add (default on)")
    s.add_argument("--average-every", type=int, metavar="H",
                   help="average, async-average: local steps between averages (default 8)")
    s.add_argument("--outer-lr", type=float,
                   help="average: SGD on the averaged change with this lr (DiLoCo); "
                        "async-average: on each change, at 1/N")
    s.add_argument("--outer-momentum", type=float,
                   help="average: its momentum; async-average: delayed Nesterov momentum, "
                        "taken every N changes on their sum")
    s.add_argument("--nesterov", action="store_true", default=None,
                   help="average: Nesterov momentum for the outer SGD")
    s.add_argument("--momentum-every", type=int, metavar="N",
                   help="async-average with --outer-momentum: the N of delayed Nesterov "
                        "(default: --workers)")
    s.add_argument("--dynamic-steps", action="store_true", default=None,
                   help="async-average: scale each worker's H to its speed, H times its "
                        "speed over the fastest worker's (dynamic local updates)")
    s.add_argument("--fragments", type=int, metavar="P",
                   help="average: stream the averages: cut the model into P fragments and "
                        "push one every H/P local steps, computing on while it travels "
                        "(Streaming DiLoCo); H must be a multiple of P")
    s.add_argument("--fragment-mix", type=float, metavar="A",
                   help="average with --fragments: when a fragment's average comes back, "
                        "each worker keeps A of its own weights of it and takes 1-A of the "
                        "average (default 0.5)")


def _shards(args: argparse.Namespace) -> int:
    """How many coordinator shards: `local --shards S`, or S of `coordinator --shard I/S`."""
    if getattr(args, "shard", None) is not None:
        return int(args.shard[1])
    return int(getattr(args, "shards", None) or 1)


# How a parsed `local` or `coordinator` command line becomes run.options.RunOptions. A field
# is set from the dest of its name (a flag left unset, or one this command lacks, leaves
# the field's default), but for these fields, each made from the dests the function reads:
TO_OPTIONS: Final[Mapping[str, Callable[[argparse.Namespace], Any]]] = {
    "strategy_options": lambda args: {name: getattr(args, name) for name in STRATEGY_FLAGS
                                      if getattr(args, name) is not None},
    "faults": lambda args: tuple(getattr(args, "fault", None) or ()),  # `local` only
    "eval_every_s": lambda args: args.eval_every if isinstance(args.eval_every, float) else None,
    "eval_every_epochs": lambda args: (int(args.eval_every[:-2])
                                       if isinstance(args.eval_every, str) else None),
    "shards": _shards,
}
# The dests of `local` and `coordinator` that set no RunOptions field of their own name:
# read by TO_OPTIONS above, or this process's or this node's own settings (run.cli).
NOT_OPTIONS: Final = frozenset({
    "help", "spec", "threads", "log_level", "debug", "device", "no_progress",
    "json", "status", "bind", "port", "pub_port", "insecure", "standby_of", "standby",
    "fault", "eval_every", "shard", *STRATEGY_FLAGS,  # read by TO_OPTIONS
})


def _eval_every(text: str) -> float | str:
    """`--eval-every`: seconds (a number), or epochs ("1ep"), kept as given."""
    if text.endswith("ep"):
        if not text[:-2].isdigit():
            raise argparse.ArgumentTypeError(f"{text!r}: write a whole number of epochs, 1ep")
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither seconds (30) nor epochs "
                                         "(1ep)") from None


def _stage(text: str) -> tuple[int, int]:
    """`worker --stage S/P`: this worker holds stage S (from 0) of P."""
    try:
        index, count = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not S/P (this worker's stage from 0, "
                                         "then the stages of the pipeline), e.g. 1/4") from None
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"{text!r}: the stage must be in 0..P-1")
    return index, count


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


def as_argv(command: str, args: argparse.Namespace) -> list[str]:
    """The options of `command` that `args` (another command's) set away from `command`'s
    defaults, as a command line: how `local --standby` starts its standby `coordinator`
    with the run's own options."""
    (commands,) = [a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)]
    argv: list[str] = []
    for action in commands.choices[command]._actions:
        if not action.option_strings or not hasattr(args, action.dest):
            continue
        value, flag = getattr(args, action.dest), action.option_strings[-1]
        if value is None or value == action.default or action.dest in ("help", "version"):
            continue
        if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
            argv.append(flag)
        elif isinstance(action, argparse._AppendAction):
            argv += [f"{flag}={v}" for v in value]
        else:
            argv.append(f"{flag}={value}")
    return argv


def reference() -> str:
    """docs/cli.md's reference: every command's usage and options, as --help gives them."""
    top = parser()
    (commands,) = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    parts = []
    for name, sub in commands.choices.items():
        sub.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=96)
        parts.append(f"### `tensorbus {name}`\n\n```text\n{sub.format_help().rstrip()}\n```\n")
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m tensorbus.run.flags`: print docs/cli.md's reference."""
    del argv
    sys.stdout.write(reference())
    return 0


if __name__ == "__main__":
    sys.exit(main())
