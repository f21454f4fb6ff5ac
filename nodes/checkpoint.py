"""Checkpoints of the coordinator's state: written atomically, read back without pickle.

A checkpoint is one file, `ckpt-VVVVVVVVV.pt` for version V, in the checkpoint directory.
It is written to a temporary name in the same directory, flushed to disk (fsync), renamed
into place and the directory fsynced: a crash at any moment leaves either the old newest
checkpoint or the new one, never a torn file under a checkpoint's name. Reading uses
`torch.load(weights_only=True)`, which builds only tensors and plain containers, so a
checkpoint file cannot run code (unlike a pickle).

The state is a plain dict (see nodes.run_checkpoints); this module only writes,
finds, reads and prunes files, and checks the format number and the model's layout.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any, Final

import torch

FORMAT: Final = 1
KEEP: Final = 3  # newest checkpoints kept; older ones are removed after a successful write
_NAME = re.compile(r"^ckpt-(\d{9})\.pt$")


class CheckpointError(Exception):
    """A checkpoint cannot be written or used; the message names the file and why."""


def prepare(directory: Path) -> None:
    """Make `directory` if need be and check that a checkpoint can be written there: a
    run is told now, not at its first checkpoint, well under way."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(prefix=".probe-", dir=directory):
            pass
    except OSError as e:
        raise CheckpointError(f"cannot write checkpoints in {directory}: {e.strerror}: give "
                              "a folder you can write in") from None


def save(directory: Path, state: dict[str, Any], *, keep: int = KEEP) -> Path:
    """Write `state` (with its "version") as the newest checkpoint in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"ckpt-{state['version']:09d}.pt"
    write_atomically(final, {"format": FORMAT, **state})
    for old in _checkpoints(directory)[:-keep]:
        old.unlink(missing_ok=True)
    return final


def write_atomically(path: Path, obj: Any) -> None:
    """torch.save `obj` to `path`: whole or not at all, and on disk when this returns."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def newest(directory: Path) -> Path | None:
    """The newest checkpoint in `directory`, or None if it has none."""
    found = _checkpoints(directory) if directory.is_dir() else []
    return found[-1] if found else None


def read(path: Path) -> dict[str, Any]:
    """Read a checkpoint, whatever model it holds."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file: say which and why
        raise CheckpointError(f"cannot read checkpoint {path}: {type(e).__name__}: {e}") from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a tensorbus checkpoint of format {FORMAT}")
    return state


def load(path: Path, *, layout: str) -> dict[str, Any]:
    """Read a checkpoint and check that it fits this model (its layout digest)."""
    state = read(path)
    if state.get("layout") != layout:
        raise CheckpointError(
            f"{path} holds a model of layout {state.get('layout')}, this SPEC's is {layout}: "
            "resume with the SPEC that wrote it"
        )
    return state


def _checkpoints(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if _NAME.match(p.name))


def _fsync_dir(directory: Path) -> None:
    # The rename is durable only once the directory entry is on disk.
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
