"""The trained model as a plain PyTorch state_dict file: `--save FILE.pt` at the end of a
run, and `tensorbus export CHECKPOINT -o FILE.pt` for any checkpoint.

Either file is what `model().load_state_dict(torch.load(FILE))` takes: the parameters by
name, and the model's buffers (BatchNorm's statistics, say) as the coordinator holds them.
It is written atomically, so an interrupted write never leaves half a file under its name.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
from torch import nn

from tensorbus.nodes import checkpoint
from tensorbus.nodes.checkpoint import CheckpointError


def check_writable(path: Path) -> None:
    """Say now, not after training, that `--save` cannot be written."""
    folder = path.parent
    if path.is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        why = ("is a folder" if path.is_dir() else
               f"{folder} is not a folder" if not folder.is_dir() else f"{folder} is not writable")
        raise CheckpointError(f"cannot write --save {path}: {why}: give a file's path in a "
                              "folder you can write in")


def save_model(model: nn.Module, path: Path) -> None:
    """Write `model`'s state_dict to `path` (each tensor on its own: a parameter that is a
    view of a larger buffer is not saved with all of it)."""
    state = {name: t.detach().to("cpu", copy=True) for name, t in model.state_dict().items()}
    _write(state, path, "--save")


def export(source: Path, out: Path) -> Path:
    """Write the model of checkpoint `source` (a file, or a --checkpoint-dir: its newest)
    as a state_dict to `out`; the checkpoint read."""
    path = source
    if source.is_dir():
        found = checkpoint.newest(source)
        if found is None:
            shards = sorted(p.name for p in source.glob("shard-*-of-*"))
            hint = (f": it holds the shards' folders ({', '.join(shards)}), each a range of "
                    "the model, which export cannot join yet" if shards else "")
            raise CheckpointError(f"{source} holds no checkpoint{hint}")
        path = found
    elif not source.exists():
        raise CheckpointError(f"{source}: no such file or folder: give a checkpoint file, or "
                              "the --checkpoint-dir of a run")
    state = checkpoint.read(path)
    names = state.get("names")
    if not names:
        raise CheckpointError(f"{path} holds no parameter names (a coordinator shard's range, "
                              "or written by an older release): it cannot be exported alone")
    weights = state["weights"]
    model: dict[str, torch.Tensor] = {}
    for name, bucket, offset, shape in names:
        model[name] = weights[bucket][offset:offset + math.prod(shape)].view(shape).clone()
    model.update(state.get("buffers") or {})
    _write(model, out, "-o")
    return path


def _write(state: dict[str, torch.Tensor], path: Path, flag: str) -> None:
    try:
        checkpoint.write_atomically(path, state)
    except OSError as e:
        raise CheckpointError(f"cannot write {flag} {path}: {e.strerror or e}: give a path in "
                              "a folder you can write in") from None
