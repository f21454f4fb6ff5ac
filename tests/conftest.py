"""Shared test set-up: one torch thread per process (the CI machine has 2 cores), and a
check that the suite leaves no shared-memory segment behind (bus.shared): a file of a
process that is gone would stay in /dev/shm until the machine restarts."""

import gc
import os
import time
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

_SHM = Path("/dev/shm")
_before: set[Path] = set()


def _segments() -> set[Path]:
    return set(_SHM.glob("tensorbus-*")) if _SHM.is_dir() else set()


def pytest_sessionstart(session: pytest.Session) -> None:
    _before.update(_segments())


def _left() -> set[Path]:
    # This process's own segments go at its exit (weakref.finalize), or by its resource
    # tracker if it dies: what nodes built in tests and never closed still holds.
    mine = f"tensorbus-{os.getpid()}-"
    return {p for p in _segments() - _before if not p.name.startswith(mine)}


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    gc.collect()
    deadline = time.monotonic() + 20  # a resource tracker unlinks after its process ended
    while (left := _left()) and time.monotonic() < deadline:
        time.sleep(0.2)
    if left:
        names = ", ".join(sorted(p.name for p in left))
        print(f"\nshared-memory segments left behind in {_SHM} (this is process "
              f"{os.getpid()}): {names}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
