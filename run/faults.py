"""`--fault` flags: stragglers and crashes injected into local runs, for experiments.

`local` takes `slow:RANK:MS` (worker RANK sleeps MS milliseconds in every step) and
`crash:RANK:STEP` (worker RANK's process dies abruptly, by SIGKILL, when it reaches local
step STEP, counted from 0); both repeatable. `local` hands each worker its own share as
`worker --fault slow:MS` or `--fault crash:STEP`, the form a single worker takes.
"""

from __future__ import annotations

from collections.abc import Iterable

from tensorbus.nodes.faults import Faults

KINDS = ("slow", "crash")


def parse_local(texts: Iterable[str], workers: int) -> dict[int, list[str]]:
    """`local`'s flags as each rank's `worker --fault` flags; ValueError says what is wrong."""
    by_rank: dict[int, list[str]] = {}
    for text in texts:
        parts = text.split(":")
        if len(parts) != 3 or parts[0] not in KINDS:
            raise ValueError(f"--fault {text!r}: write slow:RANK:MS or crash:RANK:STEP")
        kind, rank_text, value = parts
        rank = _integer(rank_text, f"--fault {text!r}: RANK")
        if not 0 <= rank < workers:
            raise ValueError(f"--fault {text!r}: rank {rank} is not one of the {workers} workers")
        by_rank.setdefault(rank, []).append(f"{kind}:{value}")
        parse_worker(by_rank[rank])  # check the value now, not in a worker process
    return by_rank


def parse_worker(texts: Iterable[str]) -> Faults:
    """A worker's own flags (`slow:MS`, `crash:STEP`); several slows add up."""
    slow_ms, crash_at = 0, None
    for text in texts:
        kind, _, value = text.partition(":")
        if kind == "slow":
            slow_ms += _integer(value, f"--fault {text!r}: MS", minimum=0)
        elif kind == "crash":
            step = _integer(value, f"--fault {text!r}: STEP", minimum=0)
            crash_at = step if crash_at is None else min(crash_at, step)
        else:
            raise ValueError(f"--fault {text!r}: write slow:MS or crash:STEP")
    return Faults(slow_s=slow_ms / 1000, crash_at=crash_at)


def _integer(text: str, what: str, *, minimum: int = 0) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{what} must be a whole number, got {text!r}") from None
    if value < minimum:
        raise ValueError(f"{what} must be at least {minimum}, got {value}")
    return value
