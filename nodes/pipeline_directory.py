"""Where each stage worker of a run's pipelines listens, for the stages beside it.

A pipeline's stages talk to each other directly (nodes.neighbours), each at an inbox it
binds and names in its Join. Each stage has a coordinator of its own (nodes.coordinator,
serving that stage's parameters to the same stage of every pipeline); one directory,
shared by the stage coordinators of one process (run.pipelines), maps (stage, pipeline) to
the inbox of the worker that holds it now, and a stage worker's Peers request is answered
from it. A worker that leaves, or is removed, is forgotten, so that no stage is sent to a
worker that is gone.
"""

from __future__ import annotations


class PipelineDirectory:
    def __init__(self, stages: int) -> None:
        if stages < 1:
            raise ValueError(f"stages must be at least 1, got {stages}")
        self.stages = stages
        self._inboxes: dict[tuple[int, int], str] = {}  # (stage, pipeline) -> inbox

    def place(self, stage: int, pipeline: int, inbox: str) -> None:
        """The worker of `stage` in `pipeline` listens at `inbox` now."""
        if not 0 <= stage < self.stages:
            raise ValueError(f"stage {stage} of {self.stages}")
        self._inboxes[(stage, pipeline)] = inbox

    def forget(self, stage: int, pipeline: int, inbox: str | None = None) -> None:
        """The worker of `stage` in `pipeline` is gone (if `inbox` is given: only if it
        is still the one listed, not a replacement that joined since)."""
        if inbox is None or self._inboxes.get((stage, pipeline)) == inbox:
            self._inboxes.pop((stage, pipeline), None)

    def neighbours(self, stage: int, pipeline: int) -> tuple[str, str]:
        """The inboxes of the previous and the next stage of `pipeline` ("": none, or not
        joined yet)."""
        return (self._inboxes.get((stage - 1, pipeline), ""),
                self._inboxes.get((stage + 1, pipeline), ""))
