"""Where this process stands in a cluster: its rank, and where the coordinator is, from the
conventions launchers already follow (torchrun, Open MPI's mpirun, Slurm's srun), with the
command's own flags taking precedence. Pure: the environment comes in as a Mapping.

Which launcher's variables win when several are set: the one that started this very process.
Launchers nest, and the outer one describes its own task, not this process:

- torchrun inside an sbatch (`srun torchrun ...`): srun starts one torchrun per task, so
  SLURM_PROCID numbers the torchruns, and RANK, which torchrun sets per process, is ours;
- mpirun inside an sbatch: Open MPI starts its daemons with srun, one per node, so the Slurm
  variables describe a daemon, and OMPI_COMM_WORLD_RANK, set per process, is ours.

Hence torchrun, then Open MPI, then Slurm. A convention counts when its rank variable is set;
its world size and local rank are then read from the same convention, never mixed.

The coordinator's host is MASTER_ADDR, else the first host of the Slurm job's nodelist
(where examples/slurm.sbatch runs the coordinator); its port is --port, else MASTER_PORT,
else DEFAULT_PORT. Nothing here shells out (no `scontrol`): the nodelist is expanded here.

Also: a node's index for `--workers-per-node` (`node_rank`), the coordinator's worker count
(`workers`: WORLD_SIZE, never a Slurm task count), and a node's workers' environment
(`child_environment`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

DEFAULT_PORT: Final = 29500  # torchrun's own default MASTER_PORT


@dataclass(frozen=True)
class Convention:
    """One launcher's variables: rank, world size, local rank and local world size."""

    name: str
    rank: str
    world_size: str
    local_rank: str
    local_world_size: str | None


# In precedence order (see the module docstring for why).
CONVENTIONS: Final = (
    Convention("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    Convention("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
               "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    Convention("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None),
)
NODELISTS: Final = ("SLURM_JOB_NODELIST", "SLURM_NODELIST")  # the second: older Slurm
NODE_RANKS: Final = ("GROUP_RANK", "SLURM_NODEID")  # torchrun's node index, Slurm's


@dataclass(frozen=True, kw_only=True)
class Placement:
    rank: int  # -1: any free rank (the coordinator picks)
    world_size: int | None  # None: not said (or --rank was given: its numbering is its own)
    local_rank: int  # 0 when not said: one process per node
    coordinator_host: str | None  # None: not found; --connect must say it
    coordinator_port: int
    source: str  # where the rank came from: "torchrun", "openmpi", "slurm" or "flags"

    def endpoint(self) -> str:
        """The coordinator's tcp://HOST:PORT; a ValueError saying what to set if unknown."""
        if self.coordinator_host is None:
            raise ValueError(
                "no coordinator address: give --connect tcp://HOST:PORT, or set MASTER_ADDR "
                "(and MASTER_PORT or --port), or run under Slurm (SLURM_JOB_NODELIST)"
            )
        host = self.coordinator_host
        return f"tcp://[{host}]:{self.coordinator_port}" if ":" in host else \
            f"tcp://{host}:{self.coordinator_port}"


def placement(environ: Mapping[str, str], *, rank: int | None = None,
              port: int | None = None) -> Placement:
    """This process's placement: `rank` and `port` (the flags) where given, else the
    environment's. A ValueError, naming the variable, for values that cannot be right."""
    found = _convention(environ)
    world_size: int | None = None
    local_rank = 0
    source = "flags"
    env_rank = -1
    if found is not None:
        source = found.name
        env_rank = _integer(environ, found.rank)
        world_size = _optional(environ, found.world_size, least=1)
        local_rank = _optional(environ, found.local_rank) or 0
        if world_size is not None and env_rank >= world_size:
            raise ValueError(f"{found.rank}={env_rank} is not below "
                             f"{found.world_size}={world_size}")
        local_size = found.local_world_size and _optional(environ, found.local_world_size,
                                                          least=1)
        if local_size and local_rank >= local_size:
            raise ValueError(f"{found.local_rank}={local_rank} is not below "
                             f"{found.local_world_size}={local_size}")
    if rank is not None:  # the flag wins, and the environment's numbering says nothing of it
        env_rank, world_size, source = rank, None, "flags"
    return Placement(rank=env_rank, world_size=world_size, local_rank=local_rank,
                     coordinator_host=_host(environ), coordinator_port=coordinator_port(
                         environ, port), source=source)


def coordinator_port(environ: Mapping[str, str], port: int | None = None) -> int:
    """--port, else MASTER_PORT, else DEFAULT_PORT."""
    if port is not None:
        if not 1 <= port <= 65535:
            raise ValueError(f"--port {port} is not a port (1..65535)")
        return port
    found = _optional(environ, "MASTER_PORT", least=1)
    if found is not None and found > 65535:
        raise ValueError(f"MASTER_PORT={found} is not a port (1..65535)")
    return found or DEFAULT_PORT


