"""Ctrl-C noted from the start of a run, so that one a library swallows still ends the run
as interrupted.

An interrupt raises KeyboardInterrupt, as Python's own handler does, and is also noted.
Some library code catches it in a bare `except:` (the likely reading of two CI runs:
Ctrl-C while the CLI imported torch and the rest, then a RecursionError when the SPEC
imported the same libraries half made). `run.entry` ends the run at once if an interrupt
was noted while it imported, and `run.cli` reports any later failure as the interrupt it
is. Cheap to import: no torch.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType
from typing import Any

_noted = False


def note() -> None:
    """From now on, note each Ctrl-C (main thread only) until a handler of the run's
    own replaces this one. An interrupt raised where Python can only print it (in a
    finalizer or a weakref callback, such as importlib's module locks have) is noted and
    not printed: the run ends as interrupted, in its one line, all the same."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _interrupt)
        sys.unraisablehook = _unraisable


def noted() -> bool:
    """Whether Ctrl-C came since `note`."""
    return _noted


def _unraisable(unraisable: Any) -> None:
    if not (_noted and isinstance(unraisable.exc_value, KeyboardInterrupt)):
        sys.__unraisablehook__(unraisable)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    global _noted
    _noted = True
    raise KeyboardInterrupt
