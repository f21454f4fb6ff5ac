"""Where a coordinator's next version comes from, when not from its own optimizer step.

A coordinator makes each version from the updates of one Apply decision. By default it
steps its master weights with its optimizer (nodes.stepping). A relay (nodes.relay)
instead sends the mean of the updates to its root, as one worker of it, and takes the
root's next version: it gives its coordinator a `NextVersion`, which leaves the master's
weights (and its model's buffers) as the next version to publish.

Such a coordinator steps nothing and holds no optimizer; it publishes copies of its
master, since the relay's link to its root loads the root's weights into the master's own
buffers (nodes.master, `alias`); and the buffers it publishes are those that came with
the root's weights, while its workers' combination goes up with its updates
(nodes.model_buffers.ServedBuffers, `relay`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tensorbus.bus.pieces import Received


class NextVersion(Protocol):
    async def __call__(self, updates: list[tuple[Received, ...]], scale: float, *, loss: float,
                       samples: int, ranks: Sequence[int]) -> None:
        """Leave the next version in the master's weights: made from `updates` (each a
        worker's, to be summed and multiplied by `scale`), of `samples` samples at `loss`,
        pushed by `ranks`. Raises NoNextVersion where none will come."""


class NoNextVersion(Exception):
    """No next version will come: the coordinator stops, saying `why`, and fails with
    `failure` where there is one (a relay's root that ended its run with an error)."""

    def __init__(self, why: str, failure: str | None = None) -> None:
        super().__init__(failure or why)
        self.why = why
        self.failure = failure
