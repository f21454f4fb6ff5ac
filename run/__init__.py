"""Launching: the `tensorbus` CLI, SPEC loading, and `launch_local` for Python callers.

The only layer that reads argv and the environment. The names below are imported when
first used, not with the package: the `tensorbus` command (`run.entry`) starts without
torch, so that an interrupt while torch is being imported still ends in one line.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {"LocalRunError": "run.local", "launch_local": "run.local", "RunOptions": "run.options",
          "Shards": "run.shards", "Spec": "run.spec", "SpecError": "run.spec",
          "load_spec": "run.spec"}

__all__ = ["LocalRunError", "RunOptions", "Shards", "Spec", "SpecError", "launch_local", "load_spec"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'run' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