def node_rank(environ: Mapping[str, str], flag: int | None = None) -> int:
    """This node's index: --node-rank, else GROUP_RANK (torchrun), else SLURM_NODEID, else
    0 (a single node). Open MPI has no such variable: pass --node-rank there."""
    if flag is not None:
        if flag < 0:
            raise ValueError(f"--node-rank must be at least 0, got {flag}")
        return flag
    for name in NODE_RANKS:
        found = _optional(environ, name)
        if found is not None:
            return found
    return 0


def workers(environ: Mapping[str, str], flag: int | None = None) -> int:
    """The coordinator's worker count: --workers, else WORLD_SIZE (the number of worker
    ranks, as torchrun counts them). SLURM_NTASKS is never used: the coordinator runs as a
    Slurm step of its own, whose task count is 1, not the workers'."""
    if flag is not None:
        return flag
    found = _optional(environ, "WORLD_SIZE", least=1)
    if found is None:
        raise ValueError("the coordinator needs --workers N (or WORLD_SIZE=N in its "
                         "environment): how many workers to train with")
    return found


def expand_hostlist(text: str, variable: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Slurm's compressed hostlist, expanded: `node[01-03,07],gpu-a` -> node01, node02,
    node03, node07, gpu-a. Zero padding is kept; several bracket groups in one name give
    every combination, as Slurm does. A ValueError naming `variable` if it is malformed."""
    hosts: list[str] = []
    for name in _split_top(text, variable):
        if not _NAME.fullmatch(name):
            raise ValueError(f"{variable}={text!r}: cannot read {name!r} as a host list")
        expanded = [""]
        for piece in _PIECE.finditer(name):
            literal, inside = piece.group(1), piece.group(2)
            choices = [literal] if literal is not None else _ranges(inside, text, variable)
            expanded = [head + tail for head in expanded for tail in choices]
        hosts.extend(expanded)
    return hosts


_PIECE = re.compile(r"([^\[\],]+)|\[([^\[\]]*)\]")  # literal text, or a bracket group
_NAME = re.compile(rf"(?:{_PIECE.pattern})+")


def _split_top(text: str, variable: str) -> list[str]:
    """Split at the commas outside brackets; empty names and unbalanced brackets are errors."""
    names, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
        if depth not in (0, 1):
            raise ValueError(f"{variable}={text!r}: unbalanced brackets")
        if c == "," and depth == 0:
            names.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"{variable}={text!r}: unbalanced brackets")
    names.append(text[start:])
    if any(not n.strip() for n in names):
        raise ValueError(f"{variable}={text!r}: an empty host name")
    return [n.strip() for n in names]


def _ranges(inside: str, text: str, variable: str) -> list[str]:
    """`01-03,07` -> 01, 02, 03, 07: each number as wide as the range's first bound."""
    numbers = []
    for part in inside.split(","):
        low, dash, high = part.partition("-")
        high = high if dash else low
        if not (low.isdigit() and high.isdigit() and int(low) <= int(high)):
            raise ValueError(f"{variable}={text!r}: {part!r} is neither a number nor a range "
                             "LOW-HIGH")
        numbers += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
    return numbers


def _host(environ: Mapping[str, str]) -> str | None:
    address = environ.get("MASTER_ADDR", "").strip()
    if address:
        return address
    for name in NODELISTS:
        nodelist = environ.get(name, "").strip()
        if nodelist:
            return expand_hostlist(nodelist, name)[0]
    return None


def _convention(environ: Mapping[str, str]) -> Convention | None:
    return next((c for c in CONVENTIONS if environ.get(c.rank, "").strip()), None)


def _integer(environ: Mapping[str, str], name: str, *, least: int = 0) -> int:
    text = environ[name].strip()
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not an integer") from None
    if value < least:
        raise ValueError(f"{name}={value} must be at least {least}")
    return value


def _optional(environ: Mapping[str, str], name: str, *, least: int = 0) -> int | None:
    """The variable as an integer, or None where it is unset or empty."""
    if not environ.get(name, "").strip():
        return None
    return _integer(environ, name, least=least)


def child_environment(environ: Mapping[str, str], *, rank: int, local_rank: int,
                      local_world_size: int, node_rank: int) -> dict[str, str]:
    """The environment of worker `local_rank` of a node (`--workers-per-node`): ours, with
    torchrun's variables saying where the child stands. Those take precedence over Slurm's
    and Open MPI's, which describe the launching process; WORLD_SIZE is dropped, since ours
    counted launchers, not workers."""
    child = {k: v for k, v in environ.items() if k != "WORLD_SIZE"}
    child.update(RANK=str(rank), LOCAL_RANK=str(local_rank),
                 LOCAL_WORLD_SIZE=str(local_world_size), GROUP_RANK=str(node_rank))
    return child
