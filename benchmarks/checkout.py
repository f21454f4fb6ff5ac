"""How to start the `tensorbus` command of one checkout, whatever is installed.

A checkout whose top holds `__init__.py` is one import package, `tensorbus`, with bus/,
nodes/, strategies/ and run/ as its subpackages: it runs as `python -m tensorbus`, found
through a temporary folder holding a link `tensorbus -> checkout`. An older checkout's
packages were imported by their bare names from its top: it runs as
`python -m run` (bare names allowed) with the checkout on PYTHONPATH. Either way the
command runs that checkout's code, so that benchmarks/ab.py can measure another commit's
tree beside this one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from benchmarks.report import ROOT


def is_one_package(tree: Path) -> bool:
    """Whether `tree` installs as the one package `tensorbus` (a top-level __init__.py)."""
    return (tree / "__init__.py").is_file()


@contextmanager
def cli(tree: Path = ROOT) -> Iterator[tuple[list[str], dict[str, str]]]:
    """The argv that starts `tree`'s tensorbus command (add its subcommand and options)
    and the environment to start it with (run it with cwd=tree); valid inside the block."""
    with tempfile.TemporaryDirectory(prefix="tensorbus-link-") as links:
        if is_one_package(tree):
            (Path(links) / "tensorbus").symlink_to(tree.resolve(), target_is_directory=True)
            # The tree itself too: a SPEC imports examples/ and benchmarks/ from it.
            path, module = [links, str(tree)], "tensorbus"
        else:
            path, module = [str(tree)], "run"
        # (A PYTHONPATH already set stays, after these: what it adds, pyzmq say, is still found.)
        kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        yield [sys.executable, "-m", module], {**os.environ, "PYTHONPATH": os.pathsep.join(path + kept)}


def run_tensorbus(args: list[str], tree: Path = ROOT, *,
                  timeout: float = 3600) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run `tree`'s `tensorbus ARGS` to its end (cwd=tree); what it printed and the wall
    seconds it took. RuntimeError, with the end of its stderr, if it failed."""
    with cli(tree) as (tensorbus, env):
        command = [*tensorbus, *args]
        started = time.monotonic()
        done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True,
                              timeout=timeout, check=False)
        seconds = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr[-2000:]}")
    return done, seconds
