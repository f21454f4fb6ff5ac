"""Shared test set-up: one torch thread per process (the CI machine has 2 cores), and a
check that the suite leaves no shared-memory segment behind (bus.shared): a file of a
process that is gone would stay in /dev/shm until the machine restarts."""

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


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    deadline = time.monotonic() + 20  # a resource tracker unlinks after its process ended
    while (left := _segments() - _before) and time.monotonic() < deadline:
        time.sleep(0.2)
    if left:
        names = ", ".join(sorted(p.name for p in left))
        print(f"\nshared-memory segments left behind in {_SHM}: {names}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
