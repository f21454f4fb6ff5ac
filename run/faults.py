"""`--fault` flags: stragglers and crashes injected into local runs, for experiments.

`local` takes `slow:RANK:MS` (worker RANK sleeps MS milliseconds in every step),
`crash:RANK:STEP` (worker RANK's process dies abruptly, by SIGKILL, when it reaches local
step STEP, counted from 0) and `memory:RANK:MB` (worker RANK may hold MB megabytes more
than it holds as it starts: a small worker on purpose, to try a model that does not fit);
each repeatable. `local` hands each worker its own share as `worker --fault slow:MS`,
`--fault crash:STEP` or `--fault memory:MB`, the form a single worker takes.

The memory cap is a process setting, made here (`limit_memory`) before the worker builds
its model: the soft RLIMIT_DATA (the memory a process may write: its heap and private
mappings, torch's tensors among them) at what the process holds then (its VmData) plus
MB. An allocation past it fails, as it would on a smaller machine (where the kernel might
kill the process instead).
"""

from __future__ import annotations

import resource
from collections.abc import Iterable
from pathlib import Path

from tensorbus.nodes.faults import Faults
from tensorbus.run.memory import hold_only_what_is_used

KINDS = ("slow", "crash", "memory")


def parse_local(texts: Iterable[str], workers: int) -> dict[int, list[str]]:
    """`local`'s flags as each rank's `worker --fault` flags; ValueError says what is wrong."""
    by_rank: dict[int, list[str]] = {}
    for text in texts:
        parts = text.split(":")
        if len(parts) != 3 or parts[0] not in KINDS:
            raise ValueError(f"--fault {text!r}: write slow:RANK:MS, crash:RANK:STEP or "
                             "memory:RANK:MB")
        kind, rank_text, value = parts
        rank = _integer(rank_text, f"--fault {text!r}: RANK")
        if not 0 <= rank < workers:
            raise ValueError(f"--fault {text!r}: rank {rank} is not one of the {workers} workers")
        by_rank.setdefault(rank, []).append(f"{kind}:{value}")
        parse_worker(by_rank[rank])  # check the value now, not in a worker process
    return by_rank


def parse_worker(texts: Iterable[str]) -> Faults:
    """A worker's own flags (`slow:MS`, `crash:STEP`, `memory:MB`), those its node takes
    (memory is `memory_mb`'s); several slows add up."""
    slow_ms, crash_at = 0, None
    for text in texts:
        kind, _, value = text.partition(":")
        if kind == "slow":
            slow_ms += _integer(value, f"--fault {text!r}: MS", minimum=0)
        elif kind == "crash":
            step = _integer(value, f"--fault {text!r}: STEP", minimum=0)
            crash_at = step if crash_at is None else min(crash_at, step)
        elif kind == "memory":
            _integer(value, f"--fault {text!r}: MB", minimum=1)
        else:
            raise ValueError(f"--fault {text!r}: write slow:MS, crash:STEP or memory:MB")
    return Faults(slow_s=slow_ms / 1000, crash_at=crash_at)


def memory_mb(texts: Iterable[str]) -> int | None:
    """The megabytes a worker's `memory:MB` flags allow it beyond its start (the least of
    them), or None."""
    allowed = [_integer(t.partition(":")[2], f"--fault {t!r}: MB", minimum=1)
               for t in texts if t.partition(":")[0] == "memory"]
    return min(allowed) if allowed else None


def limit_memory(megabytes: int) -> int:
    """Cap this process's writable memory at what it holds now plus `megabytes` (see the
    module's docstring); the cap, in bytes."""
    held = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmData:"):
            held = int(line.split()[1]) * 1024
    hold_only_what_is_used()  # (else each thread's arena would hold 64 MiB of the cap)
    cap = held + (megabytes << 20)
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (cap if hard == resource.RLIM_INFINITY
                                              else min(cap, hard), hard))
    return cap


def _integer(text: str, what: str, *, minimum: int = 0) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{what} must be a whole number, got {text!r}") from None
    if value < minimum:
        raise ValueError(f"{what} must be at least {minimum}, got {value}")
    return value
