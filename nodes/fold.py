"""A plain SGD step made as the pushes of a version come, not all at once at the end.

In sync, a version waits for its last push, and everything the coordinator does after
that push arrives is on every worker's path to its next compute. A plain SGD step over n
pushed gradients reads them all and the master, and writes the next version: with the
10M-parameter MLP on colocated shards, milliseconds, after the last 20 MB came over TCP and
were checked finite (one more pass). Made push by push instead, into the spare set where
the next version goes anyway (`nodes.master.Master.into_spare`), each push is folded in as it
arrives and checked finite in the same pass (`bus.pieces.fold_checked`); after the last
one, nothing is left to do but publish. The earlier pushes are folded while the
coordinator would otherwise wait for the last.

Invariant: the result is bit for bit the step made at the end (`bus.pieces.fold`), so the
next version does not depend on when pushes came. That holds because a fold takes the
pushes in the order the step takes them (rank order: a strategy's Apply lists its workers
sorted), each with the step's alpha, -lr / n, n being the updates the step averages
(`Strategy.quorum`). A push that comes before a lower rank's is not folded yet; the step
folds it, after the others. At the step, a fold is used only if it is of that version,
with that alpha, and its ranks are the first of the step's; otherwise it is let go of and
the step is made from all the pushes, as before.

A push with a NaN or an infinity is found while it is being folded: the blocks it had
reached are made again from the master and the pushes before it, and it is dropped as
not finite, as a push checked on its own would be.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tensorbus.bus.pieces import BLOCK, Received, fold, fold_checked


def step_alpha(lr: float, scale: float, count: int) -> float:
    """The alpha of a plain SGD step over `count` updates (times `scale`): one expression for
    the fold and the step, so that both use the same float."""
    return -lr * scale / count


def next_to_fold(folded: Sequence[int], rank: int, members: Sequence[int]) -> bool:
    """Whether `rank`'s push is the next to fold after `folded`: the lowest of the live
    `members` not folded yet (any lower one may still push, and the step adds it first)."""
    if folded and rank <= folded[-1]:
        return False
    waiting = [r for r in members if r not in folded]
    return bool(waiting) and rank == min(waiting)


@dataclass
class Fold:
    """The next version of one version's pushes so far, in a spare set (`into`).

    Its owner (`Coordinator`) writes it only under its step lock, and only while it is
    still the coordinator's fold of the version being made: a step that took the fold's
    set (or let go of it) may have published it meanwhile."""

    version: int  # the version the pushes were computed on
    alpha: float  # -lr / the updates the step will average
    into: tuple[torch.Tensor, ...]  # a set from the coordinator's pool
    ranks: list[int] = field(default_factory=list)  # folded, in rank order
    updates: list[tuple[Received, ...]] = field(default_factory=list)  # theirs, in that order
    block: int = BLOCK  # elements folded while in cache (bus.pieces.fold)

    def add(self, master: Sequence[torch.Tensor], rank: int, update: tuple[Received, ...]) -> bool:
        """Fold one push in (checking it finite on the way); False if it is not finite,
        and then the fold is as it was before. Writes only `into`: may run in a thread."""
        with torch.no_grad():
            for b, out in enumerate(self.into):
                base = master[b] if not self.ranks else None
                bad = fold_checked(out, base, update[b], self.alpha, block=self.block)
                if bad is not None:
                    # Its blocks so far, built again without it: every bucket before this
                    # one, and this one up to where it stopped.
                    for c in range(b + 1):
                        fold(self.into[c], master[c], [u[c] for u in self.updates], self.alpha,
                             stop=bad if c == b else None, block=self.block)
                    return False
        self.ranks.append(rank)
        self.updates.append(update)
        return True

    def folded(self, version: int, alpha: float, ranks: Sequence[int]) -> int | None:
        """How many of a step's updates (of `version`, with `alpha`, from `ranks` in the
        step's order) this fold holds already; None if it cannot serve that step."""
        count = len(self.ranks)
        if version != self.version or alpha != self.alpha or list(ranks[:count]) != self.ranks:
            return None
        return count
