"""Shared test set-up.

- The layers: a test's folder is its marker (unit: no sockets, no processes; integration:
  one event loop, real ZeroMQ on loopback; system: real processes; gpu: needs a GPU), and
  `@pytest.mark.system` marks a test that starts processes in another folder. A unit or
  integration test has at most UNIT_TIMEOUT_S.
- `@pytest.mark.exclusive`: a test whose figures depend on having the machine to itself (a
  pace, a redo count) runs while no other test of the session does: the session's test
  processes (pytest-xdist) hold a shared lock for each test, such a test the exclusive one.
- `@pytest.mark.colocated`: a test that runs `local --colocate` runs while no other such
  test does (some count the forked workers left by their name).
- One torch thread per process (the CI machine has 2 cores).
- A check that the suite leaves no shared-memory segment behind (bus.shared): a file whose
  creator is gone would stay in /dev/shm until the next sweep. Only segments of processes
  that are gone count, and only those made during the session: a training run of the
  user's beside the suite (its creators alive) is not the suite's.
"""

import contextlib
import fcntl
import gc
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tensorbus.bus.shared import creator_alive

torch.set_num_threads(1)

LAYERS = ("unit", "integration", "system", "gpu")
UNIT_TIMEOUT_S = 30


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        layer = item.path.parent.name
        if layer not in LAYERS or item.get_closest_marker("system") is not None:
            continue
        item.add_marker(getattr(pytest.mark, layer))
        if layer in ("unit", "integration"):
            own = item.get_closest_marker("timeout")
            if own is None or own.args[0] > UNIT_TIMEOUT_S:
                item.add_marker(pytest.mark.timeout(UNIT_TIMEOUT_S), append=False)


_SHM = Path("/dev/shm")
_before: set[Path] = set()


def _segments() -> set[Path]:
    return set(_SHM.glob("tensorbus-*")) if _SHM.is_dir() else set()


def pytest_sessionstart(session: pytest.Session) -> None:
    _before.update(_segments())


def _left() -> set[Path]:
    return {p for p in _segments() - _before if not creator_alive(p.name)}


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    gc.collect()
    deadline = time.monotonic() + 5  # a process ending now unlinks its own
    while (left := _left()) and time.monotonic() < deadline:
        time.sleep(0.2)
    if left:
        names = ", ".join(sorted(p.name for p in left))
        print(f"\nshared-memory segments of processes that are gone left behind in {_SHM}: "
              f"{names}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _lock_folder() -> Path:
    """One folder for the session's test processes: xdist's workers share its run id."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", f"serial-{os.getpid()}")
    folder = Path(tempfile.gettempdir()) / f"tensorbus-tests-{run}"
    folder.mkdir(exist_ok=True)
    return folder


@contextlib.contextmanager
def _locked(path: Path, mode: int) -> Iterator[None]:
    with path.open("a") as f:
        fcntl.flock(f, mode)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def _untimed(request: pytest.FixtureRequest) -> Iterator[None]:
    """The body, a wait for another test's lock, not counted in this test's timeout: its
    timer (pytest-timeout's) starts again once the body is over. (Otherwise a unit test
    that began just after an exclusive test asked for the machine waits out the longest
    test under way and that one too, and times out in its setup.) Each wait is bounded
    all the same, by the timeouts of the tests waited for."""
    item = request.node
    try:
        from pytest_timeout import _get_item_settings  # noqa: PLC0415 - its settings, as it reads them
        settings = _get_item_settings(item)
    except (ImportError, AttributeError, TypeError):
        settings = None
    if settings is None or not settings.timeout or settings.func_only:
        yield
        return
    hooks = item.config.pluginmanager.hook
    hooks.pytest_timeout_cancel_timer(item=item)
    try:
        yield
    finally:
        hooks.pytest_timeout_set_timer(item=item, settings=settings)


@pytest.fixture(autouse=True)
def _colocated(request: pytest.FixtureRequest) -> Iterator[None]:
    """`colocated` tests run one at a time (beside any other test): each forks workers
    named `tb colocated R`, and some count the ones left by that name."""
    if request.node.get_closest_marker("colocated") is None:
        yield
        return
    with contextlib.ExitStack() as held:
        with _untimed(request):
            held.enter_context(_locked(_lock_folder() / "colocated", fcntl.LOCK_EX))
        yield


@pytest.fixture(autouse=True)
def _machine(request: pytest.FixtureRequest) -> Iterator[None]:
    """A shared hold on the machine for each test, an exclusive one for `exclusive` tests.
    Writers first: an exclusive test closes the gate, so that no test begins after it
    asked, then waits for those under way to end."""
    folder = _lock_folder()
    gate, machine = folder / "gate", folder / "machine"
    with contextlib.ExitStack() as held:
        with _untimed(request):
            if request.node.get_closest_marker("exclusive") is not None:
                held.enter_context(_locked(gate, fcntl.LOCK_EX))
                held.enter_context(_locked(machine, fcntl.LOCK_EX))
            else:
                with _locked(gate, fcntl.LOCK_SH):
                    pass
                held.enter_context(_locked(machine, fcntl.LOCK_SH))
        yield
