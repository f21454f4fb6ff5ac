"""Periodic weight averaging (local SGD), optionally with a DiLoCo-style outer optimizer,
and optionally streamed in fragments.

Workers own their optimizers: each runs H local steps from the published weights, then
pushes its weights. The round is a barrier like sync's (so this is `Sync` with another
rhythm): when every live member's weights for version v are in, the coordinator averages
them and publishes v+1. With an outer optimizer, the coordinator instead treats
(published - average) as a gradient and takes one SGD step on it (with momentum and
Nesterov as configured; Douillard et al. 2023). With plain SGD and H = 1 this equals sync.

With `fragments` P, the model is cut into P fragments and a version averages one of them
(Douillard et al. 2025, "Streaming DiLoCo"): a worker pushes fragment v mod P every H/P
local steps, so that each fragment is averaged every H steps, as the whole model would
be. It does not wait for the average: it computes its next H/P steps meanwhile, and
before its next push takes the fragment's average, keeping `fragment_mix` of its own
weights of it (the paper's mixing; nodes.streaming). The outer optimizer steps each
fragment's parameters alone, so each has its own momentum.
"""

from __future__ import annotations

from typing import ClassVar

from tensorbus.strategies.base import OuterOptimizer, PushKind, Rhythm, Wait
from tensorbus.strategies.sync import Sync

# What a worker keeps of its own weights of a fragment when the fragment's average comes
# back, H/P local steps after it was pushed (the paper's mixing factor alpha). An even mix:
# replacing them (0, as a non-overlapped sync does) throws away the H/P local steps the
# worker took on that fragment while its average travelled; keeping more lets the workers'
# copies drift further apart between averages.
FRAGMENT_MIX = 0.5


class PeriodicAveraging(Sync):
    name: ClassVar[str] = "average"
    options: ClassVar[frozenset[str]] = frozenset(
        {"average_every", "outer_lr", "outer_momentum", "nesterov", "fragments", "fragment_mix"}
    )

    def __init__(
        self,
        *,
        workers: int,
        average_every: int = 8,
        outer_lr: float | None = None,
        outer_momentum: float = 0.0,
        nesterov: bool = False,
        fragments: int | None = None,
        fragment_mix: float | None = None,
        stall_after_s: float = 30.0,
    ) -> None:
        if average_every < 1:
            raise ValueError(f"average_every must be at least 1, got {average_every}")
        if fragments is not None and not 1 <= fragments <= average_every:
            raise ValueError(f"fragments must be in 1..average_every ({average_every}), "
                             f"got {fragments}")
        if fragments is not None and average_every % fragments:
            raise ValueError(f"average_every ({average_every}) must be a multiple of "
                             f"fragments ({fragments}): one is pushed every H/P local steps")
        if fragment_mix is not None and fragments is None:
            raise ValueError("fragment_mix needs fragments")
        mix = FRAGMENT_MIX if fragment_mix is None else fragment_mix
        if not 0 <= mix < 1:
            raise ValueError(f"fragment_mix must be in [0, 1), got {mix}")
        if fragments is None:
            rhythm = Rhythm(push=PushKind.WEIGHTS, local_steps=average_every, wait=Wait.NEWER)
        else:
            rhythm = Rhythm(push=PushKind.WEIGHTS, local_steps=average_every // fragments,
                            wait=Wait.OVERLAPPED, fragments=fragments, mix=mix)
        super().__init__(workers=workers, stall_after_s=stall_after_s, rhythm=rhythm)
        if outer_lr is None and (outer_momentum or nesterov):
            raise ValueError("outer_momentum or nesterov needs outer_lr")
        self.average_every = average_every
        self.fragments = fragments
        self.outer = (
            OuterOptimizer(lr=outer_lr, momentum=outer_momentum, nesterov=nesterov)
            if outer_lr is not None else None
        )
