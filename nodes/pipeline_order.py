"""The order in which a pipeline stage runs its micro-batches: GPipe, or 1F1B.

Pure functions of (schedule, stage, stages, micro-batches), used by every stage worker of a
pipeline (nodes.stage_steps) and unit-tested against a simulation of all stages at once.

- **GPipe** (Huang et al. 2019): every forward, then every backward. A stage holds the
  activations of all M micro-batches at once.
- **1F1B** (Narayanan et al. 2019, PipeDream-Flush): stage s of P runs min(P - 1 - s, M)
  forwards to fill the pipeline, then alternates one forward and one backward, then drains
  the backwards left. It holds at most P - s micro-batches' activations: memory bounded by
  the pipeline's depth, not by M. Same bubble as GPipe.

Both flush at the end of each step: the gradients of a step's M micro-batches are
accumulated, then pushed, before the next step's first forward, so that the weights every
stage steps with are those of single-process training on the whole batch. Backwards run in
micro-batch order under both, as single-process accumulation adds them.

With equal forward time f and backward time b on every stage, the step takes
(M + P - 1)(f + b), of which each stage computes M(f + b): the idle share, the bubble, is
(P - 1) / (M + P - 1) (`bubble`).
"""

from __future__ import annotations

import enum
from typing import NamedTuple


class Schedule(str, enum.Enum):
    """How a stage orders its micro-batches (`--schedule`)."""

    ONE_F_ONE_B = "1f1b"  # forwards to fill the pipeline, then one forward, one backward
    GPIPE = "gpipe"  # every forward, then every backward

    @classmethod
    def parse(cls, text: str) -> Schedule:
        try:
            return cls(text)
        except ValueError:
            raise ValueError(f"schedule {text!r}: choose from "
                             f"{', '.join(s.value for s in cls)}") from None


class Op(str, enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"


class Action(NamedTuple):
    op: Op
    micro: int


def order(schedule: Schedule, stage: int, stages: int, micro_batches: int) -> list[Action]:
    """The actions of stage `stage` (from 0) of `stages` for one step of `micro_batches`."""
    if stages < 1 or not 0 <= stage < stages:
        raise ValueError(f"stage {stage} of {stages}: need 0 <= stage < stages")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be at least 1, got {micro_batches}")
    forwards = [Action(Op.FORWARD, m) for m in range(micro_batches)]
    backwards = [Action(Op.BACKWARD, m) for m in range(micro_batches)]
    if schedule is Schedule.GPIPE:
        return forwards + backwards
    warmup = min(stages - 1 - stage, micro_batches)
    actions = forwards[:warmup]
    for m in range(micro_batches - warmup):  # steady: one forward, then the oldest backward
        actions += [forwards[warmup + m], backwards[m]]
    return actions + backwards[micro_batches - warmup:]


def held_at_most(actions: list[Action]) -> int:
    """The most micro-batches whose activations are held at once in `actions` (from a
    forward until its backward)."""
    held = most = 0
    for action in actions:
        held += 1 if action.op is Op.FORWARD else -1
        most = max(most, held)
    return most


def bubble(stages: int, micro_batches: int) -> float:
    """The share of a step a stage waits, with equal stages: (P - 1) / (M + P - 1)."""
    return (stages - 1) / (micro_batches + stages - 1)
