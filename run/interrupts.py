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
import threading
from types import FrameType

_noted = False


def note() -> None:
    """From now on, note each Ctrl-C (main thread only) until a handler of the run's
    own replaces this one."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _interrupt)


def noted() -> bool:
    """Whether Ctrl-C came since `note`."""
    return _noted


def _interrupt(signum: int, frame: FrameType | None) -> None:
    global _noted
    _noted = True
    raise KeyboardInterrupt
