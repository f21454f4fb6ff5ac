"""A coordinator's checkpoints: what one holds (every part a restarted run needs to go
on), writing one, and resuming from the newest (`--resume`); the same state is what a
standby coordinator follows (nodes.replication), and loads as it takes over. The file
format, its atomic writes and its checks are nodes.checkpoint's.

A checkpoint is written under the coordinator's step lock, so that nothing changes the
state while a thread writes it (the loop keeps beating meanwhile).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from torch import nn

from tensorbus.bus.clock import Clock
from tensorbus.nodes import checkpoint
from tensorbus.nodes.flat import FlatModel
from tensorbus.nodes.master import Master
from tensorbus.nodes.metrics import Metrics
from tensorbus.nodes.model_buffers import ServedBuffers
from tensorbus.nodes.run_length import RunLength
from tensorbus.nodes.schedules import Schedule
from tensorbus.nodes.shards import ShardModel
from tensorbus.nodes.watch import Watch
from tensorbus.strategies.base import Strategy

log = logging.getLogger("tensorbus.coordinator")


class RunCheckpoints:
    def __init__(
        self, directory: Path | None, *, model: nn.Module, flat: FlatModel, master: Master,
        strategy: Strategy, schedule: Schedule | None, length: RunLength, buffers: ServedBuffers,
        metrics: Metrics, watch: Watch, clock: Clock,
    ) -> None:
        self.directory = directory  # None: no checkpoints
        self._model = model
        self._flat = flat
        self._master = master
        self._strategy = strategy
        self._schedule = schedule
        self._length = length
        self._buffers = buffers
        self._metrics = metrics
        self._watch = watch
        self._clock = clock
        # The newest checkpoint as check_resume read it, (path, state), until resume takes it.
        self._checked: tuple[Path, dict[str, Any]] | None = None
        if directory is not None:
            checkpoint.prepare(directory)

    def state(self, version: int, *, to_file: bool = True) -> dict[str, Any]:
        """What a restarted coordinator needs to go on: tensors and plain values only.
        `to_file`: for torch.save, which writes a view's whole storage: a weight buffer
        that is a range of a larger one is copied (a replica sends a view's own bytes)."""
        self._buffers.refresh()
        flat, model, optimizer, schedule = self._flat, self._model, self._master.optimizer, self._schedule
        return {
            "version": version,
            "layout": flat.layout.digest,
            "strategy": self._strategy.name,
            "strategy_state": self._strategy.state(),
            # (Copied where a buffer is a range of a larger one, a colocated shard's: torch
            # saves a view's whole storage.)
            "weights": [w if not to_file or w.untyped_storage().nbytes() == w.numel() * w.element_size()
                        else w.clone() for w in flat.weights],
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "scheduler": ((schedule.scheduler.state_dict(), schedule.epochs_stepped)
                          if schedule is not None else None),
            "samples": self._metrics.samples,
            "target_samples": self._length.target_samples,
            "positions": dict(self._length.positions),
            # What the positions are counted in: each rank's shard of the data, in batches.
            "workers": self._strategy.workers,
            "batch_size": self._length.batch_size,
            # Where each named parameter lies in `weights`, and the model's buffers: what
            # `tensorbus export` makes a state_dict of (a shard's range has no names).
            "names": None if isinstance(model, ShardModel) else [
                [e.name, e.bucket, e.offset, list(e.shape)] for e in flat.layout.entries],
            "buffers": {} if isinstance(model, ShardModel) else {
                name: b.detach().clone() for name, b in model.named_buffers()},
            # The buffers that travel, laid out flat (a shard's too): what a resume loads.
            "model_buffers": list(flat.model_buffers.copy()),
        }

    async def write(self, version: int) -> None:
        """Write a checkpoint of `version`, if configured (and past the first version)."""
        if self.directory is None or version == 0:
            return
        started, wall = self._clock.monotonic(), self._clock.wall()
        path = await asyncio.to_thread(checkpoint.save, self.directory, self.state(version))
        self._watch.span("checkpoint", wall, version=version)
        self._metrics.write("checkpoint", version=version, path=str(path),
                            seconds=round(self._clock.monotonic() - started, 6))
        self._metrics.checkpoint = str(path)
        log.info("checkpoint of version %d written to %s", version, path)

    def resume(self) -> int | None:
        """Load the newest checkpoint of the directory into every part; the version it
        was of, or None if there is none yet (the run starts from scratch)."""
        assert self.directory is not None  # config guarantees it with resume
        path = checkpoint.newest(self.directory)
        if path is None:
            log.warning("--resume: no checkpoint in %s yet: starting from scratch", self.directory)
            return None
        checked, self._checked = self._checked, None
        state = (checked[1] if checked is not None and checked[0] == path
                 else checkpoint.load(path, layout=self._flat.layout.digest))
        version = self.load(state, str(path))
        log.info("resumed from %s at version %d", path, version)
        return version

    def check_resume(self) -> None:
        """Raise now what `resume` would raise (a checkpoint of another model or strategy),
        loading nothing into the parts: a launcher asks before it starts any worker. The
        state read is kept for `resume`, which does not read it again."""
        assert self.directory is not None
        path = checkpoint.newest(self.directory)
        if path is not None:
            state = checkpoint.load(path, layout=self._flat.layout.digest)
            self._check(state, str(path))
            self._checked = (path, state)

    def _check(self, state: dict[str, Any], source: str) -> None:
        strategy = self._strategy  # (the layout is checked where the state is read)
        if state["strategy"] != strategy.name:
            raise checkpoint.CheckpointError(
                f"{source} was written by strategy {state['strategy']}, not {strategy.name}: "
                f"resume with --strategy {state['strategy']}, or give another --checkpoint-dir")

    def load(self, state: dict[str, Any], source: str) -> int:
        """Load `state` (as `state()` makes it: a checkpoint's, or a standby's replica,
        from `source`) into every part; the version it was of."""
        self._check(state, source)
        strategy = self._strategy
        self._master.own()
        self._flat.load(state["weights"])
        if state.get("model_buffers"):  # (older checkpoints lack them)
            self._flat.model_buffers.load(state["model_buffers"])
            self._buffers.loaded()
        optimizer, schedule = self._master.optimizer, self._schedule
        if optimizer is not None and state["optimizer"] is not None:
            optimizer.load_state_dict(state["optimizer"])
        if schedule is not None and state.get("scheduler") is not None:
            scheduler_state, schedule.epochs_stepped = state["scheduler"]
            schedule.scheduler.load_state_dict(scheduler_state)
        version: int = state["version"]
        strategy.restore(state["strategy_state"])
        self._metrics.resumed(version, state["samples"], source)
        self._length.target_samples = state["target_samples"]
        self._length.positions = {int(rank): at for rank, at in state["positions"].items()}
        now = (strategy.workers, self._length.batch_size)
        was = (state.get("workers", now[0]), state.get("batch_size", now[1]))  # (older lack them)
        if was != now:
            log.warning(
                "resuming a run of %d workers with batches of %d as one of %d with batches of "
                "%d: each rank's data goes on from where that rank had got to in its old "
                "shard, so the run does not retrace the one it resumes (same --workers and "
                "--batch-size would)", *was, *now)
        return version
