"""Launching: the `tensorbus` CLI, SPEC loading, and `launch_local` for Python callers.

The only layer that reads argv and the environment.
"""

from run.local import LocalRunError, launch_local
from run.options import RunOptions
from run.shards import Shards
from run.spec import Spec, SpecError, load_spec

__all__ = ["LocalRunError", "RunOptions", "Shards", "Spec", "SpecError", "launch_local", "load_spec"]
