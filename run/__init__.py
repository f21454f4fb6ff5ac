"""Launching: the `tensorbus` CLI, SPEC loading, and `launch_local` for Python callers.

The only layer that reads argv and the environment. The names below are imported when
first used, not with the package: the `tensorbus` command (`run.entry`) starts without
torch, so that an interrupt while torch is being imported still ends in one line.
"""

from __future__ import annotations

from typing import Any

from tensorbus.bus import lazy

_WHERE = {"LocalRunError": "local", "launch_local": "local", "RunOptions": "options",
          "Shards": "shards", "Spec": "spec", "SpecError": "spec", "load_spec": "spec"}

__all__ = ["LocalRunError", "RunOptions", "Shards", "Spec", "SpecError", "launch_local", "load_spec"]


def __getattr__(name: str) -> Any:
    return lazy.attribute(__name__, _WHERE, name)
